"""Tests of the harness itself: the in-process shell fixture and the CUDA probe."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from _harness import cuda_status, run_cell_capture


def test_ip_runs_cells_and_get_ipython_works(ip: Any) -> None:
    from IPython import get_ipython

    assert get_ipython() is ip
    result = ip.run_cell("a = 6 * 7\nshell = get_ipython()")
    assert result.success
    assert ip.user_ns["a"] == 42
    assert ip.user_ns["shell"] is ip


def test_ip_namespace_is_reset_between_tests(ip: Any) -> None:
    assert "a" not in ip.user_ns
    assert "shell" not in ip.user_ns
    assert ip.execution_count == 1
    ip.run_cell("7 * 6", store_history=True)
    assert ip.user_ns["Out"] == {1: 42}
    assert ip.user_ns["_1"] == 42


def test_ip_outputs_and_errors_are_capturable(ip: Any) -> None:
    result, cap = run_cell_capture(
        ip, "print('hello')\nfrom IPython.display import HTML, display\ndisplay(HTML('<b>x</b>'))\n41 + 1"
    )
    assert result.success and result.result == 42
    assert "hello" in cap.stdout
    assert any("<b>x</b>" in o.data.get("text/html", "") for o in cap.outputs)
    result, cap = run_cell_capture(ip, "1 / 0")
    assert not result.success
    assert isinstance(result.error_in_exec, ZeroDivisionError)


def test_ip_exception_state_is_cleared(ip: Any) -> None:
    assert getattr(sys, "last_value", None) is None
    assert ip.last_execution_result is None


def _load_fake_extension(ip: Any, calls: list[str]) -> None:
    mod = types.ModuleType("gpumem_harness_fake_ext")

    def load(shell: Any) -> None:
        calls.append("load")
        shell.events.register("post_run_cell", _noop)

    def unload(shell: Any) -> None:
        calls.append("unload")  # "forgets" to unregister: the fixture must restore the callbacks

    mod.load_ipython_extension = load  # type: ignore[attr-defined]
    mod.unload_ipython_extension = unload  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod


def _noop(*args: object) -> None:
    pass


_calls: list[str] = []


def test_ip_extension_loaded_here(ip: Any) -> None:
    _load_fake_extension(ip, _calls)
    ip.run_line_magic("load_ext", "gpumem_harness_fake_ext")
    assert _calls == ["load"]
    assert _noop in ip.events.callbacks["post_run_cell"]


def test_ip_extension_unloaded_after_test(ip: Any) -> None:
    if not _calls:
        pytest.skip("runs after test_ip_extension_loaded_here")
    assert _calls == ["load", "unload"]
    assert "gpumem_harness_fake_ext" not in ip.extension_manager.loaded
    assert _noop not in ip.events.callbacks["post_run_cell"]
    sys.modules.pop("gpumem_harness_fake_ext", None)


def test_cuda_probe_runs_out_of_process() -> None:
    before = "torch" in sys.modules
    status = cuda_status()
    assert set(status) >= {"torch", "available", "count", "reason"}
    if status["torch"] is None:
        pytest.skip(status["reason"])
    # The probe imports torch in a child interpreter, never in this one.
    assert ("torch" in sys.modules) == before


@pytest.mark.gpu
def test_cuda_is_usable() -> None:
    import torch

    x = torch.ones(1024, device="cuda")
    assert torch.cuda.memory_allocated() >= x.numel() * 4


def test_no_event_loop_left_running_by_earlier_tests(ip: Any) -> None:
    # Browser tests (which run before this module) must not leave Playwright's loop marked running.
    import asyncio

    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()
    result, _cap = run_cell_capture(ip, "import asyncio\nawait asyncio.sleep(0)\n'awaited'")
    assert result.success and result.result == "awaited"
