"""Why a cell's report shows no CUDA device, or not the one asked for.

The figures themselves are a measured stretch's (:class:`gpumem.core.spans.Stretch`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from gpumem.core.devices import describe_devices
from gpumem.core.sources import Snapshot
from gpumem.core.spans import DeviceChange

__all__ = ["cuda_note"]


def cuda_note(
    requested: tuple[int, ...] | None,
    devices: Sequence[DeviceChange],
    end: Snapshot,
    status: Callable[[], Mapping[str, str]],
) -> str | None:
    """Why a requested device, or any device, is missing from the report (None: nothing is missing).
    ``status`` is the monitor's, read only when no device is reported."""
    if requested is not None:
        shown = {change.device for change in devices}
        missing = ", ".join(f"cuda:{d}" for d in requested if d not in shown)
        if not missing:
            return None
        visible = sorted(reading.device for reading in end.allocator)
        if visible:  # CUDA is initialized, so the allocator lists every device this process can use
            return f"{missing}: no such device; this process sees {describe_devices(visible)}"
        return f"{missing}: not initialized in this process (no PyTorch tensor has been put there)"
    if devices:
        return None
    try:
        torch_status = status().get("torch", "unavailable")
    except Exception as error:
        torch_status = f"unavailable: {type(error).__name__}: {error}"
    if torch_status == "ok":
        return "CUDA is initialized but no device has allocated memory"
    return "CUDA is not in use: " + torch_status.removeprefix("unavailable: ")
