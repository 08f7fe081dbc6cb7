"""A poisoned CUDA context, recorded in one place: after a sticky CUDA error every later CUDA call fails.

A device-side assert (an out-of-range index on CUDA), an illegal memory access and a few other kernel
faults leave the process's CUDA context in an error state: every later CUDA call raises the same error
until the process ends, while PyTorch's allocator counters still read (they are host-side numbers that
no longer mean anything). gpumem records the first such error here, per device: since which cell, and
what it was. From then on the memory sources stop reading the allocator of that device (its figures
stay frozen at the last good reading), gpumem makes no CUDA call there again (``empty_cache``, peak
resets, snapshots), and the reports, ``%gpumem status`` and the panel say so; NVML and host memory are
still read. Nothing clears a record but the end of the process (a kernel restart).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from typing import NamedTuple

from gpumem.core.readers.readings import AllocatorReading
from gpumem.core.units import format_bytes

__all__ = [
    "FROZEN_PREFIX",
    "CudaFault",
    "clear_faults",
    "cuda_faults",
    "fault_explanation",
    "fault_for",
    "frozen_note",
    "healthy",
    "is_sticky_cuda_error",
    "record_fault",
    "status_text",
    "sticky_cuda_error",
    "take_untold",
]

# The CUDA errors that leave the context unusable (cudaGetErrorString's texts, as PyTorch quotes them).
_STICKY = (
    "device-side assert triggered",
    "an illegal memory access was encountered",
    "unspecified launch failure",
    "an illegal instruction was encountered",
    "misaligned address",
    "invalid program counter",
    "uncorrectable ECC error encountered",
    "unrecoverable error",
    "hardware stack error",
    "warp illegal address",
)
FROZEN_PREFIX = "CUDA figures frozen"


class CudaFault(NamedTuple):
    """The first sticky CUDA error seen on a device."""

    device: int
    cell: int | None  # the execution count of the cell where it happened; None: seen outside a cell
    error: str  # its first line, e.g. "torch.AcceleratorError: CUDA error: device-side assert triggered"
    last_good: AllocatorReading | None  # the allocator's figures at the last good reading

    @property
    def where(self) -> str:
        return f"since cell [{self.cell}]" if self.cell is not None else "since gpumem saw it"


def sticky_cuda_error(error: BaseException | None) -> str | None:
    """The sticky CUDA error text in ``error`` (or what caused it), or None when it is not one."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, RuntimeError):  # torch.AcceleratorError is a RuntimeError
            text = str(error)
            for sticky in _STICKY:
                if sticky in text:
                    return sticky
        error = error.__cause__ or error.__context__
    return None


def is_sticky_cuda_error(error: BaseException | None) -> bool:
    return sticky_cuda_error(error) is not None


class _Faults:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.by_device: dict[int, CudaFault] = {}
        self.told: set[int] = set()  # devices whose fault has been explained under a cell


_faults = _Faults()


def _current() -> dict[int, CudaFault]:
    if _faults.pid != os.getpid():  # a forked child has a CUDA context of its own (or none)
        _faults.by_device, _faults.told, _faults.pid = {}, set(), os.getpid()
    return _faults.by_device


def _first_line(error: BaseException) -> str:
    kind = type(error)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{name}: {lines[0]}" if lines else name


def _current_device() -> int:
    """The device the failing call ran on: torch's current device (a host-side value; no CUDA call once set)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        return int(cuda.current_device()) if cuda is not None and cuda.is_initialized() else 0
    except Exception:
        return 0


def record_fault(
    error: BaseException,
    cell: int | None,
    readings: Sequence[AllocatorReading] = (),
    device: int | None = None,
) -> CudaFault | None:
    """Record ``error`` if it is a sticky CUDA error on a device not yet recorded; the new record, else None.

    ``readings`` are the last good allocator figures (the newest reading of each device before the error).
    """
    if not is_sticky_cuda_error(error):
        return None
    device = _current_device() if device is None else device
    last = next((reading for reading in readings if reading.device == device), None)
    with _faults.lock:
        faults = _current()
        if device in faults:
            return None
        fault = CudaFault(device, cell, _first_line(error), last)
        faults[device] = fault
    return fault


def cuda_faults() -> dict[int, CudaFault]:
    """Every device whose CUDA context is in an error state, by device."""
    with _faults.lock:
        return dict(_current())


def fault_for(device: int) -> CudaFault | None:
    with _faults.lock:
        return _current().get(device)


def healthy(devices: Sequence[int]) -> tuple[int, ...]:
    """The devices of ``devices`` whose CUDA context is usable (the ones gpumem still calls CUDA on)."""
    with _faults.lock:
        faults = _current()
        return tuple(device for device in devices if device not in faults)


def take_untold() -> list[CudaFault]:
    """The faults not explained under a cell yet, now marked explained: each is said once, wherever seen first."""
    with _faults.lock:
        untold = [fault for device, fault in _current().items() if device not in _faults.told]
        _faults.told.update(fault.device for fault in untold)
    return untold


def clear_faults() -> None:
    """Forget every record (tests only: a real poisoned context is cleared only by a restart)."""
    with _faults.lock:
        _current().clear()
        _faults.told.clear()


def _last_good(fault: CudaFault) -> str:
    reading = fault.last_good
    if reading is None:
        return "no reading of its allocator was taken before it"
    allocated, reserved = format_bytes(reading.allocated_bytes), format_bytes(reading.reserved_bytes)
    return f"the last good reading: allocated {allocated}, reserved {reserved}"


def fault_explanation(fault: CudaFault, cell: int | None = None) -> str:
    """Said once, under the cell where it happened (``cell``), or else under the first one measured after."""
    if fault.cell is not None and fault.cell == cell:
        when = "after this cell"
    elif fault.cell is not None:
        when = f"since cell [{fault.cell}]"
    else:
        when = "(a call gpumem made failed with it)"
    return (
        f"CUDA on cuda:{fault.device} is in an error state {when} ({fault.error}): every later CUDA call "
        f"in this process fails, so gpumem's CUDA figures are frozen at {_last_good(fault)}; NVML and host "
        "memory are still read. Only restarting the kernel clears it (to see which operation failed, run the cell "
        "again in a new kernel with CUDA_LAUNCH_BLOCKING=1 set before torch starts)"
    )


def frozen_note(faults: dict[int, CudaFault]) -> str | None:
    """For a later cell's report: its CUDA figures are not ±0, they are unknown."""
    if not faults:
        return None
    parts = [f"cuda:{fault.device} {fault.where} ({_last_good(fault)})" for fault in faults.values()]
    return f"{FROZEN_PREFIX}: CUDA is in an error state on {', '.join(parts)}; only a kernel restart clears it"


def status_text(fault: CudaFault) -> str:
    """For ``%gpumem status`` and the panel."""
    return (
        f"cuda:{fault.device} in an error state {fault.where} ({fault.error}); its figures are frozen "
        "and only a kernel restart clears it"
    )
