"""Writing a file aside and renaming it over the target: what is kept when writing fails."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

import pytest

from gpumem.core.files import ForeignFileError, NotARegularFileError, replace_file


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
