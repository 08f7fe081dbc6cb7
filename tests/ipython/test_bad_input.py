"""Bad and odd input, as a demanding user types it: one clear line, never a traceback, never lost data.

Magics run in the real in-process IPython shell; the CUDA side is a fake allocator with two devices.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError

from _harness import gpumem_loaded, run_cell_capture
from gpumem.core.cells import CellOptions, CellTracker
from gpumem.core.monitoring.monitor import Monitor, set_default_monitor
from gpumem.ipython import extension as _extension
from gpumem.testing import GIB, MIB, FakeSource


@pytest.fixture
def fake() -> FakeSource:
    return FakeSource(devices=2)


@pytest.fixture
def shell(ip: Any, fake: FakeSource) -> Iterator[Any]:
    with gpumem_loaded(ip, fake) as loaded:
        loaded.user_ns.update(src=fake, GIB=GIB, MIB=MIB)
        yield loaded


def usage_error(shell: Any, cell: str) -> str:
    """Run ``cell``; it must fail with a UsageError shown as one line. Returns that line."""
    result, cap = run_cell_capture(shell, cell)
    assert isinstance(result.error_in_exec, UsageError), (cell, result.error_in_exec)
    shown = (cap.stderr + cap.stdout).strip()
    assert "Traceback" not in shown and len(shown.splitlines()) == 1, shown
    return shown


def config() -> Any:
    state = _extension.get_state()
    assert state is not None
    return state.config


# Sizes -------------------------------------------------------------------------------------------


def test_an_overflowing_threshold_is_a_usage_error(shell: Any) -> None:
    before = config().threshold.nbytes
    for size in ("1e400", "1e30"):
        assert "too large for a memory size" in usage_error(shell, f"%gpumem auto --threshold {size}")
    assert config().threshold.nbytes == before


def test_a_threshold_with_a_space_or_quotes(shell: Any) -> None:
    for line in ("--threshold 96 MiB", '--threshold "128 MiB"', "--threshold '2 GiB' on"):
        result, _cap = run_cell_capture(shell, f"%gpumem auto {line}")
        assert result.success, line
    assert config().threshold.nbytes == 2 * GIB and config().auto


def test_switch_ignores_case(shell: Any) -> None:
    assert run_cell_capture(shell, "%gpumem auto ON")[0].success and config().auto
    assert run_cell_capture(shell, "%gpumem auto Off")[0].success and not config().auto


# Quoting and files -------------------------------------------------------------------------------


def test_a_quoted_path_with_a_space_is_written_without_the_quotes(shell: Any, tmp_path: Path) -> None:
    run_cell_capture(shell, "%%gpumem\nh = src.allocate(MIB)")
    target = tmp_path / "my history.csv"
    result, cap = run_cell_capture(shell, f'%gpumem history --csv "{target}"')
    assert result.success, cap.stderr
    assert target.read_text().startswith("cell,")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my history.csv"]


def test_unbalanced_quotes_are_a_usage_error(shell: Any) -> None:
    assert "cannot split the options" in usage_error(shell, '%gpumem history --csv "/tmp/x.csv')


# Messages name their command; help on request ------------------------------------------------------


def test_errors_start_with_the_command_they_are_about(shell: Any) -> None:
    assert usage_error(shell, "%gpumem auto --bogus").startswith("UsageError: %gpumem auto: unrecognized")
    assert usage_error(shell, "%gpumem status extra").startswith("UsageError: %gpumem status: unrecognized")
    assert usage_error(shell, "%gpumem who --bogus").startswith("UsageError: %gpumem who: unrecognized")
    assert usage_error(shell, "%gpumem nosuch").startswith("UsageError: %gpumem: unknown subcommand")
    assert usage_error(shell, "%%gpumem extra\nran = 1").startswith("UsageError: %%gpumem: unrecognized")
    assert "ran" not in shell.user_ns


@pytest.mark.parametrize("line", ["-h", "--help", "help"])
def test_help_flags_print_the_help(shell: Any, line: str) -> None:
    result, cap = run_cell_capture(shell, f"%gpumem {line}")
    assert result.success and "%gpumem auto" in cap.stdout and "--threshold" in cap.stdout


def test_a_subcommands_help_flag_prints_that_subcommand(shell: Any) -> None:
    result, cap = run_cell_capture(shell, "%gpumem auto -h")
    assert result.success and cap.stdout.startswith("%gpumem auto\n") and "--threshold" in cap.stdout
    assert "%gpumem history" not in cap.stdout
    assert not config().auto


# Devices -----------------------------------------------------------------------------------------


def test_a_device_that_does_not_exist_is_refused_before_the_body_runs(shell: Any) -> None:
    message = usage_error(shell, "%%gpumem -d 7\nran = 1")
    assert "cuda:7: no such device; this process sees 2 CUDA devices (cuda:0, cuda:1)" in message
    assert "ran" not in shell.user_ns
    assert "cuda:5" in usage_error(shell, "%%gpumem -d 0,5\nran = 1")


def test_a_missing_device_is_named_when_cuda_starts_inside_the_block() -> None:
    fake = FakeSource(devices=1, cuda_initialized=False)
    tracker = CellTracker(Monitor(fake), start_sampler=False)
    cell = tracker.begin("x", options=CellOptions(devices=(0, 3), mode="magic"))
    fake.allocate(MIB)
    record = tracker.end(cell)
    assert [change.device for change in record.devices] == [0]
    assert record.cuda_note == "cuda:3: no such device; this process sees 1 CUDA device (cuda:0)"
    tracker.close()


def test_who_takes_a_device_index_like_the_other_commands(shell: Any) -> None:
    for line in ("-d 1", "--device 1", "-d cuda:1"):
        result, cap = run_cell_capture(shell, f"%gpumem who {line}")
        assert result.success, (line, cap.stderr)


# What the status and reports say -------------------------------------------------------------------


def test_status_counts_in_words_and_aligns_its_labels(shell: Any) -> None:
    _result, cap = run_cell_capture(shell, "%gpumem status")
    lines = cap.stdout.splitlines()
    assert lines[0] == "gpumem status"
    assert all(line[2:11].rstrip() and line[10] == " " and line[11] != " " for line in lines[1:]), lines
    assert "no samples taken yet" in cap.stdout and "0 cells recorded" in cap.stdout
    run_cell_capture(shell, "%%gpumem -q\nx = 1")
    _result, cap = run_cell_capture(shell, "%gpumem status")
    assert "  history  1 cell recorded" in cap.stdout


def test_a_zero_lower_bound_reads_as_zero_and_an_empty_cell_measures_nothing(shell: Any) -> None:
    shell.user_ns["src"].allocate(MIB)
    _result, cap = run_cell_capture(shell, "%%gpumem --keep-peaks\npass")
    text = cap.outputs[-1].data["text/plain"]
    html = cap.outputs[-1].data["text/html"]
    assert "pass" in text.splitlines()[0] and "pass" in html
    assert "≥ 0 B" in text and "≥ ±0 B" not in text and "≥ ±0 B" not in html
    _result, cap = run_cell_capture(shell, "%%gpumem --keep-peaks\n")
    assert not cap.outputs and "nothing measured" in cap.stdout and "0 B" not in cap.stdout


# Python API ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", ["10", None, True])
def test_a_rate_that_is_not_a_number_names_the_parameter(rate: Any) -> None:
    with pytest.raises(TypeError, match="rate_hz must be a number"):
        Monitor(FakeSource(), rate_hz=rate)


def test_a_source_that_is_not_one_is_refused_at_once() -> None:
    with pytest.raises(TypeError, match=r"Monitor\(source=\.\.\.\).*object has no snapshot"):
        Monitor(source=object())  # type: ignore[arg-type]


def test_a_holder_report_reads_as_the_who_table() -> None:
    torch = pytest.importorskip("torch")
    from gpumem.core.holders import find_holders

    report = find_holders({"weights": torch.ones(256)}, device="cpu")
    assert repr(report).startswith("Tensor memory held by names (cpu)")
    assert "weights" in repr(report) and "1.0 KiB" in repr(report)
    assert "<table>" in report._repr_html_()


def test_a_failing_optional_part_is_named_as_the_user_knows_it(
    ip: Any, fake: FakeSource, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpumem.ipython.oom_explainer import OomExplainer

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("hook refused")

    monkeypatch.setattr(OomExplainer, "__init__", broken)
    set_default_monitor(Monitor(fake))
    try:
        assert ip.run_cell("%load_ext gpumem").success
        err = capsys.readouterr().err
        assert "gpumem: the out-of-memory explanation failed (install): RuntimeError: hook refused" in err
        assert "gpumem.core.diagnoses.oom" not in err
        assert run_cell_capture(ip, "%gpumem status")[0].success  # the rest of the extension works
    finally:
        ip.run_cell("%unload_ext gpumem")
        set_default_monitor(None)


def test_a_summary_line_always_has_figures_and_names_the_other_warnings() -> None:
    from gpumem.core.cells import CellRecord, CellWarning
    from gpumem.core.cells.report import CellSummary

    record = CellRecord(
        serial=1,
        execution_count=3,
        first_line="x",
        source_hash="",
        started_wall_s=0.0,
        duration_s=0.001,
        status="ok",
        error=None,
        devices=(),
        host=None,
        variables=(),
        variables_note="",
        warnings=(CellWarning("leak", "grows"), CellWarning("graph", "graph kept"), CellWarning("capacity", "full")),
        cuda_note="CUDA is not in use",
        keep_peaks=False,
        mode="auto",
        quiet=False,
    )
    line = repr(CellSummary(record))
    assert line == "gpumem [3] 1.0 ms: no memory figures (see %gpumem status) ⚠ grows (+2 more: graph, capacity)"


def test_the_variable_table_stays_aligned_with_long_types_and_devices() -> None:
    from gpumem.core.cells import CellRecord, DeviceChange, VariableChange
    from gpumem.core.cells.report import CellReport

    change = DeviceChange(0, 0, 3 * GIB, 0, 4 * GIB, 3 * GIB, True, "", 4 * GIB, None, None, None, False)
    variables = (
        VariableChange("model", "DistributedDataParallel", "cuda:0,cuda:1", 2 * GIB, None, False),
        VariableChange("x", "Tensor", "cuda:0", GIB, 512 * MIB, False),
    )
    record = CellRecord(
        serial=1,
        execution_count=3,
        first_line="x",
        source_hash="",
        started_wall_s=0.0,
        duration_s=0.001,
        status="ok",
        error=None,
        devices=(change,),
        host=None,
        variables=variables,
        variables_note="new or grown since cell [2]",
        warnings=(),
        cuda_note=None,
        keep_peaks=False,
        mode="magic",
        quiet=False,
    )
    lines = repr(CellReport(record)).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("  variables holding GPU memory"))
    rows = lines[header + 1 : header + 3]
    assert [row.index("GiB") for row in rows] == [rows[0].index("GiB")] * 2
    assert rows[1].split() == ["x", "Tensor", "cuda:0", "1.0", "GiB", "+512.0", "MiB"]
    used = next(line for line in lines if "device used" in line)
    assert used.endswith("n/a (NVML unavailable)")  # no "[NVML, all processes]" after a figure it has not got


def test_free_counts_objects_in_words() -> None:
    from gpumem.core.cleanup import FreeResult

    assert "gc collected 1 object\n" in FreeResult((), False, (), (), 1, 0.0, "note").describe()
    assert "gc collected 2 objects" in FreeResult((), False, (), (), 2, 0.0).describe()


# A real kernel -----------------------------------------------------------------------------------


def test_bad_input_in_a_real_kernel_is_one_line_and_keeps_the_data(jupyter_env: Any, tmp_path: Path) -> None:
    from _harness import make_notebook, run_notebook

    bad = [
        "%gpumem auto --threshold 1e400",
        "%%gpumem -d cuda:x\nran = True",
        f'%gpumem history --csv "{tmp_path}/no such dir/x.csv"',
        '%gpumem history --json "unbalanced',
        "%gpumem nosuch",
    ]
    cells = [
        "%load_ext gpumem",
        "data = list(range(1000))",
        *bad,
        "%%gpumem\nraise SystemExit(3)",
        "%%gpumem\nraise KeyboardInterrupt",
        f'%gpumem history --csv "{tmp_path}/cells with space.csv"',
        "print(len(data), 'ran' in globals())",
    ]
    notebook = make_notebook(tmp_path / "bad.ipynb", cells)
    nb = run_notebook(notebook, jupyter_env=jupyter_env, timeout=120, allow_errors=True)
    for cell in nb.cells[2 : 2 + len(bad)]:
        streams = [out for out in cell.outputs if out.output_type == "stream"]
        assert [out.output_type for out in cell.outputs] == ["stream"], (cell.source, cell.outputs)
        assert streams[0].name == "stderr" and streams[0].text.startswith("UsageError: %")
        assert len(streams[0].text.strip().splitlines()) == 1, streams[0].text
    exit_cell, interrupt_cell = nb.cells[2 + len(bad)], nb.cells[3 + len(bad)]
    for cell, status in ((exit_cell, "error: SystemExit: 3"), (interrupt_cell, "interrupted")):
        reports = [out for out in cell.outputs if out.output_type == "display_data"]
        assert status in reports[0].data["text/plain"].splitlines()[0]
    assert (tmp_path / "cells with space.csv").read_text().count("\n") == 3  # header and the two cells
    assert nb.cells[-1].outputs[0].text == "1000 False\n"


def test_a_timeline_refuses_what_would_corrupt_it() -> None:
    from gpumem.core.sampling.timeline import Timeline

    timeline = Timeline()
    timeline.append(1.0, {"a": 1.0})
    with pytest.raises(ValueError, match="time_s must be a finite number"):
        timeline.append(float("nan"), {"a": 2.0})
    with pytest.raises(TypeError, match="channel 'a' must be a number"):
        timeline.append(2.0, {"a": "x"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="label must be a string"):
        Monitor(FakeSource()).mark(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="time order"):
        timeline.append(0.5, {"a": 3.0})  # the NaN was not taken as the last time
    timeline.append(3.0, {"a": 4.0})
    assert timeline.window().values == {"a": [1.0, 4.0]}


@pytest.mark.parametrize("subcommand", ["monitor", "sidebar", "who"])
def test_the_panel_refuses_a_device_that_does_not_exist(shell: Any, subcommand: str) -> None:
    message = usage_error(shell, f"%gpumem {subcommand} -d 3")
    assert f"%gpumem {subcommand}: --device cuda:3: no such device; this process sees 2 CUDA devices" in message


def test_a_panel_with_a_wrong_monitor_or_point_count_names_the_parameter(capsys: pytest.CaptureFixture[str]) -> None:
    import gc

    from gpumem import Panel

    with pytest.raises(TypeError, match=r"Panel\(monitor=\.\.\.\) takes a gpumem.Monitor, not object"):
        Panel(monitor=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="points_per_line must be a whole number"):
        Panel(Monitor(FakeSource()), points_per_line="x", autostart=False)  # type: ignore[arg-type]
    gc.collect()
    assert "Traceback" not in capsys.readouterr().err  # nothing half-built left to fail in __del__


def test_status_says_when_the_sampler_cannot_read(
    shell: Any, fake: FakeSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*, process_memory: bool = False) -> Any:
        raise OSError("driver went away")

    state = _extension.get_state()
    assert state is not None
    sampler = state.monitor.sampler
    monkeypatch.setattr(fake, "snapshot", broken)
    sampler.start()
    try:
        deadline = time.monotonic() + 10
        while sampler.last_error is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        sampler.stop()
    _result, cap = run_cell_capture(shell, "%gpumem status")
    assert "the last read failed: OSError: driver went away" in cap.stdout


def test_a_start_that_failed_does_not_leave_later_cells_with_kept_peaks(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeSource()
    tracker = CellTracker(Monitor(fake), start_sampler=False)
    original = fake.snapshot

    def failing(*, process_memory: bool = False) -> Any:
        raise OSError("device lost")

    monkeypatch.setattr(fake, "snapshot", failing)
    with pytest.raises(OSError) as failure:
        tracker.begin("first")
    monkeypatch.setattr(fake, "snapshot", original)
    fake.transient(GIB)
    record = tracker.end(tracker.begin("second"))
    # The kept traceback (IPython keeps the last one too) still holds the half-started cell; it must not
    # count as running, or the counters would not be reset and the peak would not be exact.
    assert failure.traceback and not record.keep_peaks
    tracker.close()


def test_ctrl_c_inside_gpumems_own_work_is_one_line(
    shell: Any, fake: FakeSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _extension.get_state()
    assert state is not None

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(state.tracker, "holder_finder", interrupted)
    result, cap = run_cell_capture(shell, "%%gpumem\nh = src.allocate(MIB)")
    assert result.success and "Error in callback" not in cap.stdout and "Traceback" not in cap.stdout
    assert "variables: inspection interrupted" in cap.outputs[-1].data["text/plain"]
    assert state.tracker.history[-1].devices[0].allocated_delta_bytes == MIB

    monkeypatch.setattr(fake, "snapshot", interrupted)
    result, cap = run_cell_capture(shell, "%%gpumem\nran = True")
    assert result.success and shell.user_ns["ran"] is True  # the cell itself still ran
    assert cap.stderr.strip() == "gpumem: could not start measuring this cell: KeyboardInterrupt"
    assert "Error in callback" not in cap.stdout


def test_a_failing_start_under_time_still_runs_the_body(
    shell: Any, fake: FakeSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("device lost")

    monkeypatch.setattr(fake, "snapshot", broken)
    result, cap = run_cell_capture(shell, "%%time\n%%gpumem\nran = 6 * 7")
    assert result.success and shell.user_ns["ran"] == 42
    assert "gpumem: could not start measuring this cell: OSError: device lost" in cap.stderr
    assert "Traceback" not in cap.stdout + cap.stderr
