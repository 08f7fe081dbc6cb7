"""Why nvidia-smi shows more than torch: the device's used memory split by who uses it.

NVML's "used" counts every process on the device. This process's own share (NVML's per-process figure)
holds PyTorch's reserved memory plus what lives outside PyTorch's allocator: the CUDA context, library
handles (cuBLAS, cuDNN), NCCL buffers, other allocators. NVML's "used" also counts what the driver keeps
for itself (a few hundred MiB on a data-centre GPU with no process on it), which NVML's v2 figure names;
the rest is other processes. Where the driver does not say, the two are one figure, labelled as such.
"""

from __future__ import annotations

from typing import NamedTuple

from gpumem.core.readers.readings import Snapshot
from gpumem.core.units import format_bytes

__all__ = ["DeviceSplit", "device_split", "device_split_text", "split_of"]


class DeviceSplit(NamedTuple):
    """``used_bytes`` = ``reserved_bytes`` + ``outside_torch_bytes`` + ``driver_bytes`` + ``other_bytes``
    for one device (``driver_bytes`` counted in ``other_bytes`` where it is None)."""

    device: int
    used_bytes: int  # NVML: the whole device, all processes
    reserved_bytes: int  # PyTorch's caching allocator in this process
    outside_torch_bytes: int | None  # this process beyond PyTorch's reserve; None without NVML's per-process figure
    other_bytes: int | None  # other processes (and the driver's reservation where driver_bytes is None)
    process_bytes: int | None  # NVML's figure for this process
    driver_bytes: int | None = None  # the driver's own reservation; None when the driver does not say


def device_split(snapshot: Snapshot, device: int) -> DeviceSplit | None:
    """The split for ``device`` from a snapshot taken with ``process_memory=True``; None without NVML.

    Without the per-process figure (containers often hide other PIDs, or MIG) only ``used`` and
    ``reserved`` are known and the two other parts are None.
    """
    reading = snapshot.device_for(device)
    if reading is None:
        return None
    allocator = snapshot.allocator_for(device)
    reserved = allocator.reserved_bytes if allocator is not None else 0
    return split_of(device, reading.used_bytes, reserved, reading.process_used_bytes, reading.driver_reserved_bytes)


def split_of(device: int, used: int, reserved: int, process: int | None, driver: int | None = None) -> DeviceSplit:
    """The split from NVML's device, per-process and driver figures and PyTorch's reserve (read together)."""
    if process is None:
        return DeviceSplit(device, used, reserved, None, None, None)
    outside = max(process - reserved, 0)  # NVML samples a moment apart from the allocator: never negative
    if driver is not None:
        driver = min(driver, max(used - process, 0))
    other = max(used - process - (driver or 0), 0)
    return DeviceSplit(device, used, reserved, outside, other, process, driver)


def device_split_text(split: DeviceSplit) -> str:
    """``device used 2.1 GiB = PyTorch reserved 1.5 GiB + this process outside PyTorch 520 MiB (...) + ...``."""
    head = f"device used {format_bytes(split.used_bytes)} = PyTorch reserved {format_bytes(split.reserved_bytes)}"
    if split.outside_torch_bytes is None or split.other_bytes is None:
        rest = max(split.used_bytes - split.reserved_bytes, 0)
        return head + f" + {format_bytes(rest)} outside PyTorch (CUDA contexts, libraries, other processes, the driver)"
    if split.driver_bytes is None:
        others = f" + other processes (and the driver) {format_bytes(split.other_bytes)}"
    elif split.driver_bytes:
        others = (
            f" + driver and firmware {format_bytes(split.driver_bytes)}"
            f" + other processes {format_bytes(split.other_bytes)}"
        )
    else:
        others = f" + other processes {format_bytes(split.other_bytes)}"
    own = f" + this process outside PyTorch {format_bytes(split.outside_torch_bytes)} (CUDA context, libraries)"
    return head + own + others
