"""Memory readers: the PyTorch caching allocator, NVML and the host, as typed readings in bytes.

Every reader is safe to call from a background thread and never creates a CUDA context: PyTorch
devices are reported only once the user's own code has initialized CUDA, torch is never imported
here (only looked up in ``sys.modules``), and devices are always named by explicit index.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

# The readings live in gpumem.core.readers.readings, the NVML reader in gpumem.core.readers.nvml and the
# CUDA_VISIBLE_DEVICES parser in gpumem.core.readers.devices; importing them from here keeps working.
from gpumem.core.readers.cuda_fault import cuda_faults, healthy, status_text
from gpumem.core.readers.devices import parse_visible_devices
from gpumem.core.readers.nvml import NvmlSource
from gpumem.core.readers.readings import AllocatorReading, DeviceInfo, DeviceReading, HostReading, Snapshot
from gpumem.core.readers.torch_state import cuda_device_count, torch_state

__all__ = [
    "AllocatorReading",
    "DeviceInfo",
    "DeviceReading",
    "HostReading",
    "HostSource",
    "MemorySource",
    "NvmlSource",
    "Snapshot",
    "SystemSource",
    "TorchAllocatorSource",
    "parse_visible_devices",
]


class MemorySource(Protocol):
    """What the sampler, the cell tracker and the panel read from. Tests substitute a fake."""

    def snapshot(self, *, process_memory: bool = False) -> Snapshot: ...

    def cuda_devices(self) -> tuple[int, ...]:
        """CUDA device indices whose allocator can be read now (empty before CUDA is initialized)."""
        ...

    def device_info(self, device: int) -> DeviceInfo | None: ...

    def reset_peaks(self, devices: Sequence[int]) -> None:
        """Reset the allocator's peak counters (this also resets the user's own peak counters)."""
        ...

    def empty_cache(self) -> None:
        """Return the allocator's cached, unused blocks to the driver on every initialized device."""
        ...

    def status(self) -> dict[str, str]:
        """Per reader, ``"ok"`` or ``"unavailable: <reason>"``."""
        ...


def _loaded_torch() -> Any | None:
    """The user's torch module if they imported it; importing it ourselves would cost seconds."""
    return sys.modules.get("torch")


class TorchAllocatorSource:
    """Reads the caching allocator's counters through the cheapest call the installed torch offers."""

    def __init__(self) -> None:
        self._fast_stats: Callable[[int], dict[str, Any]] | None = None
        self._checked_fast_path = False

    def unavailable_reason(self) -> str | None:
        """Which case torch is in, when it is not ready (see :mod:`gpumem.core.readers.torch_state`)."""
        return torch_state().reason

    def device_count(self) -> int | None:
        """CUDA devices this process can use, known without creating a context (None: torch not imported)."""
        return cuda_device_count()

    def devices(self) -> tuple[int, ...]:
        torch = _loaded_torch()
        if torch is None or not torch.cuda.is_initialized():
            return ()
        return tuple(range(torch.cuda.device_count()))

    def read(self, device: int) -> AllocatorReading:
        """One device's counters; the caller has checked that CUDA is initialized."""
        stats = self._stats(device)
        if "allocated_bytes" in stats and isinstance(stats["allocated_bytes"], dict):
            allocated = stats["allocated_bytes"]["all"]
            reserved = stats["reserved_bytes"]["all"]
            return AllocatorReading(
                device=device,
                allocated_bytes=allocated["current"],
                reserved_bytes=reserved["current"],
                active_bytes=stats["active_bytes"]["all"]["current"],
                inactive_split_bytes=stats["inactive_split_bytes"]["all"]["current"],
                peak_allocated_bytes=allocated["peak"],
                peak_reserved_bytes=reserved["peak"],
                num_ooms=stats.get("num_ooms", 0),
                num_alloc_retries=stats.get("num_alloc_retries", 0),
                live_allocations=stats.get("allocation", {}).get("all", {}).get("current", -1),
            )
        return AllocatorReading(
            device=device,
            allocated_bytes=stats.get("allocated_bytes.all.current", 0),
            reserved_bytes=stats.get("reserved_bytes.all.current", 0),
            active_bytes=stats.get("active_bytes.all.current", 0),
            inactive_split_bytes=stats.get("inactive_split_bytes.all.current", 0),
            peak_allocated_bytes=stats.get("allocated_bytes.all.peak", 0),
            peak_reserved_bytes=stats.get("reserved_bytes.all.peak", 0),
            num_ooms=stats.get("num_ooms", 0),
            num_alloc_retries=stats.get("num_alloc_retries", 0),
            live_allocations=stats.get("allocation.all.current", -1),
        )

    def _stats(self, device: int) -> dict[str, Any]:
        if not self._checked_fast_path:
            torch = _loaded_torch()
            fast = getattr(getattr(torch, "_C", None), "_cuda_memoryStats", None)
            self._fast_stats = fast if callable(fast) else None
            self._checked_fast_path = True
        if self._fast_stats is not None:
            try:
                return self._fast_stats(device)
            except (TypeError, AttributeError):
                self._fast_stats = None
        torch = _loaded_torch()
        assert torch is not None
        stats: dict[str, Any] = torch.cuda.memory_stats(device)
        return stats

    def reset_peaks(self, devices: Sequence[int]) -> None:
        torch = _loaded_torch()
        if torch is None or not torch.cuda.is_initialized():
            return
        for device in healthy(devices):
            torch.cuda.reset_peak_memory_stats(device)

    def empty_cache(self) -> None:
        """The caching allocator empties every device's cache in one call; never after a sticky CUDA error
        (it would fail again: :mod:`gpumem.core.readers.cuda_fault`)."""
        torch = _loaded_torch()
        if torch is None or not torch.cuda.is_initialized():
            return
        faults = cuda_faults()
        if faults:
            raise RuntimeError("; ".join(status_text(fault) for fault in faults.values()))
        torch.cuda.empty_cache()

    def device_properties(self, device: int) -> Any | None:
        """torch's properties for an initialized device (name, total_memory, uuid, pci_bus_id)."""
        torch = _loaded_torch()
        if torch is None or not torch.cuda.is_initialized():
            return None
        return torch.cuda.get_device_properties(device)


class _ProcFile:
    """A small procfs file kept open and read whole from offset 0 with libc's ``pread``, called with the GIL
    held (``ctypes.PyDLL``): reading it never blocks, and a sampler thread that let go of the GIL for each
    system call (open, read, close) would wait for a busy main thread to hand it back (up to the 5 ms
    switch interval) once per call, once more per sample."""

    def __init__(self, path: str, size: int) -> None:
        self._file = io.FileIO(path, "rb")  # closed with this object
        self._size = size
        self._pread: Any = None
        with contextlib.suppress(OSError, AttributeError):
            pread = ctypes.PyDLL(None).pread
            pread.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long)
            pread.restype = ctypes.c_ssize_t
            self._pread = pread

    def read(self) -> bytes:
        fd = self._file.fileno()
        if self._pread is None:
            return os.pread(fd, self._size, 0)
        buffer = ctypes.create_string_buffer(self._size)  # one per read: the sampler and a cell's hook may overlap
        count = self._pread(fd, buffer, self._size, 0)
        if count <= 0:
            raise OSError(f"reading {self._file.name} failed")
        return buffer.raw[:count]


class _Statm(_ProcFile):
    """This process's RSS from ``/proc/self/statm``: the figure psutil reports (resident pages x page
    size), at a sixth of its cost when the caches are cold, as at a cell's start."""

    def __init__(self) -> None:
        super().__init__("/proc/self/statm", 128)  # seven decimal page counts: far less than this
        self._page_bytes = os.sysconf("SC_PAGE_SIZE")

    def rss_bytes(self) -> int:
        return int(self.read().split()[1]) * self._page_bytes


class _Meminfo(_ProcFile):
    """The machine's total and available memory from ``/proc/meminfo``: the figures psutil's
    ``virtual_memory()`` reports on Linux (MemTotal, MemAvailable), without its three system calls."""

    def __init__(self) -> None:
        super().__init__("/proc/meminfo", 4096)  # the two lines read are its first and third

    def total_and_available(self) -> tuple[int, int] | None:
        """Bytes; None where the kernel does not report MemAvailable (before Linux 3.14)."""
        data = self.read()
        total, available = _meminfo_kib(data, b"MemTotal:"), _meminfo_kib(data, b"MemAvailable:")
        if total is None or available is None:
            return None
        return total * 1024, available * 1024


def _meminfo_kib(data: bytes, key: bytes) -> int | None:
    at = data.find(key)
    if at < 0:
        return None
    end = data.find(b"kB", at)
    return int(data[at + len(key) : end]) if end > 0 else None


_Proc = TypeVar("_Proc", bound=_ProcFile)


def _open_proc(kind: Callable[[], _Proc]) -> _Proc | None:
    """``kind()`` on Linux where its file opens; None elsewhere (psutil then does the reading)."""
    try:
        return kind() if sys.platform.startswith("linux") else None
    except (OSError, ValueError):
        return None


class HostSource:
    """This process's RSS and the machine's memory, through psutil (getrusage for the exact peak)."""

    def __init__(self) -> None:
        self._process: Any | None = None
        self._psutil: Any | None = None
        self._statm: _Statm | None = None
        self._meminfo: _Meminfo | None = _open_proc(_Meminfo)
        self._reason: str | None = None
        self._pid = -1
        self._available_cache: tuple[float, int, int] = (-1.0, 0, 0)

    def _ensure(self) -> Any | None:
        pid = os.getpid()
        if self._pid != pid:
            try:
                import psutil
            except ImportError:
                self._reason = "psutil is not installed"
                self._psutil = None
                self._pid = pid
                return None
            self._psutil = psutil
            self._process = psutil.Process(pid)
            self._statm = _open_proc(_Statm)  # after a fork /proc/self is the child: open it again
            self._pid = pid  # last: another thread must not see the new pid before the process exists
        return self._process

    def unavailable_reason(self) -> str | None:
        if self._ensure() is None:
            return self._reason or "host memory is unavailable"
        return None

    def read(self, *, machine_max_age_s: float = 1.0) -> HostReading | None:
        process = self._ensure()
        if process is None:
            return None
        rss = self._rss_bytes(process)
        now = time.monotonic()
        stamp, available, total = self._available_cache
        if now - stamp > machine_max_age_s or stamp < 0:
            total, available = self._machine_memory()
            self._available_cache = (now, available, total)
        return HostReading(
            rss_bytes=rss,
            peak_rss_bytes=max(rss, peak_rss_bytes()),
            available_bytes=available,
            total_bytes=total,
        )

    def _machine_memory(self) -> tuple[int, int]:
        """Total and available bytes of the machine."""
        meminfo = self._meminfo
        if meminfo is not None:
            try:
                figures = meminfo.total_and_available()
            except (OSError, ValueError):
                figures = None
            if figures is not None:
                return figures
            self._meminfo = None  # an unusual /proc: psutil from now on
        assert self._psutil is not None
        memory = self._psutil.virtual_memory()
        return int(memory.total), int(memory.available)

    def _rss_bytes(self, process: Any) -> int:
        statm = self._statm
        if statm is not None:
            try:
                return statm.rss_bytes()
            except (OSError, ValueError, IndexError):
                self._statm = None  # an unusual /proc: psutil from now on
        return int(process.memory_info().rss)


def _fault_reason() -> str | None:
    faults = cuda_faults()
    return "; ".join(status_text(fault) for fault in faults.values()) if faults else None


def peak_rss_bytes() -> int:
    """Lifetime peak RSS of this process; Linux reports KiB, macOS bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class SystemSource:
    """The real machine: torch's allocator, NVML and the host, combined into snapshots."""

    def __init__(
        self,
        torch_source: TorchAllocatorSource | None = None,
        nvml_source: NvmlSource | None = None,
        host_source: HostSource | None = None,
    ) -> None:
        self.torch = torch_source or TorchAllocatorSource()
        self.nvml = nvml_source or NvmlSource()
        self.host = host_source or HostSource()

    def cuda_devices(self) -> tuple[int, ...]:
        return self.torch.devices()

    def device_count(self) -> int | None:
        """CUDA devices this process can use, before CUDA is initialized too: torch's count, else NVML's
        (torch not imported yet); None when neither can tell. Never creates a context."""
        count = self.torch.device_count()
        return self.nvml.device_count() if count is None else count

    def snapshot(self, *, process_memory: bool = False) -> Snapshot:
        torch_devices = healthy(self.torch.devices())  # a device in a CUDA error state is not read again
        if torch_devices:
            self.nvml.refine_with_torch(self.torch)
        allocator = tuple(self.torch.read(device) for device in torch_devices)
        device_readings: list[DeviceReading] = []
        for device in self.nvml.devices():
            reading = self.nvml.read(device, process_memory=process_memory, hold_gil=bool(torch_devices))
            if reading is not None:
                device_readings.append(reading)
        return Snapshot(
            monotonic_s=time.monotonic(),
            wall_time_s=time.time(),
            allocator=allocator,
            devices=tuple(device_readings),
            host=self.host.read(),
        )

    def device_info(self, device: int) -> DeviceInfo | None:
        info = self.nvml.info(device)
        if info is not None:
            return info
        props = self.torch.device_properties(device) if device in self.torch.devices() else None
        if props is None:
            return None
        return DeviceInfo(
            device=device,
            nvml_index=-1,
            name=str(props.name),
            uuid=str(getattr(props, "uuid", "")),
            pci_bus_id="",
            total_bytes=int(props.total_memory),
        )

    def reset_peaks(self, devices: Sequence[int]) -> None:
        self.torch.reset_peaks(devices)

    def empty_cache(self) -> None:
        self.torch.empty_cache()

    def status(self) -> dict[str, str]:
        result: dict[str, str] = {}
        for name, reason in (
            ("torch", self.torch.unavailable_reason() or _fault_reason()),
            ("nvml", self.nvml.unavailable_reason()),
            ("host", self.host.unavailable_reason()),
        ):
            result[name] = "ok" if reason is None else f"unavailable: {reason}"
        return result
