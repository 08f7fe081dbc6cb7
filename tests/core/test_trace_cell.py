"""``%%gpumem --trace`` in the real IPython shell, with real torch (the CPU build here): the one line
saying why a cell cannot be traced, the cell still run and still measured; the options refused alone."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from _harness import gpumem_loaded, run_cell_capture
from gpumem.ipython.cell_recorders import cell_numbers
from gpumem.testing import FakeSource

NO_CUDA = (
    "gpumem: --trace: no CUDA device is available to PyTorch (torch.cuda.is_available() is False); "
    "the cell runs without a trace."
)


@pytest.fixture
def shell(ip: Any) -> Iterator[Any]:
    with gpumem_loaded(ip, FakeSource(devices=1)) as loaded:
        yield loaded


def test_without_cuda_one_line_and_the_cell_runs(shell: Any) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this test is about a machine without CUDA")
    shell.user_ns["torch"] = torch
    result, cap = run_cell_capture(shell, "%%gpumem --trace\nx = torch.ones(3).sum().item()\nx")
    assert result.success
    assert result.result == 3.0
    assert cap.stdout.splitlines()[0] == NO_CUDA
    assert cap.stdout.count("gpumem:") == 1
    pages = [output.data.get("text/html", "") for output in cap.outputs]
    assert any("gpumem-report" in page for page in pages)  # the cell is still measured and reported
    assert not any("gpumem-trace" in page for page in pages)


WAYS_TO_RUN = {
    "%%time above": "%%time\n%%gpumem {line}\nx = torch.ones(3).sum().item()",
    "%%gpumem above %%time": "%%gpumem {line}\n%%time\nx = torch.ones(3).sum().item()",
    "run_cell_magic": "get_ipython().run_cell_magic('gpumem', '{line}', 'x = torch.ones(3).sum().item()')",
}


@pytest.mark.parametrize("auto", ["off", "on"])
@pytest.mark.parametrize("way", sorted(WAYS_TO_RUN))
def test_without_cuda_the_reason_is_given_however_the_cell_runs(shell: Any, way: str, auto: str) -> None:
    """--trace is not only read from a top-level cell's first line: the magic run as a function starts it too."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this test is about a machine without CUDA")
    shell.user_ns["torch"] = torch
    assert shell.run_cell(f"%gpumem auto {auto}").success
    result, cap = run_cell_capture(shell, WAYS_TO_RUN[way].format(line="--trace"))
    assert result.success, cap.stderr
    assert shell.user_ns["x"] == 3.0
    assert cap.stdout.count(NO_CUDA) == 1
    assert cap.stdout.count("gpumem:") == 1


def test_without_torch_imported(shell: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    result, cap = run_cell_capture(shell, "%%gpumem --trace-save out.pickle\ny = 41 + 1")
    assert result.success
    assert shell.user_ns["y"] == 42
    assert cap.stdout == (
        "gpumem: --trace: PyTorch is not installed in this Python environment; the cell runs without a trace.\n"
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--trace-entries 0", "--trace-entries must be 1 or more, not 0"),
        ("--trace-entries many", "invalid int value"),
    ],
)
def test_bad_trace_options_are_refused_and_the_body_does_not_run(shell: Any, line: str, message: str) -> None:
    result, cap = run_cell_capture(shell, f"%%gpumem {line}\nz = 1")
    assert "z" not in shell.user_ns
    assert message in cap.stderr + cap.stdout + str(result.error_in_exec or "")


def test_help_lists_the_trace_options(shell: Any) -> None:
    from gpumem.ipython.cell_magic import cell_usage

    text = cell_usage.__doc__ or ""
    for option in ("--trace ", "--trace-entries", "--trace-save"):
        assert option in text


def test_cell_numbers_come_from_ipythons_compiler(shell: Any) -> None:
    assert shell.run_cell("def f():\n    return 1", store_history=True).success
    numbers = cell_numbers(shell)
    assert 1 in numbers.values()
    name = [name for name, number in numbers.items() if number == 1][-1]  # the latest cell 1
    import linecache

    assert linecache.getline(name, 2).strip() == "return 1"


@pytest.mark.parametrize(
    ("cell", "auto"),
    [
        ("%%gpumem --trace\nraise KeyboardInterrupt", False),
        ("%%time\n%%gpumem --trace\nraise KeyboardInterrupt", False),
        ("%%time\n%%gpumem --trace\nraise KeyboardInterrupt", True),
        ("get_ipython().run_cell_magic('gpumem', '--trace', 'raise KeyboardInterrupt')", False),
        ("%%gpumem --trace\nraise ValueError('mine')", False),
    ],
)
def test_recording_stops_when_the_cell_is_interrupted(
    shell: Any, monkeypatch: pytest.MonkeyPatch, cell: str, auto: bool
) -> None:
    """Ctrl-C or an error inside a traced cell, however it is run: the allocator records no more after it,
    and a torch without skip_actions (before 2.9) is asked for nothing it does not know."""
    from test_trace import _FakeAllocator

    allocator = _FakeAllocator(recording=False, entries=[])
    allocator.install(monkeypatch)  # the older signature: no skip_actions
    if auto:
        assert shell.run_cell("%gpumem auto on").success
    result, cap = run_cell_capture(shell, cell)
    assert isinstance(result.error_in_exec, (KeyboardInterrupt, ValueError)), cap.stderr
    assert [call["enabled"] for call in allocator.calls] == ["all", None], cap.stderr
    assert "skip" not in allocator.calls[0]
    assert not allocator.recording
    assert "gpumem trace" in cap.stdout or any("trace" in str(out.data) for out in cap.outputs), cap.stdout


def test_the_costs_of_the_end_of_a_traced_cell_are_kept_by_phase(shell: Any) -> None:
    """LAST_COSTS (read by benchmarks/bench_trace.py) has each phase of the end of a traced cell; the
    snapshot comes from a stand-in recorder here (no CUDA), then is analysed and shown for real."""
    from IPython.utils.capture import capture_output

    from _harness.synthetic_trace import training_snapshot
    from gpumem.core.trace import CellSnapshot
    from gpumem.ipython import cell_recorders

    snapshot = training_snapshot(20)
    entries = len(snapshot["device_traces"][0])

    class Recorder:
        def stop(self) -> CellSnapshot:
            return CellSnapshot(snapshot, {0: 12}, False, [], None)

    taken = cell_recorders.stop_trace(Recorder())  # type: ignore[arg-type]
    with capture_output(display=True) as cap:
        report = cell_recorders.show_trace(taken, cell_recorders.TraceRequest(0, None), shell, 5, quiet=False)
    assert report is not None
    costs = cell_recorders.LAST_COSTS
    assert set(costs) == {"snapshot_s", "entries", "analysis_s", "render_s", "html_bytes"}
    assert costs["entries"] == entries - 12
    assert costs["html_bytes"] == len(cap.outputs[-1].data["text/html"].encode())
    assert all(costs[phase] > 0 for phase in ("snapshot_s", "analysis_s", "render_s"))
