"""Writing a file aside and renaming it over the target: what is kept when writing fails."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

import pytest

from gpumem.core.atomic_files import ForeignFileError, NotARegularFileError, replace_file, write_file
from gpumem.core.cells.history import write_csv, write_json
from gpumem.core.sampling.timeline import Timeline
from gpumem.core.scripts.metric_writers import CsvWriter
from gpumem.core.sessions.session_file import capture_session, write_parquet, write_session
from gpumem.core.trace.history_recorder import save_snapshot


def ours(start: bytes) -> bool:
    return start.startswith(b"ours")


def test_an_interrupted_write_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "data.txt"
    target.write_text("ours: old\n")

    def interrupted(handle: TextIO) -> None:
        handle.write("ours: half of the new")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replace_file(target, interrupted, recognise=ours)
    assert target.read_text() == "ours: old\n"
    assert [path.name for path in tmp_path.iterdir()] == ["data.txt"]


def test_a_new_file_a_replaced_file_and_a_foreign_one(tmp_path: Path) -> None:
    target = tmp_path / "data.txt"
    assert replace_file(target, lambda handle: handle.write("ours: 1\n"), recognise=ours) is False
    assert replace_file(target, lambda handle: handle.write("ours: 2\n"), recognise=ours) is True
    assert target.read_text() == "ours: 2\n"
    target.write_text("someone's notes\n")
    with pytest.raises(ForeignFileError):
        replace_file(target, lambda handle: handle.write("ours: 3\n"), recognise=ours)
    assert target.read_text() == "someone's notes\n"
    assert replace_file(target, lambda handle: handle.write("ours: 4\n"), recognise=ours, force=True) is True
    assert target.read_text() == "ours: 4\n"


def test_the_longest_name_a_file_can_have_still_gets_a_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / ("é" * 127)  # 254 bytes in UTF-8
    replace_file(target, lambda handle: handle.write("ours\n"), recognise=ours)
    assert target.read_text() == "ours\n"


def test_a_lone_surrogate_is_written_as_its_escape(tmp_path: Path) -> None:
    target = tmp_path / "data.txt"
    replace_file(target, lambda handle: handle.write("ours \ud800 é\n"), recognise=ours)
    assert target.read_bytes().decode("utf-8") == "ours \\ud800 é\n"


def test_a_folder_or_a_device_is_never_replaced(tmp_path: Path) -> None:
    with pytest.raises(NotARegularFileError, match="is a folder"):
        replace_file(tmp_path, lambda handle: handle.write("x"), recognise=ours, force=True)
    with pytest.raises(NotARegularFileError, match="is not a regular file"):
        replace_file("/dev/null", lambda handle: handle.write("x"), recognise=ours, force=True)
    assert Path("/dev/null").is_char_device()


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.usefixtures("umask_022")
def test_every_file_gpumem_writes_whole_gets_the_mode_of_any_new_file(tmp_path: Path) -> None:
    """0666 less the umask, as open() gives (0644 here), not mkstemp's 0600; a replaced file keeps its mode."""
    writers: dict[str, Callable[[Path], object]] = {
        "session.json": lambda path: write_session(capture_session(Timeline(), []), path),
        "history.json": lambda path: write_json([], path),
        "history.csv": lambda path: write_csv([], path),
        "snapshot.pickle": lambda path: save_snapshot({"segments": []}, path),
        "any.bin": lambda path: write_file(path, lambda handle: handle.write(b"\0"), binary=True),
    }
    for name, write in writers.items():
        write(tmp_path / name)
    metrics = CsvWriter(tmp_path / "metrics.csv")
    metrics.write(1, {"a": 1.0})
    metrics.write(2, {"a": 1.0, "b": 2.0})  # a wider header: the file is rewritten aside
    assert (tmp_path / "metrics.csv").read_text().startswith("step,wall_time_s,a,b\n")
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in tmp_path.iterdir()}
    assert modes == dict.fromkeys([*writers, "metrics.csv"], 0o644)
    (tmp_path / "session.json").chmod(0o600)
    write_session(capture_session(Timeline(), []), tmp_path / "session.json")
    assert stat.S_IMODE((tmp_path / "session.json").stat().st_mode) == 0o600


@pytest.mark.usefixtures("umask_022")
def test_parquet_files_get_the_mode_of_any_new_file(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    written = write_parquet(capture_session(Timeline(), []), tmp_path / "run")
    assert {stat.S_IMODE(path.stat().st_mode) for path in written} == {0o644}
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(path.name for path in written)
