"""Which case torch is in: each case named as such, by the one helper every message uses."""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import pytest

from gpumem.core.readers import torch_state as state_module
from gpumem.core.readers.sources import SystemSource, TorchAllocatorSource
from gpumem.core.readers.torch_state import TorchCase, cuda_device_count, torch_state


def _fake_torch(*, cuda_version: str | None, count: int, initialized: bool = False) -> Any:
    calls: list[int] = []

    def device_count() -> int:
        calls.append(1)
        return count

    cuda = types.SimpleNamespace(is_initialized=lambda: initialized, device_count=device_count)
    torch = types.SimpleNamespace(cuda=cuda, version=types.SimpleNamespace(cuda=cuda_version), __version__="9.9")
    torch.calls = calls
    return torch


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_module, "_cache", state_module._CountCache())


def test_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    state = torch_state()
    assert state.case is TorchCase.NOT_INSTALLED and state.device_count == 0
    assert state.reason == "torch is not installed in this Python environment"
    assert TorchAllocatorSource().unavailable_reason() == state.reason


def test_installed_but_not_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    state = torch_state()
    assert state.case is TorchCase.NOT_IMPORTED and state.device_count is None
    assert state.reason is not None and state.reason.startswith("torch is installed but not imported")


def test_a_cpu_only_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(cuda_version=None, count=0))
    state = torch_state()
    assert state.case is TorchCase.CPU_BUILD and state.device_count == 0
    assert state.reason == "this torch (9.9) is a CPU-only build, without CUDA"


def test_the_real_cpu_build_here() -> None:
    torch = pytest.importorskip("torch")
    if torch.version.cuda is not None:
        pytest.skip("this machine's torch is built with CUDA")
    assert torch_state().case is TorchCase.CPU_BUILD
    reason = TorchAllocatorSource().unavailable_reason() or ""
    assert f"this torch ({torch.__version__}) is a CPU-only build" in reason


def test_a_cuda_build_without_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(cuda_version="12.8", count=0))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    state = torch_state()
    assert state.case is TorchCase.NO_DEVICE and state.device_count == 0
    assert state.reason == "this torch is built with CUDA 12.8 but sees no device (CUDA_VISIBLE_DEVICES='')"


def test_cuda_not_initialized_yet_counts_devices_once(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = _fake_torch(cuda_version="12.8", count=2)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for _ in range(5):  # the panel asks a few times a second: NVML is asked once
        state = torch_state()
    assert state.case is TorchCase.NOT_INITIALIZED and state.device_count == 2
    assert state.reason == "CUDA is not initialized in this process yet (no tensor has been put on a GPU)"
    assert len(torch.calls) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # a new value may change the count: asked again
    assert cuda_device_count() == 2 and len(torch.calls) == 2


def test_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(cuda_version="12.8", count=3, initialized=True))
    state = torch_state()
    assert state == (TorchCase.READY, None, 3)
    assert SystemSource().device_count() == 3
