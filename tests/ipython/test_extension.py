"""Loading, unloading and reloading the extension in a real shell, its configuration, and a real kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError

from _harness import JupyterEnv, make_notebook, run_cell_capture, run_notebook
from gpumem.core.monitoring.monitor import Monitor
from gpumem.ipython import extension as _extension
from gpumem.ipython.cell_magic import HeaderTransformer
from gpumem.ipython.hooks import CellHooks
from gpumem.ipython.magics import GpuMemMagics

SRC = str(Path(__file__).resolve().parents[2] / "src")


def hook_counts(shell: Any) -> dict[str, int]:
    return {name: len(callbacks) for name, callbacks in shell.events.callbacks.items()}


def our_hooks(shell: Any) -> list[Any]:
    return [
        callback
        for callbacks in shell.events.callbacks.values()
        for callback in callbacks
        if isinstance(getattr(callback, "__self__", None), CellHooks)
    ]


def sampler_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "gpumem-sampler" and thread.is_alive()]


def test_reload_twenty_times_leaves_one_set_of_hooks(ip: Any, fake_monitor: Monitor) -> None:
    before = hook_counts(ip)
    transformers_before = list(ip.input_transformers_cleanup)
    assert ip.run_cell("%load_ext gpumem").success
    loaded = hook_counts(ip)
    assert len(our_hooks(ip)) == 2
    for _ in range(20):
        assert ip.run_cell("%reload_ext gpumem").success
        assert ip.run_cell("%%gpumem -q\nx = 1").success  # starts the sampler each time
    assert hook_counts(ip) == loaded
    assert len(our_hooks(ip)) == 2 and our_hooks(ip)[0].__self__ is _extension.get_hooks()
    assert sum(isinstance(t, HeaderTransformer) for t in ip.input_transformers_cleanup) == 1
    assert isinstance(ip.magics_manager.magics["line"]["gpumem"].__self__, GpuMemMagics)
    assert sum(type(c).__name__ == "GpuMem" for c in ip.configurables) == 1
    assert len(sampler_threads()) == 1
    state = _extension.get_state()
    assert state is not None and len(state.tracker.history) == 1  # each reload starts a fresh history

    assert ip.run_cell("%unload_ext gpumem").success
    assert hook_counts(ip) == before
    assert our_hooks(ip) == []
    assert ip.input_transformers_cleanup == transformers_before
    assert "gpumem" not in ip.magics_manager.magics["line"]
    assert "gpumem" not in ip.magics_manager.magics["cell"]
    assert "GpuMemMagics" not in ip.magics_manager.registry
    assert not any(isinstance(c, GpuMemMagics) for c in ip.configurables)
    assert not any(type(c).__name__ == "GpuMem" for c in ip.configurables)
    assert sampler_threads() == []
    assert _extension.get_state() is None and _extension.get_hooks() is None
    result, _cap = run_cell_capture(ip, "%gpumem status")
    assert isinstance(result.error_in_exec, UsageError)
    # Without the extension a %%gpumem cell is an ordinary unknown cell magic, not silently stripped.
    result, _cap = run_cell_capture(ip, "%%gpumem\nran = True")
    assert isinstance(result.error_in_exec, UsageError) and "ran" not in ip.user_ns


def test_loading_twice_and_unloading_twice_change_nothing(ip: Any, fake_monitor: Monitor) -> None:
    from gpumem import load_ipython_extension, unload_ipython_extension

    load_ipython_extension(ip)
    state = _extension.get_state()
    load_ipython_extension(ip)
    assert _extension.get_state() is state and len(our_hooks(ip)) == 2
    unload_ipython_extension(ip)
    unload_ipython_extension(ip)
    assert our_hooks(ip) == [] and _extension.get_state() is None


def test_the_loaded_hooks_explain_an_out_of_memory_error_once(ip: Any, fake_monitor: Monitor) -> None:
    pytest.importorskip("torch")
    from gpumem.core.diagnoses import oom

    observers = oom._state.observers
    assert ip.run_cell("%load_ext gpumem").success
    try:
        assert oom._state.observers == observers + 1
        cell = "import torch\nraise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0)')"
        result, cap = run_cell_capture(ip, cell)
        assert type(result.error_in_exec).__name__ == "OutOfMemoryError"
        explained = [o for o in cap.outputs if "gpumem: CUDA out of memory on cuda:0" in o.data["text/plain"]]
        assert len(explained) == 1 and "requested 2.0 GiB" in explained[0].data["text/plain"]
    finally:
        assert ip.run_cell("%unload_ext gpumem").success
    assert oom._state.observers == observers


def test_on_unload_callbacks_run_and_failures_are_one_line(
    ip: Any, fake_monitor: Monitor, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ip.run_cell("%load_ext gpumem").success
    state = _extension.get_state()
    assert state is not None and state.shell is ip and state.monitor is fake_monitor
    calls: list[str] = []

    def failing() -> None:
        calls.append("failing")
        raise RuntimeError("cleanup broke")

    state.on_unload(lambda: calls.append("first"))
    state.on_unload(failing)
    assert ip.run_cell("%unload_ext gpumem").success
    assert calls == ["failing", "first"]
    err = capsys.readouterr().err
    assert "gpumem: an unload callback failed: RuntimeError: cleanup broke" in err
    assert "Traceback" not in err


def test_config_sets_the_defaults(ip: Any, fake_monitor: Monitor) -> None:
    ip.config.GpuMem.auto = True
    ip.config.GpuMem.threshold_bytes = 1024
    ip.config.GpuMem.leak_runs = 4
    try:
        assert ip.run_cell("%load_ext gpumem").success
        state = _extension.get_state()
        assert state is not None
        assert state.auto and state.config.threshold.nbytes == 1024 and state.tracker.leak_runs == 4
        assert fake_monitor.running  # warmed up at load, so the first cell pays nothing for it
        ip.user_ns["src"] = fake_monitor.source
        _result, cap = run_cell_capture(ip, "h = src.allocate(4096)")
        assert len(cap.outputs) == 1 and "+4.0 KiB" in cap.outputs[0].data["text/plain"]
        assert ip.run_cell("%config GpuMem.history_size = 7").success
        assert state.tracker.history_size == 7
        assert ip.run_cell("%config GpuMem.auto = False").success
        assert not state.auto and not fake_monitor.running  # nothing else needed the sampler
    finally:
        ip.run_cell("%unload_ext gpumem")
        del ip.config["GpuMem"]


def test_bad_config_is_reported_and_ignored(ip: Any, fake_monitor: Monitor, capsys: pytest.CaptureFixture[str]) -> None:
    ip.config.GpuMem.leak_runs = 1  # must be at least 2
    ip.config.GpuMem.leak_min_bytes = 4096
    try:
        assert ip.run_cell("%load_ext gpumem").success
        state = _extension.get_state()
        assert state is not None and state.tracker.leak_runs == 3 and state.tracker.leak_min_bytes == 4096
        assert "gpumem: ignoring GpuMem.leak_runs = 1 (the other settings apply)" in capsys.readouterr().err
    finally:
        ip.run_cell("%unload_ext gpumem")
        del ip.config["GpuMem"]


def test_a_failing_measurement_never_breaks_the_cell(ip: Any, fake_monitor: Monitor) -> None:
    assert ip.run_cell("%load_ext gpumem").success
    try:
        state = _extension.get_state()
        assert state is not None
        state.auto = True

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise OSError("reader gone")

        state.monitor.snapshot = broken  # type: ignore[method-assign]
        result, cap = run_cell_capture(ip, "y = 2 * 21\ny")
        assert result.success and result.result == 42
        assert "gpumem: could not start measuring this cell: OSError: reader gone" in cap.stderr
        assert "Traceback" not in cap.stderr
        del state.monitor.snapshot
        assert run_cell_capture(ip, "z = 1")[0].success
        assert [r.first_line for r in state.tracker.history] == ["z = 1"]
    finally:
        ip.run_cell("%unload_ext gpumem")


def test_loading_imports_no_widget_pandas_or_torch() -> None:
    code = (
        "import sys\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "ip = InteractiveShell.instance()\n"
        "before = set(sys.modules)\n"
        "ip.run_line_magic('load_ext', 'gpumem')\n"
        "assert ip.run_cell('%%gpumem -q\\nx = 1').success\n"
        "heavy = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in "
        "('ipywidgets', 'bqplot', 'pandas', 'torch', 'numpy'))\n"
        "print(heavy)\n"
    )
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])),
        "IPYTHONDIR": str(Path(SRC).parent / ".pytest_cache" / "ipython"),
        "PATH": "",
    }
    command = [sys.executable, "-c", code]
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.kernel
def test_in_a_real_kernel(tmp_path: Path, jupyter_env: JupyterEnv) -> None:
    path = make_notebook(
        tmp_path / "cells.ipynb",
        [
            "%load_ext gpumem",
            "%%gpumem\nimport numpy as np\na = np.ones(64 << 20, dtype=np.uint8)\n'done'",
            "%%gpumem\nraise ValueError('inside')",
            "%gpumem auto on --threshold 100MiB",
            "b = np.ones(128 << 20, dtype=np.uint8)",
            "c = 1",
            "import gpumem\nframe = gpumem.history()\nprint(list(frame['status']), list(frame['first_line']))",
        ],
    )
    nb = run_notebook(path, jupyter_env=jupyter_env, timeout=120, allow_errors=True)
    cells = nb.cells

    outputs = cells[1].outputs
    result = next(o for o in outputs if o["output_type"] == "execute_result")
    assert result["data"]["text/plain"] == "'done'" and result["execution_count"] == 2
    (report,) = [o for o in outputs if o["output_type"] == "display_data"]
    assert "gpumem-report" in report["data"]["text/html"] and "host RSS" in report["data"]["text/html"]
    assert "CUDA is not in use: torch is installed but not imported in this process yet" in report["data"]["text/plain"]

    error = next(o for o in cells[2].outputs if o["output_type"] == "error")
    assert error["ename"] == "ValueError"
    assert any(o["output_type"] == "display_data" for o in cells[2].outputs)

    (summary,) = [o for o in cells[4].outputs if o["output_type"] == "display_data"]
    assert summary["data"]["text/plain"].startswith("gpumem [5]") and "host +128" in summary["data"]["text/plain"]
    assert cells[5].outputs == []

    printed = "".join(o.get("text", "") for o in cells[6].outputs if o["output_type"] == "stream")
    assert "['ok', 'error', 'ok', 'ok']" in printed
    lines = ["import numpy as np", "raise ValueError('inside')", "b = np.ones(128 << 20, dtype=np.uint8)", "c = 1"]
    assert repr(lines) in printed


def test_the_front_end_can_ask_for_a_sidebar_panel_only_while_loaded(ip):
    from gpumem.panel import frontend as _frontend

    ip.run_cell("%load_ext gpumem")
    assert _frontend._sidebar_factory is not None
    ip.run_cell("%unload_ext gpumem")
    assert _frontend._sidebar_factory is None


def test_unload_forgets_the_outputs_of_the_panels_it_showed(ip: Any, fake_monitor: Monitor) -> None:
    pytest.importorskip("bqplot")
    from IPython.utils.capture import capture_output

    from gpumem.ipython import panel_magics
    from gpumem.panel.widget import Panel

    assert ip.run_cell("%load_ext gpumem").success
    panel = Panel(fake_monitor)
    with capture_output(display=True):
        panel_magics._show(panel)
    assert [ref() for ref, _handle in panel_magics._shown] == [panel]
    assert ip.run_cell("%unload_ext gpumem").success
    assert panel_magics._shown == []
    assert panel.closed
