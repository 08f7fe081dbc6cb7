"""Allocation sites: which frame of a recorded stack is the user's, and how to name it.

PyTorch records each allocation's Python stack innermost first. The site of an allocation is its
innermost frame in the user's own code (a notebook cell or a file outside the installed packages),
so that ``torch.empty`` inside ``make()`` in cell 3 is charged to that line of cell 3, not to
torch. Library frames are folded: kept in the stack a site expands to, never its name.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["NO_STACK", "Frame", "Site", "SiteNamer"]

# IPython's cell filenames: ipykernel's '/tmp/ipykernel_123/456.py', the terminal's '<ipython-input-3-...>'.
_IPYTHON_INPUT = re.compile(r"<ipython-input-(\d+)-[0-9a-f]+>")
_TIMED_BODIES = ("<timed exec>", "<timed eval>")  # the filenames IPython's %%time compiles a body under
_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/", "\\site-packages\\", "\\dist-packages\\")


@dataclass(frozen=True)
class Frame:
    """One recorded frame, named as a person reads it (``cell [3] line 4`` for a notebook cell)."""

    filename: str
    line: int
    function: str
    where: str  # 'cell [3] line 4' or 'path/to/file.py:12'
    user: bool


@dataclass(frozen=True)
class Site:
    """Where an allocation came from: its innermost frame in user code (or, lacking one, its innermost)."""

    key: tuple[str, int, str]
    label: str  # 'cell [3] line 4 in make'
    user: bool
    via: str  # the innermost library call below the user's frame, e.g. 'torch/nn/functional.py:1676 linear'


NO_STACK = Site(("", 0, ""), "(no stack recorded)", user=False, via="")


def _library_prefixes() -> tuple[str, ...]:
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, getattr(sys, "base_exec_prefix", sys.prefix)}
    return tuple(sorted(f"{prefix.rstrip('/')}/lib" for prefix in prefixes if prefix))


class SiteNamer:
    """Names frames and picks sites; ``cell_numbers`` maps IPython's cell filenames to execution counts."""

    def __init__(self, cell_numbers: Mapping[str, int] | None = None) -> None:
        self.cell_numbers = dict(cell_numbers or {})
        self._prefixes = _library_prefixes()
        self._files: dict[str, tuple[str, bool, int | None]] = {}
        self._sites: dict[tuple[Any, ...], Site] = {}
        self._user_files = _UserFiles(self)

    def _file(self, filename: str) -> tuple[str, bool, int | None]:
        """``(short name, is user code, cell number or None)`` for a filename, cached."""
        known = self._files.get(filename)
        if known is not None:
            return known
        cell = self.cell_numbers.get(filename)
        if cell is None:
            match = _IPYTHON_INPUT.fullmatch(filename)
            cell = int(match.group(1)) if match else None
        if cell is not None:
            known = (f"cell [{cell}]", True, cell)
        elif filename in _TIMED_BODIES:  # a cell body run by %%time: the user's code, numbered from its own line 1
            known = ("%%time body", True, 0)
        elif filename.startswith(("<", *self._prefixes)) or any(marker in filename for marker in _LIBRARY_MARKERS):
            known = (_short_library_name(filename), False, None)
        else:
            known = (filename, True, None)
        self._files[filename] = known
        return known

    def frame(self, raw: Mapping[str, Any]) -> Frame:
        filename = str(raw.get("filename", "?"))
        line = int(raw.get("line", 0) or 0)
        function = str(raw.get("name", "?"))
        short, user, cell = self._file(filename)
        where = f"{short} line {line}" if cell is not None else f"{short}:{line}"
        return Frame(filename, line, function, where, user)

    def frames(self, raw_frames: Sequence[Mapping[str, Any]]) -> list[Frame]:
        return [self.frame(raw) for raw in raw_frames]

    def site(self, raw_frames: Sequence[Mapping[str, Any]]) -> Site:
        """The site of one allocation, from its frames (innermost first)."""
        return self.site_and_depth(raw_frames)[0]

    def site_and_depth(self, raw_frames: Sequence[Mapping[str, Any]]) -> tuple[Site, int | None]:
        """The site, and how many innermost frames decide it: through the innermost user frame (None: no
        frame is the user's, so every frame counts). Equal frames that many deep give the same site."""
        if not raw_frames:
            return NO_STACK, 0
        user_files = self._user_files
        below: Mapping[str, Any] | None = None
        decided: int | None = None
        for depth, raw in enumerate(raw_frames, 1):  # ~20 frames: one lookup per frame
            filename = raw.get("filename", "?")
            if user_files[filename]:
                chosen, decided = raw, depth
                break
            below = raw
        else:
            chosen, below = raw_frames[0], None
            filename = chosen.get("filename", "?")
        # The key determines the Site (it is made from these fields with these defaults).
        if below is None:
            cache_key: tuple[Any, ...] = (filename, chosen.get("line"), chosen.get("name"))
        else:
            cache_key = (filename, chosen.get("line"), chosen.get("name"),
                         below.get("filename", "?"), below.get("line"), below.get("name"))  # fmt: skip
        cached = self._sites.get(cache_key)
        if cached is None:
            cached = self._sites[cache_key] = self._new_site(chosen, below)
        return cached, decided

    def _new_site(self, chosen: Mapping[str, Any], below: Mapping[str, Any] | None) -> Site:
        frame = self.frame(chosen)
        via = ""
        if below is not None:
            inner = self.frame(below)
            via = f"{inner.where} {inner.function}"
        key = (frame.filename, frame.line, frame.function)
        return Site(key, f"{frame.where} in {frame.function}", user=frame.user, via=via)


class _UserFiles(dict[Any, bool]):
    """``{filename: is user code}``, filled on first sight (one lookup per frame, no ``None`` check)."""

    def __init__(self, namer: SiteNamer) -> None:
        super().__init__()
        self._namer = namer

    def __missing__(self, filename: Any) -> bool:
        user = self[filename] = self._namer._file(str(filename))[1]  # noqa: SLF001 - the namer's own cache
        return user


def _short_library_name(filename: str) -> str:
    """'/usr/lib/python3.11/site-packages/torch/nn/functional.py' -> 'torch/nn/functional.py'."""
    for marker in ("site-packages", "dist-packages"):
        position = filename.rfind(marker)
        if position >= 0:
            return filename[position + len(marker) + 1 :]
    for prefix in _library_prefixes():
        if filename.startswith(prefix):
            rest = filename[len(prefix) :].lstrip("/")
            return rest.split("/", 1)[1] if rest.startswith("python") and "/" in rest else rest
    return filename
