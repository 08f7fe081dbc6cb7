"""A cell being measured: what was read at its start, and the highest values sampled since."""

from __future__ import annotations

import threading
import time

from gpumem.core.cells.attribution import Attribution
from gpumem.core.cells.record import CellOptions
from gpumem.core.sources import Snapshot

__all__ = ["ActiveCell"]


class ActiveCell:
    """A cell between :meth:`CellTracker.begin` and :meth:`CellTracker.end` (mutable, private to the tracker)."""

    def __init__(self, source: str, options: CellOptions, execution_count: int | None) -> None:
        self.source = source
        self.options = options
        self.execution_count = execution_count
        self.started_wall_s = time.time()
        self.started_perf_s = 0.0
        self.start: Snapshot | None = None
        self.reset_devices: frozenset[int] = frozenset()
        self.resets_at_start: dict[int | None, int] = {}
        self.baseline: Attribution | None = None
        self.sampled_allocated: dict[int, int] = {}
        self.sampled_reserved: dict[int, int] = {}
        self.sampled_rss = 0
        self.finished = False
        self._lock = threading.Lock()

    def take_sample(self, snapshot: Snapshot) -> None:
        """Fold one sample into the running maxima (called from the sampler thread and the main thread)."""
        with self._lock:
            for reading in snapshot.allocator:
                if reading.allocated_bytes > self.sampled_allocated.get(reading.device, -1):
                    self.sampled_allocated[reading.device] = reading.allocated_bytes
                if reading.reserved_bytes > self.sampled_reserved.get(reading.device, -1):
                    self.sampled_reserved[reading.device] = reading.reserved_bytes
            if snapshot.host is not None and snapshot.host.rss_bytes > self.sampled_rss:
                self.sampled_rss = snapshot.host.rss_bytes
