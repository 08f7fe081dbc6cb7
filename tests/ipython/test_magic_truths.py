"""The magics say what is true on this machine: a device that does not exist is refused as such, torch's
case is named, the sampler's read cost is its typical one. Real IPython shell, real sources (CPU torch)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
from IPython.core.error import UsageError

from _harness import gpumem_loaded, run_cell_capture
from gpumem.core.monitoring.monitor import Monitor, set_default_monitor
from gpumem.core.readers.sources import SystemSource
from gpumem.testing import FakeSource


@pytest.fixture
def real(ip: Any) -> Iterator[Any]:
    with gpumem_loaded(ip, SystemSource()) as loaded:
        yield loaded


def _refusal(shell: Any, cell: str) -> str:
    result, cap = run_cell_capture(shell, cell)
    assert isinstance(result.error_in_exec, UsageError), (cell, result.error_in_exec)
    shown = (cap.stderr + cap.stdout).strip()
    assert "Traceback" not in shown and len(shown.splitlines()) == 1, shown
    return shown


def test_a_device_that_does_not_exist_is_refused_as_such_on_a_cpu_build(real: Any) -> None:
    torch = pytest.importorskip("torch")
    if torch.version.cuda is not None:
        pytest.skip("this machine's torch is built with CUDA: see tests/core/test_truths_gpu.py")
    why = f"this torch ({torch.__version__}) is a CPU-only build, without CUDA"
    assert f"--device cuda:99: no CUDA device here ({why}" in _refusal(real, "%%gpumem -d 99\nx = 1")
    assert "x" not in real.user_ns  # refused before the cell ran
    assert f"--device cuda:7: no CUDA device here ({why}" in _refusal(real, "%gpumem who --device cuda:7")
    assert not torch.cuda.is_initialized()


def test_without_torch_installed_the_reason_is_that(real: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real_find_spec(name, *a)
    )
    shown = _refusal(real, "%%gpumem -d 1\nx = 1")
    assert "--device cuda:1: no CUDA device here (torch is not installed in this Python environment" in shown
    _result, cap = run_cell_capture(real, "%gpumem status")
    assert "torch    unavailable: torch is not installed in this Python environment" in cap.stdout


def test_status_names_torchs_case(real: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # installed here, not imported
    _result, cap = run_cell_capture(real, "%gpumem status")
    assert "torch    unavailable: torch is installed but not imported in this process yet" in cap.stdout


def test_status_shows_the_typical_and_the_slowest_read(real: Any) -> None:
    state_monitor = Monitor(FakeSource())
    set_default_monitor(state_monitor)
    real.run_cell("%unload_ext gpumem")
    assert real.run_cell("%load_ext gpumem").success
    for _ in range(5):
        state_monitor.sampler.sample_once()
    _result, cap = run_cell_capture(real, "%gpumem status")
    (line,) = [line for line in cap.stdout.splitlines() if line.startswith("  sampler")]
    assert "5 samples taken; a read typically takes " in line and "(median of all), the slowest " in line
    assert "on average" not in line


def test_a_fake_source_with_two_devices_refuses_the_third_before_cuda_starts(ip: Any) -> None:
    set_default_monitor(Monitor(FakeSource(devices=2, cuda_initialized=False)))
    assert ip.run_cell("%load_ext gpumem").success
    try:
        shown = _refusal(ip, "%%gpumem -d 2\nx = 1")
        assert "--device cuda:2: no such device; this process sees 2 CUDA devices (cuda:0, cuda:1)" in shown
        assert run_cell_capture(ip, "%%gpumem -d 1\nx = 1")[0].success
    finally:
        ip.run_cell("%unload_ext gpumem")
        set_default_monitor(None)
