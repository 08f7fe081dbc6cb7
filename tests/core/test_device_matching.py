"""NVML devices matched to CUDA indices under CUDA_VISIBLE_DEVICES and by UUID, with a scripted NVML.

The real-GPU checks are in test_core_gpu.py; a machine with one GPU cannot reorder devices, so the
N-device paths are driven here through a stand-in ``pynvml`` module with the library's call shapes.
"""

from __future__ import annotations

import sys
import time
import types
from typing import Any, NamedTuple

import pytest

from gpumem.core.readers.sources import NvmlSource, SystemSource


class _Memory(NamedTuple):
    total: int
    used: int
    free: int


class _Pci(NamedTuple):
    busId: str  # noqa: N815 - pynvml's own field name, which the code under test reads


class _Process(NamedTuple):
    pid: int
    usedGpuMemory: int | None  # noqa: N815 - pynvml's own field name


GIB = 1 << 30


def _fake_nvml(devices: list[dict[str, Any]]) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    module.nvmlInit = lambda: None  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: len(devices)  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda i: devices[i]  # type: ignore[attr-defined]
    module.nvmlDeviceGetUUID = lambda h: h["uuid"]  # type: ignore[attr-defined]
    module.nvmlDeviceGetName = lambda h: h["name"]  # type: ignore[attr-defined]
    module.nvmlDeviceGetPciInfo = lambda h: _Pci(h["bus"])  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = lambda h: _Memory(h["total"], h["used"], h["total"] - h["used"])  # type: ignore[attr-defined]
    module.nvmlDeviceGetMigMode = lambda h: (h.get("mig", 0), 0)  # type: ignore[attr-defined]
    module.nvmlDeviceGetComputeRunningProcesses = lambda h: h.get("processes", [])  # type: ignore[attr-defined]
    module.nvmlDeviceGetGraphicsRunningProcesses = lambda h: h.get("graphics", [])  # type: ignore[attr-defined]
    return module


DEVICES = [
    {"uuid": "GPU-aaaa1111-0000", "name": b"GPU A", "bus": "00000000:1A:00.0", "total": 80 * GIB, "used": 1 * GIB},
    {"uuid": "GPU-bbbb2222-0000", "name": b"GPU B", "bus": "00000000:3B:00.0", "total": 40 * GIB, "used": 7 * GIB},
]


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = _fake_nvml([dict(d) for d in DEVICES])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def _mapping(source: NvmlSource) -> dict[int, str]:
    return {device: source.info(device).name for device in source.devices()}  # type: ignore[union-attr]


def test_all_devices_in_nvml_order_without_the_variable(nvml, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    source = NvmlSource()
    assert _mapping(source) == {0: "GPU A", 1: "GPU B"}
    reading = source.read(1)
    assert reading is not None and reading.used_bytes == 7 * GIB and reading.total_bytes == 40 * GIB


def test_reordered_indices(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    source = NvmlSource()
    assert _mapping(source) == {0: "GPU B", 1: "GPU A"}
    assert source.info(0).nvml_index == 1  # type: ignore[union-attr]
    assert source.read(0).total_bytes == 40 * GIB  # type: ignore[union-attr]


def test_uuid_prefixes_and_a_hidden_device(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")
    source = NvmlSource()
    assert _mapping(source) == {0: "GPU B"}
    assert source.unavailable_reason() is None


def test_cuda_stops_at_the_first_invalid_entry(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,7,0")
    assert _mapping(NvmlSource()) == {0: "GPU B"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-nope,0")
    source = NvmlSource()
    assert _mapping(source) == {}
    assert source.unavailable_reason() == "no NVIDIA GPU is visible to this process"


def test_a_look_alike_digit_ends_the_list_instead_of_breaking_nvml(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,²,0")
    source = NvmlSource()
    assert _mapping(source) == {0: "GPU B"}
    assert source.unavailable_reason() is None


def test_mig_is_said_unsupported(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1234")
    source = NvmlSource()
    assert source.devices() == ()
    assert "MIG" in (source.unavailable_reason() or "")


def test_torch_uuids_override_the_environment_order(nvml, monkeypatch):
    """With CUDA_DEVICE_ORDER=FASTEST_FIRST the CUDA order can differ from NVML's: torch's UUIDs decide."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    class Props(NamedTuple):
        name: str
        uuid: str
        total_memory: int

    class TorchStandIn:
        def devices(self) -> tuple[int, ...]:
            return (0, 1)

        def device_properties(self, device: int) -> Props:
            # CUDA's device 0 is NVML's device 1 and vice versa.
            return [Props("GPU B", "bbbb2222-0000", 40 * GIB), Props("GPU A", "aaaa1111-0000", 80 * GIB)][device]

    source = NvmlSource()
    assert _mapping(source) == {0: "GPU A", 1: "GPU B"}
    source.refine_with_torch(TorchStandIn())  # type: ignore[arg-type]
    assert _mapping(source) == {0: "GPU B", 1: "GPU A"}


def test_this_process_share_is_found_by_pid(nvml, monkeypatch):
    import os

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml.nvmlDeviceGetHandleByIndex(0)["processes"] = [_Process(os.getpid(), 3 * GIB), _Process(1, 5 * GIB)]
    source = NvmlSource()
    assert source.read(0, process_memory=True).process_used_bytes == 3 * GIB  # type: ignore[union-attr]
    assert source.read(1, process_memory=True).process_used_bytes == 0  # type: ignore[union-attr]
    assert source.process_on_device(0) is True and source.process_on_device(1) is False


def test_the_other_processes_are_what_nvml_lists_for_them(nvml, monkeypatch):
    import os

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    handle["processes"] = [_Process(os.getpid(), 3 * GIB), _Process(1, 5 * GIB)]
    handle["graphics"] = [_Process(1, 5 * GIB), _Process(2, GIB)]  # pid 1 has both contexts: counted once
    source = NvmlSource()
    reading = source.read(0, process_memory=True)
    assert reading is not None and (reading.process_used_bytes, reading.others_used_bytes) == (3 * GIB, 6 * GIB)
    assert source.read(0).others_used_bytes is None  # type: ignore[union-attr]  # a sample never lists them
    assert source.read(1, process_memory=True).others_used_bytes == 0  # type: ignore[union-attr]

    handle["graphics"] = [_Process(2, None)]  # NVML has no figure for it (pynvml's None): the sum is unknown
    assert source.read(0, process_memory=True).others_used_bytes is None  # type: ignore[union-attr]

    def unlisted(_handle: object) -> list[_Process]:
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    nvml.nvmlDeviceGetGraphicsRunningProcesses = unlisted  # one list unknown: so is the sum, not this process's
    reading = source.read(0, process_memory=True)
    assert reading is not None and (reading.process_used_bytes, reading.others_used_bytes) == (3 * GIB, None)


class _MemoryV2(NamedTuple):
    total: int
    reserved: int
    free: int
    used: int


def test_the_drivers_reservation_is_read_beside_this_process_share(nvml, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert NvmlSource().read(0, process_memory=True).driver_reserved_bytes is None  # type: ignore[union-attr]

    v1 = nvml.nvmlDeviceGetMemoryInfo
    asked: list[object] = []

    def memory_info(handle: dict[str, Any], version: object = None) -> Any:
        asked.append(version)
        if version is None:
            return v1(handle)
        if handle["name"] == b"GPU B":
            raise RuntimeError("NVML_ERROR_FUNCTION_NOT_FOUND")  # a driver without the v2 figure
        reserved = 624 << 20
        return _MemoryV2(handle["total"], reserved, handle["total"] - handle["used"], handle["used"] - reserved)

    nvml.nvmlMemory_v2 = 0x2000028
    nvml.nvmlDeviceGetMemoryInfo = memory_info
    source = NvmlSource()
    assert source.read(0).driver_reserved_bytes is None  # type: ignore[union-attr]
    assert asked and set(asked) == {None}  # a sample never asks for it: only a read of the per-process split does
    reading = source.read(0, process_memory=True)
    assert reading is not None and reading.driver_reserved_bytes == 624 << 20 and reading.used_bytes == 1 * GIB
    assert source.read(1, process_memory=True).driver_reserved_bytes is None  # type: ignore[union-attr]


def test_system_snapshot_reports_every_visible_device(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    snapshot = SystemSource().snapshot()
    assert [(d.device, d.total_bytes) for d in snapshot.devices] == [(0, 40 * GIB), (1, 80 * GIB)]
    assert snapshot.allocator == ()


def test_a_slow_gil_held_read_turns_the_held_reads_off(nvml: types.ModuleType) -> None:
    import ctypes

    from gpumem.core.readers import nvml as nvml_module

    class Memory(ctypes.Structure):
        _fields_ = (("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong))

    calls: list[str] = []

    def slow_call(handle: Any, reference: Any) -> int:
        calls.append(handle["name"].decode())
        reference._obj.total, reference._obj.used, reference._obj.free = 80 * GIB, 3 * GIB, 77 * GIB
        time.sleep(nvml_module.HELD_CALL_LIMIT_S * 3)
        return 0

    source = NvmlSource()
    source.devices()
    source._held = nvml_module._HeldGilMemoryInfo(slow_call, Memory)
    assert source.reads_holding_gil
    first = source.read(0, hold_gil=True)
    assert first is not None and first.used_bytes == 3 * GIB  # the slow read's figures are still right
    assert not source.reads_holding_gil
    second = source.read(0, hold_gil=True)
    assert second is not None and second.used_bytes == 1 * GIB  # pynvml's own call from now on
    assert calls == ["GPU A"]


def test_a_failed_gil_held_read_falls_back_to_pynvml(nvml: types.ModuleType) -> None:
    import ctypes

    from gpumem.core.readers import nvml as nvml_module

    class Memory(ctypes.Structure):
        _fields_ = (("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong))

    source = NvmlSource()
    source.devices()
    source._held = nvml_module._HeldGilMemoryInfo(lambda handle, reference: 999, Memory)
    reading = source.read(0, hold_gil=True)
    assert reading is not None and reading.used_bytes == 1 * GIB
    assert source.reads_holding_gil  # a failing call is not a slow one
    not_held = source.read(1, hold_gil=False)
    assert not_held is not None and not_held.used_bytes == 7 * GIB
