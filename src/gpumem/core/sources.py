"""Memory readers: the PyTorch caching allocator, NVML and the host, as typed readings in bytes.

Every reader is safe to call from a background thread and never creates a CUDA context: PyTorch
devices are reported only once the user's own code has initialized CUDA, torch is never imported
here (only looked up in ``sys.modules``), and devices are always named by explicit index.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

# The readings live in gpumem.core.readings and the CUDA_VISIBLE_DEVICES parser in gpumem.core.devices;
# importing them from here keeps working.
from gpumem.core.devices import parse_visible_devices
from gpumem.core.readings import AllocatorReading, DeviceInfo, DeviceReading, HostReading, Snapshot

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
        torch = _loaded_torch()
        if torch is None:
            return "torch is not imported in this process"
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not hasattr(cuda, "is_initialized"):
            return "this torch build has no CUDA support"
        if not cuda.is_initialized():
            if not _torch_built_with_cuda(torch):
                return "this torch build has no CUDA support"
            return "CUDA is not initialized in this process yet (no tensor has been put on a GPU)"
        return None

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
        for device in devices:
            torch.cuda.reset_peak_memory_stats(device)

    def empty_cache(self) -> None:
        """The caching allocator empties every device's cache in one call."""
        torch = _loaded_torch()
        if torch is None or not torch.cuda.is_initialized():
            return
        torch.cuda.empty_cache()

    def device_properties(self, device: int) -> Any | None:
        """torch's properties for an initialized device (name, total_memory, uuid, pci_bus_id)."""
        torch = _loaded_torch()
        if torch is None or not torch.cuda.is_initialized():
            return None
        return torch.cuda.get_device_properties(device)


def _torch_built_with_cuda(torch: Any) -> bool:
    version = getattr(getattr(torch, "version", None), "cuda", None)
    return bool(version)


class NvmlSource:
    """Whole-device memory through NVML, mapped to CUDA indices by UUID / PCI bus id, never by position."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: Any | None = None
        self._reason: str | None = None
        self._handles: dict[int, Any] = {}
        self._infos: dict[int, DeviceInfo] = {}
        self._mapped_by_torch = False
        self._pid = os.getpid()
        self._init_attempted = False

    def _ensure(self) -> Any | None:
        if self._pid != os.getpid():
            self._reset_after_fork()
        if self._init_attempted:
            return self._nvml
        with self._lock:
            if self._init_attempted:
                return self._nvml
            self._init_attempted = True
            try:
                import pynvml
            except ImportError:
                self._reason = "nvidia-ml-py (pynvml) is not installed"
                return None
            try:
                pynvml.nvmlInit()
            except Exception as error:
                self._reason = f"NVML could not start ({_nvml_error_text(error)}); no NVIDIA driver here?"
                return None
            self._nvml = pynvml
            try:
                self._map_devices_from_environment()
            except Exception as error:
                self._reason = f"NVML device listing failed ({_nvml_error_text(error)})"
                self._nvml = None
                return None
            return self._nvml

    def _reset_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._nvml = None
        self._reason = None
        self._handles = {}
        self._infos = {}
        self._mapped_by_torch = False
        self._pid = os.getpid()
        self._init_attempted = False

    def _map_devices_from_environment(self) -> None:
        """Map CUDA indices to NVML devices from CUDA_VISIBLE_DEVICES before torch can tell us."""
        nvml = self._nvml
        assert nvml is not None
        count = nvml.nvmlDeviceGetCount()
        all_handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        uuids = [_decode(nvml.nvmlDeviceGetUUID(h)) for h in all_handles]
        visible = parse_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
        order: list[int] = []
        if visible is None:
            order = list(range(count))
        else:
            for entry in visible:
                if entry.startswith("MIG-"):
                    self._reason = "MIG devices are not supported"
                    order = []
                    break
                if entry.isdigit():
                    position = int(entry)
                    if position >= count:
                        break
                    order.append(position)
                else:
                    matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(entry)]
                    if len(matches) != 1:
                        break
                    order.append(matches[0])
        self._handles = {}
        self._infos = {}
        for cuda_index, nvml_index in enumerate(order):
            self._remember(cuda_index, nvml_index, all_handles[nvml_index])

    def _remember(self, cuda_index: int, nvml_index: int, handle: Any) -> None:
        nvml = self._nvml
        assert nvml is not None
        if _mig_enabled(nvml, handle):
            self._reason = "MIG mode is enabled on this GPU; MIG devices are not supported"
            return
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        self._handles[cuda_index] = handle
        self._infos[cuda_index] = DeviceInfo(
            device=cuda_index,
            nvml_index=nvml_index,
            name=_decode(nvml.nvmlDeviceGetName(handle)),
            uuid=_decode(nvml.nvmlDeviceGetUUID(handle)),
            pci_bus_id=_decode(nvml.nvmlDeviceGetPciInfo(handle).busId),
            total_bytes=int(info.total),
        )

    def refine_with_torch(self, torch_source: TorchAllocatorSource) -> None:
        """Once CUDA is up, match by the UUID / PCI bus id torch reports (CUDA_DEVICE_ORDER may differ)."""
        if self._mapped_by_torch or self._ensure() is None:
            return
        nvml = self._nvml
        assert nvml is not None
        devices = torch_source.devices()
        if not devices:
            return
        with self._lock:
            count = nvml.nvmlDeviceGetCount()
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            by_uuid = {_decode(nvml.nvmlDeviceGetUUID(h)).removeprefix("GPU-"): i for i, h in enumerate(handles)}
            by_bus = {_normal_bus_id(_decode(nvml.nvmlDeviceGetPciInfo(h).busId)): i for i, h in enumerate(handles)}
            mapping: dict[int, int] = {}
            for device in devices:
                props = torch_source.device_properties(device)
                if props is None:
                    return
                uuid = str(getattr(props, "uuid", "") or "").removeprefix("GPU-")
                if uuid in by_uuid:
                    mapping[device] = by_uuid[uuid]
                    continue
                bus = _torch_bus_id(props)
                if bus is not None and bus in by_bus:
                    mapping[device] = by_bus[bus]
            if not mapping:
                return
            self._handles = {}
            self._infos = {}
            for device, nvml_index in mapping.items():
                self._remember(device, nvml_index, handles[nvml_index])
            self._mapped_by_torch = True

    def unavailable_reason(self) -> str | None:
        if self._ensure() is None:
            return self._reason or "NVML is unavailable"
        if not self._handles:
            return self._reason or "no NVIDIA GPU is visible to this process"
        return None

    def devices(self) -> tuple[int, ...]:
        if self._ensure() is None:
            return ()
        return tuple(sorted(self._handles))

    def info(self, device: int) -> DeviceInfo | None:
        if self._ensure() is None:
            return None
        return self._infos.get(device)

    def read(self, device: int, *, process_memory: bool = False) -> DeviceReading | None:
        nvml = self._ensure()
        handle = self._handles.get(device)
        if nvml is None or handle is None:
            return None
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        own: int | None = None
        if process_memory:
            own = self._process_used(handle)
        return DeviceReading(
            device=device,
            total_bytes=int(info.total),
            used_bytes=int(info.used),
            free_bytes=int(info.free),
            process_used_bytes=own,
        )

    def _process_used(self, handle: Any) -> int | None:
        nvml = self._nvml
        assert nvml is not None
        pid = os.getpid()
        try:
            processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:
            return None
        for process in processes:
            if process.pid == pid:
                used = process.usedGpuMemory
                return int(used) if used is not None else None
        return 0

    def process_on_device(self, device: int) -> bool | None:
        """Whether this process holds a context on the device (None when NVML cannot tell)."""
        if self._ensure() is None:  # first: in a forked child it drops the parent's handles
            return None
        handle = self._handles.get(device)
        if handle is None:
            return None
        nvml = self._nvml
        assert nvml is not None
        try:
            processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:
            return None
        return any(process.pid == os.getpid() for process in processes)


def _mig_enabled(nvml: Any, handle: Any) -> bool:
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except Exception:
        return False
    return bool(current)


def _nvml_error_text(error: BaseException) -> str:
    text = str(error).strip()
    return text or type(error).__name__


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


_BUS_ID_FIELDS = 3  # domain:bus:device


def _normal_bus_id(bus_id: str) -> str:
    """NVML says ``00000000:1A:00.0``; compare on domain:bus:device in lower case."""
    text = bus_id.lower().split(".")[0]
    parts = text.split(":")
    if len(parts) == _BUS_ID_FIELDS:
        domain, bus, dev = parts
        return f"{int(domain, 16):x}:{int(bus, 16):x}:{int(dev, 16):x}"
    return text


def _torch_bus_id(props: Any) -> str | None:
    bus = getattr(props, "pci_bus_id", None)
    dev = getattr(props, "pci_device_id", None)
    domain = getattr(props, "pci_domain_id", None)
    if bus is None or dev is None or domain is None:
        return None
    return f"{int(domain):x}:{int(bus):x}:{int(dev):x}"


class HostSource:
    """This process's RSS and the machine's memory, through psutil (getrusage for the exact peak)."""

    def __init__(self) -> None:
        self._process: Any | None = None
        self._psutil: Any | None = None
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
        rss = int(process.memory_info().rss)
        now = time.monotonic()
        stamp, available, total = self._available_cache
        if now - stamp > machine_max_age_s or stamp < 0:
            assert self._psutil is not None
            memory = self._psutil.virtual_memory()
            available, total = int(memory.available), int(memory.total)
            self._available_cache = (now, available, total)
        return HostReading(
            rss_bytes=rss,
            peak_rss_bytes=max(rss, peak_rss_bytes()),
            available_bytes=available,
            total_bytes=total,
        )


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

    def snapshot(self, *, process_memory: bool = False) -> Snapshot:
        torch_devices = self.torch.devices()
        if torch_devices:
            self.nvml.refine_with_torch(self.torch)
        allocator = tuple(self.torch.read(device) for device in torch_devices)
        device_readings: list[DeviceReading] = []
        for device in self.nvml.devices():
            reading = self.nvml.read(device, process_memory=process_memory)
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
            ("torch", self.torch.unavailable_reason()),
            ("nvml", self.nvml.unavailable_reason()),
            ("host", self.host.unavailable_reason()),
        ):
            result[name] = "ok" if reason is None else f"unavailable: {reason}"
        return result
