"""One session format: every writer's file loads, through ``%gpumem load`` in a real IPython shell and through
the Python loader (``read_session``): ``%gpumem export`` (JSON, and Parquet with pyarrow), ``%gpumem history
--json`` (cells only), ``python -m gpumem run --save`` (the real command line) and the Python API
(``capture_session`` + ``write_session``). Files ``run --save`` wrote in its earlier format still load."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _harness import SRC_DIR, gpumem_loaded, run_cell_capture
from gpumem.core.sessions.session_file import SessionData, capture_session, read_session, write_session
from gpumem.ipython import extension as _extension
from gpumem.testing import MIB, FakeSource

CELL = "h = src.allocate(64 * MIB)  # kept"


@pytest.fixture
def shell(ip: Any) -> Iterator[Any]:
    fake = FakeSource(devices=1)
    with gpumem_loaded(ip, fake) as loaded:
        loaded.user_ns.update(src=fake, MIB=MIB)
        assert run_cell_capture(loaded, f"%%gpumem\n{CELL}")[0].success
        yield loaded


def _state() -> Any:
    state = _extension.get_state()
    assert state is not None
    return state


def _loaded(shell: Any, path: Path) -> str:
    """``%gpumem load PATH`` in the shell: one display, its text (it must not be refused)."""
    result, cap = run_cell_capture(shell, f"%gpumem load {path}")
    assert result.success, cap.stderr + cap.stdout
    (output,) = cap.outputs
    assert "<svg" in output.data["text/html"] or "No samples" in output.data["text/plain"]
    text: str = output.data["text/plain"]
    assert text.startswith(f"gpumem session from {path}")
    return text


def test_export_json_loads(shell: Any, tmp_path: Path) -> None:
    target = tmp_path / "session.json"
    assert run_cell_capture(shell, f"%gpumem export {target}")[0].success
    data = read_session(target)
    assert data.cells == list(_state().tracker.history) and data.cells[0].first_line == CELL
    assert data.store is not None and data.run is None
    assert CELL in _loaded(shell, target)


def test_export_parquet_loads(shell: Any, tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    target = tmp_path / "session.json"
    assert run_cell_capture(shell, f"%gpumem export {target} --parquet")[0].success
    from_json = read_session(target)
    for member in ("session.cells.parquet", "session.samples.parquet", "session"):
        data = read_session(tmp_path / member)
        assert data.cells == from_json.cells and data.timeline.times == from_json.timeline.times, member
        assert data.run is None
        assert CELL in _loaded(shell, tmp_path / member)


def test_history_json_loads_as_cells(shell: Any, tmp_path: Path) -> None:
    target = tmp_path / "history.json"
    assert run_cell_capture(shell, f"%gpumem history --json {target}")[0].success
    data = read_session(target)
    assert [cell.first_line for cell in data.cells] == [CELL]
    assert "cells only" in _loaded(shell, target)


def test_the_python_api_writes_what_load_reads(shell: Any, tmp_path: Path) -> None:
    target = tmp_path / "api.json"
    state = _state()
    written = capture_session(state.monitor.timeline, state.tracker.history)
    write_session(written, target)
    data = read_session(target)
    assert data.cells == written.cells and data.timeline.times == written.timeline.times
    assert data.marks == written.marks and data.store == written.store
    assert CELL in _loaded(shell, target)


def _gpumem_run(tmp_path: Path, save: Path, script: str = "x = bytearray(32 << 20)\nprint('ok')\n") -> str:
    path = tmp_path / "train.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": str(SRC_DIR)}
    done = subprocess.run(
        [sys.executable, "-m", "gpumem", "run", "--save", str(save), str(path), "--lr", "0.1"],
        capture_output=True, text=True, timeout=120, env=env, check=False, preexec_fn=lambda: os.umask(0o022),
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr
    return done.stderr


def test_run_save_writes_a_session_that_loads(shell: Any, tmp_path: Path) -> None:
    save = tmp_path / "out" / "run.json"
    said = _gpumem_run(tmp_path, save)
    assert f"session saved to {save} (%gpumem load {save} shows it)" in said
    assert stat.S_IMODE(save.stat().st_mode) == 0o644  # under umask 022, as any new file
    assert json.loads(save.read_text())["gpumem_session"] == 1
    data = read_session(save)
    assert data.run is not None and data.cells == []
    assert data.run["exit_code"] == 0 and data.run["argv"] == ["--lr", "0.1"]
    assert data.run["script"] == str((tmp_path / "train.py").resolve())
    (host,) = data.run["figures"]
    assert host["host_peak_rss_bytes"] >= 32 << 20  # the script's bytearray is in the process's peak
    assert max(data.timeline.values["host/rss"]) > 0 and data.store is not None
    assert data.exported_wall_s is not None and data.wall_offset_s is not None
    text = _loaded(shell, save)
    assert "python -m gpumem run train.py --lr 0.1: exit code 0, " in text
    assert "host/rss: peak " in text


def test_run_save_replaces_its_own_file_and_leaves_another_alone(tmp_path: Path) -> None:
    save = tmp_path / "run.json"
    save.write_text(json.dumps(_earlier_run_file(), indent=1))  # a file of the earlier format: ours, replaced
    assert "session saved to" in _gpumem_run(tmp_path, save)
    assert read_session(save).notes == []  # now of the one format
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    said = _gpumem_run(tmp_path, notes)
    assert f"{notes} exists and is not a gpumem session; it was left as it was" in said
    assert notes.read_text() == '{"mine": 1}'


def _earlier_run_file() -> dict[str, Any]:
    """What ``python -m gpumem run --save`` wrote before there was one format (its keys, in its order)."""
    return {
        "format": "gpumem-session",
        "version": 1,
        "script": "/home/user/train.py",
        "argv": ["--epochs", "1"],
        "exit_code": 0,
        "started_wall_s": 1_764_000_000.0,
        "duration_s": 2.5,
        "figures": [
            {
                "kind": "scope", "label": "session", "path": "session", "wall_time_s": 1_764_000_002.5,
                "duration_s": 2.5, "error": None, "host_rss_bytes": 300 * MIB, "host_peak_rss_bytes": 310 * MIB,
                "host_peak_exact": False, "device": 0, "allocated_bytes": 0, "reserved_bytes": 0,
                "allocated_before_bytes": 0, "reserved_before_bytes": 0, "peak_allocated_bytes": 2048 * MIB,
                "peak_reserved_bytes": 2048 * MIB, "peak_exact": True, "peak_note": "", "used_bytes": None,
                "total_bytes": None,
            }
        ],
        "peak_times_s": {"cuda:0": 1.2},
        "timeline": {
            "times_s": [0.0, 1.0, 2.0],
            "values_bytes": {"cuda:0/allocated": [0, 2048 * MIB, None], "host/rss": [300 * MIB, 310 * MIB, 305 * MIB]},
        },
        "samples": 3,
    }  # fmt: skip


def test_a_run_file_of_the_earlier_format_still_loads(shell: Any, tmp_path: Path) -> None:
    old = tmp_path / "old-run.json"
    old.write_text(json.dumps(_earlier_run_file(), indent=1) + "\n")
    data = read_session(old)
    assert isinstance(data, SessionData) and data.cells == [] and data.marks == []
    assert data.timeline.times == [0.0, 1.0, 2.0]
    assert data.timeline.values["cuda:0/allocated"][:2] == [0.0, 2048.0 * MIB]
    assert data.wall_offset_s == 1_764_000_000.0 and data.exported_wall_s == 1_764_000_002.5
    assert data.run is not None and data.run["argv"] == ["--epochs", "1"] and data.run["samples"] == 3
    text = _loaded(shell, old)
    assert "python -m gpumem run train.py --epochs 1: exit code 0, 2.50 s" in text
    assert "cuda:0: peak allocated 2.0 GiB" in text
    assert "earlier format" in text
