"""%%gpumem and %gpumem in a real in-process IPython shell.

The CUDA side is a deterministic fake allocator the cells drive (``src``); the host side, the cell
semantics, the hooks, the reports and the files are all real.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError

from _harness import gpumem_loaded, run_cell_capture, walk_cpu_tensors
from gpumem.core.cells import CellRecord
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


def history() -> tuple[CellRecord, ...]:
    state = _extension.get_state()
    assert state is not None
    return state.tracker.history


def html_of(cap: Any) -> list[str]:
    return [output.data["text/html"] for output in cap.outputs if "text/html" in output.data]


def reports(cap: Any) -> list[str]:
    return [text for text in html_of(cap) if "gpumem-report" in text]


# A %%gpumem cell is the same cell ----------------------------------------------------------------

BODY = """\
from IPython.display import display
print("printed")
display("displayed")
y = 6 * 7
y"""


def test_body_runs_exactly_like_a_normal_cell(shell: Any) -> None:
    plain, plain_cap = run_cell_capture(shell, BODY)
    count = shell.execution_count
    measured, cap = run_cell_capture(shell, "%%gpumem\n" + BODY)
    assert measured.success and measured.result == plain.result == 42
    assert measured.execution_count == count == plain.execution_count + 1
    assert shell.user_ns["_"] == 42 and shell.user_ns["Out"][count] == 42 and shell.user_ns[f"_{count}"] == 42
    assert plain_cap.stdout == f"printed\nOut[{count - 1}]: 42\n"
    assert cap.stdout == f"printed\nOut[{count}]: 42\n"
    assert cap.outputs[0].data["text/plain"] == plain_cap.outputs[0].data["text/plain"] == "'displayed'"
    assert len(reports(cap)) == 1 and "gpumem-report" not in str(plain_cap.outputs)
    (record,) = history()
    assert record.execution_count == count and record.first_line == "from IPython.display import display"
    assert record.mode == "magic"


def test_a_body_run_by_run_cell_magic_is_named_after_the_calling_cell(shell: Any) -> None:
    # IPython counts the running cell before it runs: the body's lines belong to the cell calling the magic.
    call = "get_ipython().run_cell_magic('gpumem', '-q', 'import sys; here = sys._getframe().f_code.co_filename')"
    assert run_cell_capture(shell, "x = 1")[0].success  # cell [1]
    assert run_cell_capture(shell, call)[0].success  # cell [2]
    assert shell.compile._filename_map[shell.user_ns["here"]] == 2


def test_semicolon_magics_and_await_inside_the_body(shell: Any) -> None:
    shell.user_ns["_"] = "before"
    result, _cap = run_cell_capture(shell, "%%gpumem\n41 + 1;")
    assert result.success and result.result is None and shell.user_ns["_"] == "before"
    result, cap = run_cell_capture(shell, "%%gpumem\n%time z = 5\nz_sq = z * z\nz_sq")
    assert result.success and result.result == 25
    assert "Wall time" in cap.stdout
    result, _cap = run_cell_capture(shell, "%%gpumem\nimport asyncio\nawait asyncio.sleep(0)\n'awaited'")
    assert result.success and result.result == "awaited"
    assert len(history()) == 3


def test_exception_in_the_body_is_the_cells_exception(shell: Any) -> None:
    result, cap = run_cell_capture(shell, "%%gpumem\nx = 1\nraise ValueError('bad ' + str(x))")
    assert isinstance(result.error_in_exec, ValueError) and str(result.error_in_exec) == "bad 1"
    assert "----> 3 raise ValueError" in cap.stdout  # line numbers are the cell's own
    (record,) = history()
    assert record.status == "error" and record.error == "ValueError: bad 1"
    assert len(reports(cap)) == 1


def test_bad_option_is_a_usage_error_and_the_body_does_not_run(shell: Any) -> None:
    result, cap = run_cell_capture(shell, "%%gpumem --nope\nran = True")
    assert isinstance(result.error_in_exec, UsageError)
    assert "unrecognized arguments: --nope" in cap.stderr + cap.stdout
    assert "Traceback" not in cap.stderr + cap.stdout
    assert "ran" not in shell.user_ns
    result, _cap = run_cell_capture(shell, "%%gpumem -d x\nran = True")
    assert isinstance(result.error_in_exec, UsageError) and "ran" not in shell.user_ns
    result, _cap = run_cell_capture(shell, "%%gpumem --top -1\nran = True")
    assert isinstance(result.error_in_exec, UsageError) and "ran" not in shell.user_ns


def test_report_figures_and_html(shell: Any) -> None:
    shell.user_ns["held"] = shell.user_ns["src"].allocate(GIB)
    cell = "%%gpumem\nlabel = '<b>not bold</b>'\nh = src.allocate(1 * GIB)\nsrc.transient(2 * GIB)"
    result, cap = run_cell_capture(shell, cell)
    assert result.success
    (change,) = history()[-1].devices
    assert (change.allocated_before_bytes, change.allocated_after_bytes) == (GIB, 2 * GIB)
    assert change.peak_exact and change.peak_above_start_bytes == 3 * GIB
    (html,) = reports(cap)
    assert "cuda:0" in html and "+1.0 GiB" in html and "+3.0 GiB" in html and "host RSS" in html
    assert "&lt;b&gt;not bold&lt;/b&gt;" in html and "<b>not bold</b>" not in html
    text = cap.outputs[-1].data["text/plain"]
    assert "cuda:0" in text and "allocated    1.0 GiB → 2.0 GiB (+1.0 GiB)" in text
    assert "peak         +3.0 GiB (4.0 GiB, exact)" in text


def test_quiet_records_without_showing(shell: Any) -> None:
    result, cap = run_cell_capture(shell, "%%gpumem -q\nh = src.allocate(GIB)")
    assert result.success and cap.outputs == [] and cap.stdout == ""
    (record,) = history()
    assert record.quiet and record.devices[0].allocated_delta_bytes == GIB


def test_keep_peaks_and_a_reset_inside_the_cell(shell: Any) -> None:
    fake = shell.user_ns["src"]
    fake.allocate(GIB)
    fake.transient(4 * GIB)
    _result, cap = run_cell_capture(shell, "%%gpumem --keep-peaks\nsrc.transient(GIB)")
    record = history()[-1]
    assert record.keep_peaks and not record.devices[0].peak_exact
    assert fake.snapshot().allocator[0].peak_allocated_bytes == 5 * GIB  # the user's peak survived
    assert "sampled" in reports(cap)[0]

    shell.user_ns["big"] = fake.allocate(2 * GIB)
    _result, cap = run_cell_capture(shell, "%%gpumem\nsrc.free(big)\nsrc.reset_peaks([0])\nh = src.allocate(MIB)")
    record = history()[-1]
    assert not record.devices[0].peak_exact
    assert [w.kind for w in record.warnings] == ["peak-reset"]
    assert "peak counter was reset inside the cell" in reports(cap)[0]


def test_device_option(shell: Any) -> None:
    run_cell_capture(shell, "%%gpumem -d cuda:1\na = src.allocate(GIB, 0)\nb = src.allocate(MIB, 1)")
    assert [(c.device, c.allocated_delta_bytes) for c in history()[-1].devices] == [(1, MIB)]
    run_cell_capture(shell, "%%gpumem --device 0,1\nc = src.allocate(MIB, 0)")
    assert [c.device for c in history()[-1].devices] == [0, 1]


def test_no_cuda_in_use_says_so(shell: Any) -> None:
    shell.user_ns["src"].cuda_initialized = False
    _result, cap = run_cell_capture(shell, "%%gpumem\nx = 1")
    (html,) = reports(cap)
    assert "CUDA is not in use" in html and "host RSS" in html


# %%gpumem reached some other way -----------------------------------------------------------------


def test_called_as_a_function_runs_and_measures_the_body(shell: Any) -> None:
    value = shell.run_cell_magic("gpumem", "--top 1", "h = src.allocate(GIB)\n6 * 7")
    assert value == 42 and "h" in shell.user_ns
    assert history()[-1].devices[0].allocated_delta_bytes == GIB
    with pytest.raises(ZeroDivisionError):
        shell.run_cell_magic("gpumem", "", "1 / 0")
    assert history()[-1].status == "error"
    with pytest.raises(UsageError):
        shell.run_cell_magic("gpumem", "--bogus", "ran = True")
    assert "ran" not in shell.user_ns


@pytest.mark.parametrize("order", ["time first", "gpumem first"])
def test_with_time_in_either_order(shell: Any, order: str) -> None:
    magics = ["%%time", "%%gpumem"] if order == "time first" else ["%%gpumem", "%%time"]
    result, cap = run_cell_capture(shell, "\n".join([*magics, "h = src.allocate(GIB)", "6 * 7"]))
    assert result.success and result.result == 42
    assert "Wall time" in cap.stdout
    assert len(reports(cap)) == 1
    (record,) = history()
    assert record.devices[0].allocated_delta_bytes == GIB and record.mode == "magic"


def test_time_above_gpumem_in_auto_mode_records_once(shell: Any) -> None:
    shell.run_line_magic("gpumem", "auto on")
    _result, cap = run_cell_capture(shell, "%%time\n%%gpumem\nh = src.allocate(GIB)")
    assert len(reports(cap)) == 1
    assert [r.mode for r in history()] == ["magic"]


# Automatic mode ----------------------------------------------------------------------------------


def test_auto_mode_records_every_cell_and_shows_only_notable_ones(shell: Any) -> None:
    _result, cap = run_cell_capture(shell, "%gpumem auto on --threshold 100MiB")
    assert "automatic mode is on" in cap.stdout and "100.0 MiB" in cap.stdout
    _result, cap = run_cell_capture(shell, "a = src.allocate(10 * MIB)")
    assert cap.outputs == []
    _result, cap = run_cell_capture(shell, "b = src.allocate(200 * MIB)")
    (line,) = [output.data["text/plain"] for output in cap.outputs]
    assert line.startswith("gpumem [") and "cuda:0 allocated +200.0 MiB" in line and "\n" not in line
    _result, cap = run_cell_capture(shell, "%%gpumem\nc = src.allocate(MIB)")
    assert len(reports(cap)) == 1
    run_cell_capture(shell, "%gpumem auto off")
    run_cell_capture(shell, "d = src.allocate(GIB)")
    modes = [(r.first_line, r.mode) for r in history()]
    assert modes == [
        ("a = src.allocate(10 * MIB)", "auto"),
        ("b = src.allocate(200 * MIB)", "auto"),
        ("c = src.allocate(MIB)", "magic"),
    ]  # "%gpumem auto off" is gpumem's own command: not recorded (c.GpuMem.record_own_commands)


def test_failures_are_recorded_with_their_status(shell: Any) -> None:
    torch = pytest.importorskip("torch")
    shell.user_ns["torch"] = torch
    shell.run_line_magic("gpumem", "auto on")
    cells = [
        "raise ValueError('no')",
        "import os, signal\nh = src.allocate(GIB)\nos.kill(os.getpid(), signal.SIGINT)\nfor _ in range(10**7): pass",
        "raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 20.00 GiB')",
        "h2 = src.allocate(500 * GIB)",
        "x = = 1",
    ]
    for cell in cells:
        result, _cap = run_cell_capture(shell, cell)
        assert not result.success
    statuses = [(r.status, (r.error or "").split(":")[0]) for r in history()]
    assert statuses == [
        ("error", "ValueError"),
        ("interrupted", "KeyboardInterrupt"),
        ("out of memory", "OutOfMemoryError"),
        ("out of memory", "MemoryError"),
        ("error", "SyntaxError"),
    ]
    assert history()[1].devices[0].allocated_delta_bytes == GIB  # what it held when interrupted
    assert run_cell_capture(shell, "ok = 1")[0].success
    assert history()[-1].status == "ok"


def test_nested_and_empty_cells_do_not_confuse_the_bookkeeping(shell: Any) -> None:
    shell.run_line_magic("gpumem", "auto on")
    run_cell_capture(shell, "get_ipython().run_cell('inner = src.allocate(GIB)')\nouter = src.allocate(MIB)")
    run_cell_capture(shell, "   ")
    run_cell_capture(shell, "")
    run_cell_capture(shell, "after = src.allocate(MIB)")
    assert [r.first_line for r in history()] == [
        "get_ipython().run_cell('inner = src.allocate(GIB)')",
        "after = src.allocate(MIB)",
    ]
    assert history()[0].devices[0].allocated_delta_bytes == GIB + MIB


def test_leak_warning_on_rerun_in_auto_mode(shell: Any) -> None:
    shell.run_line_magic("gpumem", "auto on")
    shell.user_ns["cache"] = []
    outputs = [run_cell_capture(shell, "cache.append(src.allocate(32 * MIB))")[1].outputs for _ in range(3)]
    assert outputs[0] == [] and outputs[1] == []  # below the 64 MiB threshold and no warning yet
    (line,) = [output.data["text/plain"] for output in outputs[2]]
    assert "possible leak on re-run" in line and "32.0 MiB" in line


def test_graph_warning_with_real_tensors(shell: Any) -> None:
    torch = pytest.importorskip("torch")
    walk_cpu_tensors()
    shell.user_ns.update(torch=torch, w=torch.randn(32, 32, requires_grad=True), losses=[])
    shell.run_line_magic("gpumem", "auto on")
    cell = "loss = (w @ w).sum()\nlosses.append(loss)\nh = src.allocate(8 * MIB)"
    run_cell_capture(shell, cell)
    _result, cap = run_cell_capture(shell, cell)
    (line,) = [output.data["text/plain"] for output in cap.outputs]
    assert "`losses[0]`, `losses[1]`" in line and ".item()" in line
    names = {v.name for v in history()[-1].variables}
    assert "losses" in names


# History -----------------------------------------------------------------------------------------


def test_history_table_exports_and_dataframe(shell: Any, tmp_path: Path) -> None:
    import gpumem

    run_cell_capture(shell, "%%gpumem -q\nh = src.allocate(GIB)")
    run_cell_capture(shell, "%%gpumem -q\nraise KeyError('k')")
    _result, cap = run_cell_capture(shell, "%gpumem history")
    text = cap.outputs[0].data["text/plain"]
    assert "+1.0 GiB" in text and "error" in text and "h = src.allocate(GIB)" in text

    csv_path, json_path = tmp_path / "h.csv", tmp_path / "h.json"
    _result, cap = run_cell_capture(shell, f"%gpumem history --csv {csv_path} --json {json_path}")
    assert "wrote 2 cells" in cap.stdout
    rows = list(csv.DictReader(csv_path.open()))
    assert [row["status"] for row in rows] == ["ok", "error"]
    assert int(rows[0]["cuda0_allocated_delta_bytes"]) == GIB
    data = json.loads(json_path.read_text())
    assert data["gpumem_history"] == 1
    cells = data["cells"]
    assert cells[0]["devices"][0]["allocated_delta_bytes"] == GIB and cells[1]["error"] == "KeyError: 'k'"

    frame = gpumem.history()
    assert list(frame["status"]) == ["ok", "error"]
    assert frame["cuda0_allocated_delta_bytes"].iloc[0] == GIB
    assert str(frame["cuda0_allocated_delta_bytes"].dtype) == "Int64"
    assert "started" in frame.columns and "host_rss_delta_bytes" in frame.columns

    result, cap = run_cell_capture(shell, "%gpumem history --csv /nonexistent-dir/h.csv")
    assert isinstance(result.error_in_exec, UsageError) and "cannot write CSV" in cap.stderr + cap.stdout
    run_cell_capture(shell, "%gpumem history --clear")
    assert history() == ()
    _result, cap = run_cell_capture(shell, "%gpumem history")
    assert cap.outputs[0].data["text/plain"] == "No measured cells yet."


def test_history_without_the_extension_is_a_clear_error(ip: Any) -> None:
    import gpumem

    assert _extension.get_state() is None
    with pytest.raises(RuntimeError, match="load it first with %load_ext gpumem"):
        gpumem.history()


# %gpumem -----------------------------------------------------------------------------------------


def test_help_documents_every_option(shell: Any) -> None:
    from IPython.utils.capture import capture_output

    for query in ("%gpumem?", "%%gpumem?"):
        with capture_output() as cap:
            shell.run_cell(query)
        for option in ("--device", "--quiet", "--keep-peaks", "--top", "--no-vars", "max_memory_allocated"):
            assert option in cap.stdout, (query, option)
        for sub in ("%gpumem auto", "%gpumem history", "%gpumem status", "--threshold", "--csv", "--json"):
            assert sub in cap.stdout, (query, sub)


def test_subcommand_errors_are_one_line(shell: Any) -> None:
    for line, message in (
        ("nosuch", "unknown subcommand 'nosuch'"),
        ("auto maybe", "invalid choice: 'maybe'"),
        ("auto --threshold lots", "expected a size"),
        ("history --last -1", "--last must be 0 or more"),
    ):
        result, cap = run_cell_capture(shell, f"%gpumem {line}")
        assert isinstance(result.error_in_exec, UsageError), line
        assert message in cap.stderr + cap.stdout, line
        assert "Traceback" not in cap.stderr + cap.stdout


def test_status(shell: Any) -> None:
    _result, cap = run_cell_capture(shell, "%gpumem status")
    assert "torch    ok" in cap.stdout and "sampler" in cap.stdout and "auto     off" in cap.stdout


def test_sizes() -> None:
    from gpumem.ipython.arguments import parse_size

    assert parse_size("64MiB") == 64 * MIB
    assert parse_size("1 GiB") == GIB
    assert parse_size("1G") == GIB
    assert parse_size("500MB") == 500_000_000
    assert parse_size("1e6") == 1_000_000
    assert parse_size("0") == 0
    with pytest.raises(UsageError):
        parse_size("-5MiB")


# The host side, for real -------------------------------------------------------------------------


@pytest.fixture
def real_shell(ip: Any) -> Iterator[Any]:
    with gpumem_loaded(ip) as loaded:
        yield loaded


def test_host_rss_of_a_256_mib_array(real_shell: Any) -> None:
    pytest.importorskip("numpy")
    result, cap = run_cell_capture(real_shell, "%%gpumem\nimport numpy as np\nbig = np.ones(256 << 20, dtype=np.uint8)")
    assert result.success
    host = history()[-1].host
    assert host is not None
    assert abs(host.rss_delta_bytes - 256 * MIB) <= 0.05 * 256 * MIB, host
    assert "host RSS" in reports(cap)[0]


def test_host_peak_of_a_transient_array(real_shell: Any) -> None:
    pytest.importorskip("numpy")
    from gpumem.core.readers.sources import HostSource

    reading = HostSource().read()
    assert reading is not None
    size = max(256 * MIB, reading.peak_rss_bytes - reading.rss_bytes + 256 * MIB)
    if size > 2 * GIB:
        pytest.skip("this process already peaked far above its current size")
    real_shell.user_ns["size"] = size
    result, _cap = run_cell_capture(real_shell, "%%gpumem\nimport numpy as np\nnp.ones(size, dtype=np.uint8).sum()")
    assert result.success
    host = history()[-1].host
    assert host is not None
    assert host.peak_exact  # the process's lifetime peak rose inside the cell
    assert host.peak_above_start_bytes >= 0.95 * size
    assert abs(host.rss_delta_bytes) < size // 2


def test_output_cache_holding_a_tensor_is_named(shell: Any) -> None:
    torch = pytest.importorskip("torch")
    walk_cpu_tensors()
    shell.user_ns["torch"] = torch
    shell.run_line_magic("gpumem", "auto on --vars always")
    run_cell_capture(shell, "h = src.allocate(MIB)")
    result, cap = run_cell_capture(shell, "h2 = src.allocate(MIB)\ntorch.ones(1000)")
    count = result.execution_count
    (variable,) = history()[-1].variables
    assert variable.name == f"Out[{count}]" and variable.hidden and variable.nbytes == 4000
    (line,) = [output.data["text/plain"] for output in cap.outputs if "gpumem" in output.data["text/plain"]]
    assert f"IPython keeps references to Out[{count}]" in line
