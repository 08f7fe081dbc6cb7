"""Why nvidia-smi shows more than torch: the device's used memory split by who uses it.

NVML's "used" counts every process on the device. This process's own share (NVML's per-process figure)
holds PyTorch's reserved memory plus what lives outside PyTorch's allocator: the CUDA context, library
handles (cuBLAS, cuDNN), NCCL buffers, other allocators. NVML's "used" also counts what the driver keeps
for itself (a few hundred MiB on a data-centre GPU with no process on it), which NVML's v2 figure names.
Other processes are what NVML lists for them; what is left (an H200 shows 8.8 MiB once this process has
a context, with no other process listed) is held by no process NVML lists, and is called that. Where the
driver or the list does not say, the parts they would name are one figure, labelled as such.
"""

from __future__ import annotations

from typing import NamedTuple

from gpumem.core.readers.readings import Snapshot
from gpumem.core.units import format_bytes

__all__ = ["DeviceSplit", "device_split", "device_split_text", "split_of"]


class DeviceSplit(NamedTuple):
    """``used_bytes`` = ``reserved_bytes`` + ``outside_torch_bytes`` + ``driver_bytes`` + ``other_bytes``
    + ``unlisted_bytes`` for one device (each of the last two counted in ``other_bytes`` where it is None)."""

    device: int
    used_bytes: int  # NVML: the whole device, all processes
    reserved_bytes: int  # PyTorch's caching allocator in this process
    outside_torch_bytes: int | None  # this process beyond PyTorch's reserve; None without NVML's per-process figure
    other_bytes: int | None  # other processes (and what driver_bytes, unlisted_bytes would name where None)
    process_bytes: int | None  # NVML's figure for this process
    driver_bytes: int | None = None  # the driver's own reservation; None when the driver does not say
    unlisted_bytes: int | None = None  # held by no process NVML lists; None when the list is not known


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
    return split_of(
        device,
        reading.used_bytes,
        reserved,
        reading.process_used_bytes,
        reading.driver_reserved_bytes,
        reading.others_used_bytes,
    )


def split_of(
    device: int, used: int, reserved: int, process: int | None, driver: int | None = None, others: int | None = None
) -> DeviceSplit:
    """The split from NVML's device, per-process and driver figures, the other processes NVML lists and
    PyTorch's reserve (read together, a moment apart: no part is ever negative, the later ones give way)."""
    if process is None:
        return DeviceSplit(device, used, reserved, None, None, None)
    outside = max(process - reserved, 0)
    rest = max(used - process, 0)
    if driver is not None:
        driver = min(driver, rest)
        rest -= driver
    if driver is None or others is None:  # what is left cannot be told apart
        return DeviceSplit(device, used, reserved, outside, rest, process, driver)
    others = min(others, rest)
    return DeviceSplit(device, used, reserved, outside, others, process, driver, rest - others)


def device_split_text(split: DeviceSplit) -> str:
    """``device used 2.1 GiB = PyTorch reserved 1.5 GiB + this process outside PyTorch 520 MiB (...) + ...``."""
    head = f"device used {format_bytes(split.used_bytes)} = PyTorch reserved {format_bytes(split.reserved_bytes)}"
    if split.outside_torch_bytes is None or split.other_bytes is None:
        rest = max(split.used_bytes - split.reserved_bytes, 0)
        return head + f" + {format_bytes(rest)} outside PyTorch (CUDA contexts, libraries, other processes, the driver)"
    own = f" + this process outside PyTorch {format_bytes(split.outside_torch_bytes)} (CUDA context, libraries)"
    return head + own + "".join(f" + {label} {format_bytes(size)}" for label, size in _outside_parts(split))


def _outside_parts(split: DeviceSplit) -> list[tuple[str, int]]:
    """The parts outside this process, each named as far as NVML names it ("other processes" always, 0 B
    included: that no one else holds any is worth saying; the driver and the unlisted part where not 0)."""
    assert split.other_bytes is not None
    if split.driver_bytes is None:
        return [("other processes (and the driver)", split.other_bytes)]
    driver = [("driver and firmware", split.driver_bytes)] if split.driver_bytes else []
    unlisted = [("held by no process NVML lists", split.unlisted_bytes)] if split.unlisted_bytes else []
    return [*driver, ("other processes", split.other_bytes), *unlisted]
