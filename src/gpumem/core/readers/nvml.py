"""Whole-device memory through NVML (all processes, CUDA contexts included), matched to CUDA indices.

NVML and CUDA number devices differently under ``CUDA_VISIBLE_DEVICES`` (indices, UUIDs, MIG), so devices
are matched by UUID or PCI bus id, never by position.

pynvml's calls release the GIL (ctypes), and a background thread that lets go of the GIL must then wait
for a busy main thread to hand it back: up to the 5 ms switch interval, two more wake-ups and a forced
switch of the main thread, per call. Once this process has initialized CUDA (so the driver keeps the GPU
initialized and the call is a quick ioctl, ~6 us), the memory figure is read with the GIL held instead
(:class:`_HeldGilMemoryInfo`); a call that ever takes longer than :data:`HELD_CALL_LIMIT_S` turns that off
for good, so a slow driver can stall the notebook at most once, briefly.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any, Protocol

from gpumem.core.readers.devices import parse_visible_devices
from gpumem.core.readers.readings import DeviceInfo, DeviceReading

__all__ = ["HELD_CALL_LIMIT_S", "DevicePropertiesReader", "NvmlSource"]

HELD_CALL_LIMIT_S = 0.001  # a GIL-held NVML call slower than this stops reading with the GIL held


class DevicePropertiesReader(Protocol):
    """What the NVML reader needs of the torch reader: CUDA's device properties, once CUDA is initialized."""

    def devices(self) -> tuple[int, ...]: ...

    def device_properties(self, device: int) -> Any | None: ...


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
        self._no_driver = False  # NVML (which ships with the driver) could not start
        self._held: _HeldGilMemoryInfo | None = None

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
                self._no_driver = True
                return None
            self._nvml = pynvml
            self._held = _HeldGilMemoryInfo.bind(pynvml)
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
        self._no_driver = False
        self._held = None

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

    def refine_with_torch(self, torch_source: DevicePropertiesReader) -> None:
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

    def device_count(self) -> int | None:
        """CUDA devices NVML sees for this process; 0 when NVML, which ships with the NVIDIA driver, cannot
        start; None when pynvml is not installed or the listing failed (then NVML cannot tell)."""
        if self._ensure() is None:
            return 0 if self._no_driver else None
        return len(self._handles)

    def info(self, device: int) -> DeviceInfo | None:
        if self._ensure() is None:
            return None
        return self._infos.get(device)

    def read(self, device: int, *, process_memory: bool = False, hold_gil: bool = False) -> DeviceReading | None:
        """One device's memory. ``hold_gil``: the caller knows this process has initialized CUDA."""
        nvml = self._ensure()
        handle = self._handles.get(device)
        if nvml is None or handle is None:
            return None
        held = self._held if hold_gil else None
        info = held.read(handle) if held is not None else None
        if held is not None and held.too_slow:
            self._held = None
        if info is None:
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
        own: int | None = None
        others: int | None = None
        driver: int | None = None
        if process_memory:
            own, others = self._processes_used(handle)
            driver = self._driver_reserved(handle)
        return DeviceReading(
            device=device,
            total_bytes=int(info.total),
            used_bytes=int(info.used),
            free_bytes=int(info.free),
            process_used_bytes=own,
            driver_reserved_bytes=driver,
            others_used_bytes=others,
        )

    @property
    def reads_holding_gil(self) -> bool:
        """Whether memory figures are read with the GIL held (once CUDA is initialized here)."""
        self._ensure()
        return self._held is not None

    def _processes_used(self, handle: Any) -> tuple[int | None, int | None]:
        """This process's figure (0 when NVML does not list it) and the other listed processes' together
        (None where NVML has no figure for one of them), from NVML's compute and graphics lists."""
        nvml = self._nvml
        assert nvml is not None
        pid = os.getpid()
        try:
            compute = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:
            return None, None
        processes = {process.pid: process.usedGpuMemory for process in compute}
        try:  # a process with a graphics context too is listed in both: counted once
            graphics = nvml.nvmlDeviceGetGraphicsRunningProcesses(handle)
        except Exception:
            graphics = None
        for process in graphics or ():
            processes.setdefault(process.pid, process.usedGpuMemory)
        own = processes.pop(pid, 0)
        others = list(processes.values())
        return (
            int(own) if own is not None else None,
            None if graphics is None or None in others else sum(int(used) for used in others),
        )

    def _driver_reserved(self, handle: Any) -> int | None:
        """The driver's own reservation: NVML's v1 "used" counts it, its v2 figure names it apart."""
        nvml = self._nvml
        assert nvml is not None
        version = getattr(nvml, "nvmlMemory_v2", None)
        if version is None:  # a binding older than the v2 figure
            return None
        try:
            return int(nvml.nvmlDeviceGetMemoryInfo(handle, version=version).reserved)
        except Exception:  # a driver or binding without the v2 figure
            return None

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


class _HeldGilMemoryInfo:
    """``nvmlDeviceGetMemoryInfo`` through the library pynvml loaded, called with the GIL held (PyDLL)."""

    def __init__(self, function: Any, structure: type[ctypes.Structure]) -> None:
        self._function = function
        self._structure = structure
        self.too_slow = False

    @classmethod
    def bind(cls, nvml: Any) -> _HeldGilMemoryInfo | None:
        library = getattr(nvml, "nvmlLib", None)
        structure = getattr(nvml, "c_nvmlMemory_t", None)
        if library is None or structure is None:
            return None
        try:
            held = ctypes.PyDLL(library._name, handle=library._handle)  # noqa: SLF001 - ctypes' own attributes
            function = held.nvmlDeviceGetMemoryInfo
        except (AttributeError, OSError, TypeError):
            return None
        function.restype = ctypes.c_int
        return cls(function, structure)

    def read(self, handle: Any) -> Any | None:
        """The figures, or None (then pynvml's own call reads them, and raises what it raises)."""
        memory = self._structure()  # one per call: another thread may read between this call and its use
        began = time.perf_counter()
        code = self._function(handle, ctypes.byref(memory))
        if time.perf_counter() - began > HELD_CALL_LIMIT_S:
            self.too_slow = True
        return memory if code == 0 else None


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
