"""A cell being measured: a measured stretch with the cell's source, options and attribution baseline."""

from __future__ import annotations

import time

from gpumem.core.cells.attribution import Attribution
from gpumem.core.cells.record import CellOptions
from gpumem.core.spans import Stretch

__all__ = ["ActiveCell"]


class ActiveCell(Stretch):
    """A cell between :meth:`CellTracker.begin` and :meth:`CellTracker.end` (mutable, private to the tracker)."""

    def __init__(self, source: str, options: CellOptions, execution_count: int | None) -> None:
        super().__init__()
        self.source = source
        self.options = options
        self.execution_count = execution_count
        self.started_wall_s = time.time()
        self.started_perf_s = 0.0
        self.baseline: Attribution | None = None
