"""What a newcomer reads first: the automatic-mode message, the help, the report header, and a history
that holds the user's cells, not gpumem's own commands. Real IPython shell, fake CUDA allocator."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from _harness import run_cell_capture
from gpumem.core.cells import CellRecord
from gpumem.core.monitoring.monitor import Monitor, set_default_monitor
from gpumem.core.units import format_bytes
from gpumem.ipython import extension as _extension
from gpumem.testing import GIB, MIB, FakeSource

SHORT = 120  # JupyterLab breaks longer lines mid-word in a narrow output area


@pytest.fixture
def shell(ip: Any) -> Iterator[Any]:
    fake = FakeSource(devices=1)
    set_default_monitor(Monitor(fake))
    assert ip.run_cell("%load_ext gpumem").success
    ip.user_ns.update(src=fake, GIB=GIB, MIB=MIB)
    try:
        yield ip
    finally:
        ip.run_cell("%config GpuMem.record_own_commands = False")
        ip.run_cell("%unload_ext gpumem")
        set_default_monitor(None)


def history() -> tuple[CellRecord, ...]:
    state = _extension.get_state()
    assert state is not None
    return state.tracker.history


@pytest.mark.parametrize("options", ["", " --keep-peaks", " --vars always", " --vars never --threshold 1GiB"])
def test_auto_mode_message_is_two_short_lines(shell: Any, options: str) -> None:
    _result, cap = run_cell_capture(shell, "%gpumem auto on" + options)
    lines = cap.stdout.rstrip("\n").splitlines()
    assert len(lines) == 2, cap.stdout
    assert all(len(line) <= SHORT for line in lines), [len(line) for line in lines]
    assert lines[0].startswith("gpumem automatic mode is on: every cell is measured")
    _result, cap = run_cell_capture(shell, "%gpumem status")
    auto = [line for line in cap.stdout.splitlines() if line.startswith("  auto")]
    (first,) = auto
    following = cap.stdout.splitlines()[cap.stdout.splitlines().index(first) + 1]
    assert first == "  auto     " + lines[0].removeprefix("gpumem automatic mode is ")
    assert following == "           " + lines[1]


def test_auto_mode_message_says_the_settings(shell: Any) -> None:
    _result, cap = run_cell_capture(shell, "%gpumem auto on --threshold 100MiB --keep-peaks --vars always")
    assert "100.0 MiB+" in cap.stdout and "peaks sampled (lower bounds)" in cap.stdout
    assert "after every cell" in cap.stdout
    _result, cap = run_cell_capture(shell, "%gpumem auto --reset-peaks --vars changed")
    assert "peaks exact" in cap.stdout and "after 1.0 MiB+ changes" in cap.stdout


def test_help_has_no_markup_leftovers_and_plain_metavars(shell: Any) -> None:
    _result, cap = run_cell_capture(shell, "%gpumem help")
    text = cap.stdout
    assert "%gpumem auto [" in text and "%%gpumem" in text
    assert not [line for line in text.splitlines() if line.strip() == "::"]
    assert "{changed,always,never}" not in text and "{on,off}" not in text
    text = " ".join(text.split())
    assert "--vars MODE" in text and "(default changed)" in text and "always (after every cell) or never" in text
    _result, cap = run_cell_capture(shell, "%gpumem auto -h")
    assert cap.stdout.startswith("%gpumem auto\n")
    assert "::" not in cap.stdout


def test_report_header_closes_up_the_padding_of_the_first_line(shell: Any) -> None:
    _result, cap = run_cell_capture(shell, "%%gpumem\nw = src.allocate(2 * MIB)          # stays\n")
    (plain,) = [out.data["text/plain"] for out in cap.outputs if "text/plain" in out.data]
    header = plain.splitlines()[0]
    assert "w = src.allocate(2 * MIB) # stays" in header, header
    (record,) = history()
    assert record.first_line == "w = src.allocate(2 * MIB)          # stays"  # the history keeps the source


def test_own_commands_stay_out_of_the_history(shell: Any) -> None:
    cells = [
        "%gpumem auto on",
        "a = src.allocate(10 * MIB)",
        "%gpumem status",
        "%gpumem history --last 3\n%gpumem who",
        "# look\n%gpumem free",
        "%%gpumem\nb = src.allocate(MIB)",
        "c = src.allocate(MIB)\n%gpumem status",
        "x = 1",
    ]
    for cell in cells:
        result, _cap = run_cell_capture(shell, cell)
        assert result.success, cell
    assert [r.first_line for r in history()] == [
        "a = src.allocate(10 * MIB)",
        "b = src.allocate(MIB)",
        "c = src.allocate(MIB)",
        "x = 1",
    ]
    run_cell_capture(shell, "%config GpuMem.record_own_commands = True")
    run_cell_capture(shell, "%gpumem status")
    assert history()[-1].first_line == "%gpumem status"


def test_status_prints_the_figures_now_as_the_terminal_monitor_note_promises(shell: Any) -> None:
    _result, cap = run_cell_capture(shell, "%gpumem monitor")
    note = cap.stdout.splitlines()
    assert len(note) == 2 and all(len(line) <= SHORT for line in note), note
    assert "%gpumem status prints the figures now" in note[1]
    run_cell_capture(shell, "w = src.allocate(300 * MIB)")
    snapshot = shell.user_ns["src"].snapshot()
    (allocator,), (whole,) = snapshot.allocator, snapshot.devices
    _result, cap = run_cell_capture(shell, "%gpumem status")
    lines = cap.stdout.splitlines()
    assert lines[1] == (
        f"  cuda:0   allocated {format_bytes(allocator.allocated_bytes)}, "
        f"reserved {format_bytes(allocator.reserved_bytes)}, device used {format_bytes(whole.used_bytes)} "
        f"of {format_bytes(whole.total_bytes)} (all processes)"
    )
    assert allocator.allocated_bytes >= 300 * MIB
    assert snapshot.host is not None
    assert lines[2] == f"  host RAM RSS {format_bytes(snapshot.host.rss_bytes)} (this process)"
    assert lines[3].startswith("  torch")
    labels = [line[2:10].strip() for line in lines[1:] if line[2:10].strip()]
    assert len(labels) == len(set(labels)), labels  # each row says what it is, no label twice


def test_help_usage_lines_are_filled_and_aligned_under_the_first_option(shell: Any) -> None:
    _result, cap = run_cell_capture(shell, "%gpumem help")
    lines = cap.stdout.splitlines()
    assert "%gpumem auto [--threshold AMOUNT] [--vars MODE] [--keep-peaks] [--reset-peaks] [on|off]" in lines
    start = lines.index("%%gpumem [-d DEVICES] [-q] [-k] [--top N] [--vars MODE] [--no-vars]")
    assert lines[start + 1] == "         [--trace] [--trace-entries N] [--trace-save PATH] [--profile]"
    assert lines[start + 2] == "         [--predict] [--capacity SIZE] [--batch NAME=LOW..HIGH]"
    usage = [line for line in lines if line.startswith("%") or line.lstrip().startswith("[")]
    assert all(len(line) <= 100 for line in usage), usage
    _result, cap = run_cell_capture(shell, "%gpumem monitor -h")
    assert cap.stdout.splitlines()[2].startswith("%gpumem monitor [-w WINDOW]")


def _error_line(shell: Any, line: str) -> str:
    result, cap = run_cell_capture(shell, line)
    assert result.error_in_exec is not None or result.error_before_exec is not None, line
    said = (cap.stderr + cap.stdout).strip()
    assert "Traceback" not in said and len(said.splitlines()) == 1, said
    return said


@pytest.mark.parametrize(
    ("line", "hint"),
    [
        ("%gpumem histroy", "did you mean history?"),
        ("%gpumem stauts", "did you mean status?"),
        ("%gpumem history --lsat 3", "did you mean --last?"),
        ("%gpumem auto on --treshold 1GiB", "did you mean --threshold?"),
        ("%gpumem who --cycels", "did you mean --cycles?"),
        ("%gpumem free --depe", "did you mean --deep?"),
    ],
)
def test_a_mistyped_subcommand_or_option_gets_a_did_you_mean(shell: Any, line: str, hint: str) -> None:
    said = _error_line(shell, line)
    assert said.startswith("UsageError: %gpumem") and hint in said, said


def test_a_mistyped_cell_option_gets_a_did_you_mean_and_the_cell_does_not_run(shell: Any) -> None:
    said = _error_line(shell, "%%gpumem --trcae\nran = True")
    assert "unrecognized arguments: --trcae; did you mean --trace?" in said, said
    assert "ran" not in shell.user_ns


def test_nothing_close_gets_no_guess(shell: Any) -> None:
    said = _error_line(shell, "%gpumem xyzzy")
    assert "did you mean" not in said and "use one of: auto, export" in said
    assert "did you mean" not in _error_line(shell, "%gpumem history --zzz")


@pytest.mark.parametrize("body", ["", "\n\n", "# only a comment\n   \n# and another"])
def test_a_cell_with_no_code_says_nothing_was_measured(shell: Any, body: str) -> None:
    before = len(history())
    result, cap = run_cell_capture(shell, "%%gpumem\n" + body)
    assert result.success
    assert cap.stdout == "%%gpumem: nothing measured (the cell has no code below the %%gpumem line)\n"
    assert not cap.outputs and "peak" not in cap.stdout
    assert len(history()) == before  # no row of noise in the history
    result, cap = run_cell_capture(shell, "%%gpumem -q\n# quiet")
    assert result.success and cap.stdout == "" and not cap.outputs


def test_a_cell_with_no_code_called_as_a_function_says_so_too(shell: Any) -> None:
    result, cap = run_cell_capture(shell, "get_ipython().run_cell_magic('gpumem', '', '# nothing here')")
    assert result.success
    assert "nothing measured" in cap.stdout and not cap.outputs


def test_automatic_mode_records_no_cell_without_code(shell: Any) -> None:
    run_cell_capture(shell, "%gpumem auto on --threshold 0")
    run_cell_capture(shell, "a = src.allocate(MIB)")
    shell.user_ns["src"].allocate(5 * MIB)  # memory that changes between cells: no comment-only cell owns it
    result, cap = run_cell_capture(shell, "# a note to myself")
    assert result.success and cap.stdout == "" and not cap.outputs
    assert [record.first_line for record in history()] == ["a = src.allocate(MIB)"]


def test_history_hides_the_by_kind_column_when_no_cell_has_kinds(ip: Any) -> None:
    """On a machine without CUDA (the real host source, torch's CPU build or none) no cell is sorted by kind."""
    set_default_monitor(Monitor(FakeSource(devices=0)))
    assert ip.run_cell("%load_ext gpumem").success
    try:
        run_cell_capture(ip, "%gpumem auto on")
        run_cell_capture(ip, "data = bytearray(8 << 20)")
        run_cell_capture(ip, "more = bytearray(8 << 20)")
        _result, cap = run_cell_capture(ip, "%gpumem history")
        (output,) = cap.outputs
        text, page = output.data["text/plain"], output.data["text/html"]
        assert "data = bytearray(8 << 20)" in text and "more = bytearray" in page
        assert "by kind" not in text and "by kind" not in page
        assert text.splitlines()[0].split()[-5:] == ["host", "\u0394", "warnings", "first", "line"]
    finally:
        ip.run_cell("%unload_ext gpumem")
        set_default_monitor(None)


def test_who_names_large_numpy_arrays_it_does_not_count(shell: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch not imported (as in a fresh kernel): no tensor holds memory, but the arrays hold host memory."""
    np = pytest.importorskip("numpy")
    monkeypatch.setitem(sys.modules, "torch", None)
    shell.user_ns.update(big=np.zeros(256 * MIB, dtype=np.uint8), small=np.zeros(4, dtype=np.uint8))
    shell.user_ns["view"] = shell.user_ns["big"][: 128 * MIB]  # shares big's memory: counted once, as big
    _result, cap = run_cell_capture(shell, "%gpumem who")
    (output,) = cap.outputs
    text = output.data["text/plain"]
    assert "so no tensor can hold memory" in text
    assert text.splitlines()[-1] == (
        "numpy arrays, host memory not listed here (who names torch tensors only): big 256.0 MiB, small 4 B"
    )
    assert "big 256.0 MiB" in output.data["text/html"]
    del shell.user_ns["big"], shell.user_ns["view"]
    _result, cap = run_cell_capture(shell, "%gpumem who")
    assert "numpy" not in cap.outputs[0].data["text/plain"]  # under a megabyte: not worth a line


def test_who_for_cpu_memory_names_numpy_arrays_too(shell: Any) -> None:
    np = pytest.importorskip("numpy")
    pytest.importorskip("torch")
    shell.user_ns["table"] = np.ones((1024, 1024), dtype=np.float32)
    _result, cap = run_cell_capture(shell, "%gpumem who --device cpu")
    assert "numpy arrays, host memory not listed here (who names torch tensors only): table 4.0 MiB" in (
        cap.outputs[0].data["text/plain"]
    )
    _result, cap = run_cell_capture(shell, "%gpumem who")
    assert "numpy" not in cap.outputs[0].data["text/plain"]  # the question is CUDA memory
