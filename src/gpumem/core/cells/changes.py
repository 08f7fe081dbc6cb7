"""A cell's figures per CUDA device and for the host: before, after and peak, from two snapshots and
what was sampled in between. Whether a peak is exact is :mod:`gpumem.core.peaks`' rule."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from gpumem.core.cells.active import ActiveCell
from gpumem.core.cells.record import DeviceChange, HostChange
from gpumem.core.devices import describe_devices
from gpumem.core.peaks import PeakResetCounter, cell_peak
from gpumem.core.sources import AllocatorReading, Snapshot

__all__ = ["cuda_note", "device_changes", "host_change", "selected"]


def selected(device: int, devices: tuple[int, ...] | None) -> bool:
    """Whether ``device`` is among those asked for (None: every device)."""
    return devices is None or device in devices


def _in_use(before: AllocatorReading | None, after: AllocatorReading) -> bool:
    if after.reserved_bytes or after.allocated_bytes or after.peak_allocated_bytes:
        return True
    return before is not None and bool(before.reserved_bytes or before.allocated_bytes)


def device_changes(
    cell: ActiveCell, start: Snapshot, end: Snapshot, devices: tuple[int, ...] | None, resets: PeakResetCounter
) -> tuple[DeviceChange, ...]:
    """One change per device asked for, or, when none was asked for, per device in use."""
    changes: list[DeviceChange] = []
    for after in end.allocator:
        device = after.device
        if not selected(device, devices):
            continue
        before = start.allocator_for(device)
        if devices is None and not _in_use(before, after):
            continue
        changes.append(_device_change(cell, before, after, start, end, resets))
    return tuple(changes)


def _device_change(
    cell: ActiveCell,
    before: AllocatorReading | None,
    after: AllocatorReading,
    start: Snapshot,
    end: Snapshot,
    resets: PeakResetCounter,
) -> DeviceChange:
    device = after.device
    allocated_before = before.allocated_bytes if before is not None else 0
    reserved_before = before.reserved_bytes if before is not None else 0
    peak = cell_peak(
        before,
        after,
        max(cell.sampled_allocated.get(device, 0), allocated_before, after.allocated_bytes),
        max(cell.sampled_reserved.get(device, 0), reserved_before, after.reserved_bytes),
        reset_at_start=device in cell.reset_devices,
        reset_in_cell=resets.reset_since(device, cell.resets_at_start),
    )
    used_before = start.device_for(device)
    used_after = end.device_for(device)
    return DeviceChange(
        device=device,
        allocated_before_bytes=allocated_before,
        allocated_after_bytes=after.allocated_bytes,
        reserved_before_bytes=reserved_before,
        reserved_after_bytes=after.reserved_bytes,
        peak_allocated_bytes=peak.allocated_bytes,
        peak_exact=peak.exact,
        peak_note=peak.note,
        peak_reserved_bytes=peak.reserved_bytes,
        used_before_bytes=used_before.used_bytes if used_before is not None else None,
        used_after_bytes=used_after.used_bytes if used_after is not None else None,
        total_bytes=used_after.total_bytes if used_after is not None else None,
        initialized_in_cell=before is None,
        process_used_after_bytes=used_after.process_used_bytes if used_after is not None else None,
    )


def host_change(cell: ActiveCell, start: Snapshot, end: Snapshot) -> HostChange | None:
    """Resident memory across the cell; the peak is exact when the lifetime peak rose during it."""
    if start.host is None or end.host is None:
        return None
    before, after = start.host, end.host
    if after.peak_rss_bytes > before.peak_rss_bytes:
        return HostChange(before.rss_bytes, after.rss_bytes, after.peak_rss_bytes, True)
    sampled = max(cell.sampled_rss, before.rss_bytes, after.rss_bytes)
    return HostChange(before.rss_bytes, after.rss_bytes, sampled, False)


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
