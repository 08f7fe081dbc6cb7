"""Nothing lost: exports that fail keep the old file, one bad setting is refused alone, settings made
at run time survive a reload, bad paths are one line, and tracebacks show the user's own header line.

Magics run in the real in-process IPython shell; the CUDA side is a fake allocator with one device.
"""

from __future__ import annotations

import csv
import json
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from traitlets.config import Config, PyFileConfigLoader

from _harness import gpumem_loaded, run_cell_capture
from gpumem.core.cells import history as history_module
from gpumem.core.monitoring.monitor import Monitor, set_default_monitor
from gpumem.ipython import extension as _extension
from gpumem.testing import MIB, FakeSource


@pytest.fixture
def fake() -> FakeSource:
    return FakeSource(devices=1)


@pytest.fixture
def shell(ip: Any, fake: FakeSource) -> Iterator[Any]:
    with gpumem_loaded(ip, fake) as loaded:
        loaded.user_ns.update(src=fake, MIB=MIB)
        yield loaded


def settings() -> Any:
    state = _extension.get_state()
    assert state is not None
    return state.config


def usage_error(shell: Any, cell: str) -> str:
    """Run ``cell``; it must fail with a UsageError shown as one line. Returns that line.

    The cell is not stored in IPython's history: its SQLite database cannot hold a lone surrogate.
    """
    with capture_output() as cap:
        result = shell.run_cell(cell, store_history=False)
    assert isinstance(result.error_in_exec, UsageError), (cell, result.error_in_exec)
    shown = (cap.stderr + cap.stdout).strip()
    assert "Traceback" not in shown and len(shown.splitlines()) == 1, shown
    return shown


def said(shell: Any, cell: str) -> str:
    result, cap = run_cell_capture(shell, cell)
    assert result.success, (cell, result.error_in_exec, cap.stderr)
    return cap.stdout.strip()


def two_cells(shell: Any) -> None:
    run_cell_capture(shell, "%%gpumem -q\nh = src.allocate(MIB)")
    run_cell_capture(shell, "%%gpumem -q\nx = 1")


# A failing export keeps the previous file ---------------------------------------------------------


class _DiskFull:
    """A value whose text cannot be written: the write fails part-way, as on a full disk."""

    def __str__(self) -> str:
        raise OSError(28, "No space left on device")


def test_a_csv_export_that_fails_part_way_keeps_the_previous_file(
    shell: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    two_cells(shell)
    target = tmp_path / "cells.csv"
    assert said(shell, f"%gpumem history --csv {target}") == f"wrote 2 cells to {target}"
    before = target.read_bytes()
    run_cell_capture(shell, "%%gpumem -q\ny = 2")
    rows = history_module.history_rows

    def failing_rows(records: Any) -> list[dict[str, Any]]:
        made = rows(records)
        made[0]["first_line"] = _DiskFull()
        return made

    monkeypatch.setattr(history_module, "history_rows", failing_rows)
    message = usage_error(shell, f"%gpumem history --csv {target}")
    assert message == f"UsageError: %gpumem history: cannot write CSV to '{target}': No space left on device"
    assert target.read_bytes() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cells.csv"]  # no temporary file left


def test_a_json_export_that_fails_part_way_keeps_the_previous_file(
    shell: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    two_cells(shell)
    target = tmp_path / "cells.json"
    said(shell, f"%gpumem history --json {target}")
    before = target.read_bytes()
    convert = history_module.record_to_dict

    def failing(record: Any) -> dict[str, Any]:
        if record.serial == 2:  # the second cell
            raise OSError(28, "No space left on device")
        return convert(record)

    monkeypatch.setattr(history_module, "record_to_dict", failing)
    assert "cannot write JSON" in usage_error(shell, f"%gpumem history --json {target}")
    assert target.read_bytes() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cells.json"]


def test_a_cell_with_a_lone_surrogate_exports_as_valid_utf8(shell: Any, tmp_path: Path) -> None:
    said(shell, "%gpumem auto on")
    # Not in IPython's history database (SQLite cannot store a lone surrogate); Python cannot compile the
    # cell either, but gpumem's history keeps it, as every measured cell.
    result = shell.run_cell("x = 1  # \ud800", store_history=False)
    assert isinstance(result.error_in_exec, UnicodeEncodeError)
    assert settings() is not None and _extension.get_state().tracker.history[-1].first_line == "x = 1  # \ud800"
    csv_path, json_path = tmp_path / "cells.csv", tmp_path / "cells.json"
    out = said(shell, f"%gpumem history --csv {csv_path} --json {json_path}")
    assert out == f"wrote 1 cell to {csv_path}\nwrote 1 cell to {json_path}"
    text = csv_path.read_bytes().decode("utf-8")  # strict: valid UTF-8
    (row,) = csv.DictReader(text.splitlines())
    assert row["first_line"] == "x = 1  # \\ud800"  # the backslash escape of the unencodable character
    data = json.loads(json_path.read_bytes().decode("ascii"))
    assert data["gpumem_history"] == 1 and data["cells"][0]["first_line"] == "x = 1  # \ud800"  # round trip


def test_replacing_an_export_says_so_and_keeps_the_files_mode(shell: Any, tmp_path: Path) -> None:
    two_cells(shell)
    target = tmp_path / "cells.csv"
    said(shell, f"%gpumem history --csv {target}")
    target.chmod(0o640)
    assert said(shell, f"%gpumem history --csv {target}") == f"replaced {target} with 2 cells"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    run_cell_capture(shell, "%%gpumem -q\ny = 2")
    said(shell, f"%gpumem history --csv {link}")
    assert link.is_symlink() and target.read_text().count("\n") == 4  # the link's target, header and 3 cells


@pytest.mark.parametrize(
    ("option", "foreign"),
    [("--csv", "name,notes\nAda,1815\n"), ("--json", '{"notes": [1815]}\n'), ("--csv", '{"gpumem_history": 1}')],
)
def test_a_file_that_is_not_an_export_is_replaced_only_with_force(
    shell: Any, tmp_path: Path, option: str, foreign: str
) -> None:
    two_cells(shell)
    target = tmp_path / "notes.txt"
    target.write_text(foreign)
    message = usage_error(shell, f"%gpumem history {option} {target}")
    kind = option[2:].upper()
    assert message == (
        f"UsageError: %gpumem history: {target} exists and is not a gpumem {kind} export; "
        "it was left as it was (--force replaces it)"
    )
    assert target.read_text() == foreign
    assert said(shell, f"%gpumem history {option} {target} --force") == f"replaced {target} with 2 cells"
    assert said(shell, f"%gpumem history {option} {target}") == f"replaced {target} with 2 cells"  # ours now


def test_an_empty_file_is_replaced_without_force(shell: Any, tmp_path: Path) -> None:
    two_cells(shell)
    target = tmp_path / "cells.csv"
    target.touch()
    assert said(shell, f"%gpumem history --csv {target}") == f"replaced {target} with 2 cells"


def test_the_export_checks_recognise_exactly_our_files() -> None:
    header = ",".join(history_module.history_columns(())).encode()
    assert history_module.is_csv_export(header + b"\r\n1,2\r\n")
    two_devices = ",".join(history_module._columns_for([0, 3])).encode()
    assert history_module.is_csv_export(two_devices + b"\r\n")
    assert not history_module.is_csv_export(header.replace(b"cell,", b"cells,") + b"\r\n")
    assert not history_module.is_csv_export(header + b",extra\r\n")
    assert not history_module.is_csv_export(b"cell,execution_count\n")
    assert history_module.is_json_export(b'{\n "gpumem_history": 1,\n "cells": []}')
    assert not history_module.is_json_export(b'[{"serial": 1}]')
    assert not history_module.is_json_export(b'{"notes": {"gpumem_history": 1}}')


# Paths no file can have: one line each --------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("~nosuchuser_gpumem/x.csv", "--csv '~nosuchuser_gpumem/x.csv': cannot find the home directory of"),
        ('"a\x00b.csv"', "a path cannot contain a NUL character"),
        ('""', "--csv expects a file path, not ''"),
        ("\ud800.csv", "the file system cannot store this name"),
        (".", "cannot write CSV to '.': is a folder"),
        ("/dev/null", "cannot write CSV to '/dev/null': is not a regular file"),
    ],
)
def test_a_path_no_file_can_have_is_one_line(
    shell: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str, expected: str
) -> None:
    monkeypatch.chdir(tmp_path)
    assert expected in usage_error(shell, f"%gpumem history --csv {path}")
    assert list(tmp_path.iterdir()) == []


# One bad setting is refused alone ---------------------------------------------------------------------


def test_a_bad_config_value_is_refused_alone(ip: Any, fake: FakeSource, capsys: pytest.CaptureFixture[str]) -> None:
    ip.config.GpuMem.threshold = "abc"
    ip.config.GpuMem.top_variables = 3
    set_default_monitor(Monitor(fake))
    try:
        assert ip.run_cell("%load_ext gpumem").success
        err = capsys.readouterr().err.strip()
        assert err == (
            "gpumem: ignoring GpuMem.threshold = 'abc' (the other settings apply): TraitError: threshold: "
            "expected a size such as 512MiB or a share of the device's capacity such as 80%, not 'abc'"
        )
        assert settings().top_variables == 3 and settings().threshold.nbytes == 64 * MIB
        assert ip.run_cell("%reload_ext gpumem").success
        assert capsys.readouterr().err == ""  # said once
        assert settings().top_variables == 3
    finally:
        ip.run_cell("%unload_ext gpumem")
        set_default_monitor(None)


def test_a_bad_value_in_a_config_file_is_refused_alone(
    ip: Any, fake: FakeSource, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "ipython_config.py").write_text(
        "c.GpuMem.threshold = 'abc'\nc.GpuMem.auto = True\nc.GpuMem.leak_runs = 1\nc.GpuMem.vars = 'never'\n"
    )
    loaded = PyFileConfigLoader("ipython_config.py", path=str(tmp_path)).load_config()
    assert isinstance(loaded, Config)
    ip.config.merge(loaded)
    set_default_monitor(Monitor(fake))
    try:
        assert ip.run_cell("%load_ext gpumem").success
        lines = capsys.readouterr().err.strip().splitlines()
        assert [line.split(" = ")[0] for line in lines] == [
            "gpumem: ignoring GpuMem.threshold",
            "gpumem: ignoring GpuMem.leak_runs",
        ]
        assert settings().auto and settings().vars == "never"
        assert settings().threshold.nbytes == 64 * MIB and settings().leak_runs == 3
    finally:
        ip.run_cell("%unload_ext gpumem")
        set_default_monitor(None)


def test_a_bad_config_magic_is_one_line_and_a_reload_keeps_the_rest(
    shell: Any, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    said(shell, "%config GpuMem.top_variables = 2")
    capsys.readouterr()
    _result, cap = run_cell_capture(shell, "%config GpuMem.threshold = 'abc'")
    assert cap.stdout + cap.stderr == ""  # IPython's %config logs the refusal, one record:
    (record,) = caplog.records
    assert "threshold: expected a size such as 512MiB or a share of the device's capacity" in record.getMessage()
    assert len(record.getMessage().splitlines()) == 1 and record.exc_info is None
    assert settings().threshold.nbytes == 64 * MIB and settings().top_variables == 2
    assert shell.run_cell("%reload_ext gpumem").success
    assert "ignoring GpuMem.threshold = 'abc' (the other settings apply)" in capsys.readouterr().err
    assert settings().top_variables == 2


# Settings made at run time survive a reload -----------------------------------------------------------


def test_a_reload_keeps_the_settings_made_at_run_time(shell: Any) -> None:
    said(shell, "%gpumem auto on --threshold 1MiB --vars always --keep-peaks")
    said(shell, "%config GpuMem.top_variables = 2")
    run_cell_capture(shell, "h = src.allocate(MIB)")
    for _ in range(2):
        assert shell.run_cell("%reload_ext gpumem").success
        config = settings()
        assert (config.auto, config.threshold.nbytes, config.vars, config.keep_peaks) == (True, MIB, "always", True)
        assert config.top_variables == 2
    _result, cap = run_cell_capture(shell, "g = src.allocate(2 * MIB)")  # automatic mode really is on
    assert [output.data["text/plain"][:8] for output in cap.outputs] == ["gpumem ["]
    assert shell.run_cell("%unload_ext gpumem").success
    assert shell.run_cell("%load_ext gpumem").success
    assert settings().auto and settings().threshold.nbytes == MIB


# Tracebacks show the user's own header line ---------------------------------------------------------


def traceback_of(shell: Any, cell: str) -> str:
    result, cap = run_cell_capture(shell, cell)
    assert result.error_in_exec is not None
    return cap.stdout + cap.stderr


def test_a_traceback_shows_the_users_header_line(shell: Any) -> None:
    shown = traceback_of(shell, "%%gpumem   -q\n1 / 0\nnever = 1")
    assert "Cell In[1], line 2\n      1 %%gpumem   -q\n----> 2 1 / 0\n" in shown
    assert "run_line_magic" not in shown
    assert "never" not in shell.user_ns


def test_a_function_defined_under_a_header_shows_it_when_called_later(shell: Any) -> None:
    said(shell, "%%gpumem -q\ndef divide(x):\n    return x / 0")
    shown = traceback_of(shell, "divide(1)")
    assert "      1 %%gpumem -q\n      2 def divide(x):\n----> 3     return x / 0" in shown
    assert "run_line_magic" not in shown


def test_time_above_or_below_a_header_still_measures(shell: Any) -> None:
    state = _extension.get_state()
    assert state is not None
    for cell in ("%%time\n%%gpumem -q\nh = src.allocate(MIB)", "%%gpumem -q\n%%time\ng = src.allocate(MIB)"):
        assert run_cell_capture(shell, cell)[0].success
        assert state.tracker.history[-1].devices[0].allocated_delta_bytes == MIB
    shown = traceback_of(shell, "%%time\n%%gpumem -q\nx = 1\n1 / 0")
    assert "ZeroDivisionError" in shown and "gpumem/" not in shown
    assert state.tracker.history[-1].status.startswith("error")
