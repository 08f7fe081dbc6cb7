"""Where the panels' compact history reads the measured cells from: set by the IPython extension.

A callable, so that this layer never imports the IPython one; no widgets here, so that loading the
extension imports none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpumem.core.cells.record import CellRecord

__all__ = ["cell_records", "set_cell_source"]

_source: Callable[[], Sequence[CellRecord]] | None = None


def set_cell_source(source: Callable[[], Sequence[CellRecord]] | None) -> None:
    """Where the measured cells come from (the extension's tracker), or None once it is gone."""
    global _source
    _source = source


def cell_records() -> tuple[CellRecord, ...]:
    """The measured cells, oldest first (none without a source, or when it fails)."""
    source = _source
    if source is None:
        return ()
    try:
        return tuple(source())
    except Exception:
        return ()
