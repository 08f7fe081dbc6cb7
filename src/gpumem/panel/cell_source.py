"""What the panels read of the IPython extension's work: the measured cells, the last out-of-memory explanation.

A callable, so that this layer never imports the IPython one; no widgets here, so that loading the
extension imports none.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpumem.core.cells.record import CellRecord

__all__ = ["cell_records", "last_oom", "note_oom", "set_cell_source"]

_source: Callable[[], Sequence[CellRecord]] | None = None
_last_oom: tuple[int, Any] | None = None  # (a number per explanation, the OomReport)


def set_cell_source(source: Callable[[], Sequence[CellRecord]] | None) -> None:
    """Where the measured cells come from (the extension's tracker), or None once it is gone."""
    global _source
    _source = source


_oom_numbers = itertools.count(1)


def note_oom(report: Any) -> None:
    """The newest out-of-memory explanation (a :class:`gpumem.core.diagnoses.oom.OomReport`), for the panels; None
    forgets it (the extension unloads)."""
    global _last_oom
    _last_oom = None if report is None else (next(_oom_numbers), report)


def last_oom() -> tuple[int, Any] | None:
    """``(number, report)`` of the newest out-of-memory explanation, or None."""
    return _last_oom


def cell_records() -> tuple[CellRecord, ...]:
    """The measured cells, oldest first (none without a source, or when it fails)."""
    source = _source
    if source is None:
        return ()
    try:
        return tuple(source())
    except Exception:
        return ()
