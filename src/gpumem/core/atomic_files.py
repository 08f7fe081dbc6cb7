"""Writing a file so that a failure part-way never costs the previous one: write aside, then rename.

The new content goes to a temporary file in the target's own folder (a rename across file systems
is not atomic), is flushed to disk, and only then takes the target's place with ``os.replace``. If
anything fails before that, the old file is untouched and the temporary file is removed. A new file
gets the mode any other new file gets (0666 less the umask, as ``open()`` gives); a replaced one keeps
its own. A target that exists but is not recognised as a file of ours is refused unless forced, so a
mistyped path cannot overwrite someone's notes. Every file gpumem writes whole goes through here:
exports, the session of ``python -m gpumem run --save``, a widened metrics CSV, a ``--trace-save`` snapshot.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TextIO

__all__ = ["ForeignFileError", "NotARegularFileError", "replace_file", "write_file"]

# How much of an existing file is read to recognise it (its first line, or a JSON marker near the start).
_RECOGNISE_BYTES = 64 * 1024
_NAME_KEPT = 50  # characters of the target's name in the temporary file's (UTF-8: 200 bytes at most)


class ForeignFileError(FileExistsError):
    """The target exists and does not look like a file this writer made: it was left as it was."""


class NotARegularFileError(OSError):
    """The target is a folder, a device or a pipe: replacing it with a file would be wrong."""


def replace_file(
    path: str | os.PathLike[str],
    write: Callable[[TextIO], None],
    *,
    recognise: Callable[[bytes], bool],
    force: bool = False,
    newline: str | None = None,
) -> bool:
    """Write ``path`` with ``write(handle)`` (UTF-8 text) atomically; True when an existing file was replaced.

    ``recognise(start)`` gets the first bytes of an existing file and says whether it may be replaced
    (an empty file always may: nothing in it can be lost). Characters UTF-8 cannot encode (lone
    surrogates) are written as backslash escapes, so the file stays valid UTF-8. A symbolic link is
    followed: its target is replaced, the link stays.
    """
    target = Path(os.path.realpath(os.fspath(path)))
    existing = _existing(target)
    if existing is not None and existing.st_size and not force and not recognise(_start_of(target)):
        raise ForeignFileError(errno.EEXIST, "exists and is not a file gpumem wrote", str(path))
    _write_aside(target, existing, write, binary=False, newline=newline)
    return existing is not None


def write_file(path: str | os.PathLike[str], write: Callable[[IO[Any]], object], *, binary: bool = False) -> bool:
    """Write ``path`` with ``write(handle)`` atomically, whatever file was there (a folder is refused);
    True when one was replaced. ``binary``: the handle takes bytes; otherwise UTF-8 text, lines as written."""
    target = Path(os.path.realpath(os.fspath(path)))
    existing = _existing(target)
    _write_aside(target, existing, write, binary=binary, newline="")
    return existing is not None


def _write_aside(
    target: Path,
    existing: os.stat_result | None,
    write: Callable[[Any], object],
    *,
    binary: bool,
    newline: str | None,
) -> None:
    """The temporary file, written, flushed to disk and renamed over ``target`` (removed on any failure)."""
    # Hidden, unique, and short enough for any name the target itself may have (255 bytes at most).
    temporary = target.with_name(f".{target.name[:_NAME_KEPT]}.{secrets.token_hex(4)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        handle = (
            os.fdopen(descriptor, "wb")
            if binary
            else os.fdopen(descriptor, "w", encoding="utf-8", errors="backslashreplace", newline=newline)
        )
        with handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        if existing is not None:
            temporary.chmod(stat.S_IMODE(existing.st_mode))
        temporary.replace(target)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    _sync_folder(target.parent)


def _existing(target: Path) -> os.stat_result | None:
    """The target's status if it exists; a folder, device or pipe is refused outright."""
    try:
        status = target.stat()
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(status.st_mode):
        kind = "a folder" if stat.S_ISDIR(status.st_mode) else "not a regular file"
        raise NotARegularFileError(errno.EISDIR if kind == "a folder" else errno.EINVAL, f"is {kind}", str(target))
    return status


def _start_of(target: Path) -> bytes:
    with target.open("rb") as handle:
        return handle.read(_RECOGNISE_BYTES)


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable (POSIX); where folders cannot be opened this is skipped."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    with contextlib.suppress(OSError):
        descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
