"""Per-cell memory accounting: before, after and peak per CUDA device and for the host, kept as history.

Knows nothing of IPython: a caller says when a cell begins and ends (``gpumem.ipython.extension`` does
it from IPython's events), and gets an immutable :class:`CellRecord` back.

Peaks are read from the allocator's own counters, so memory allocated and freed within the cell is
still seen. By default the counters are reset when a cell starts (this also resets what the user's
``torch.cuda.max_memory_allocated()`` returns); with ``keep_peaks`` they are left alone and the peak
is the highest sampled value, a lower bound, unless the counter rose above its earlier value.

The package: ``record`` (the records and options), ``tracker`` (:class:`CellTracker`), ``changes``
(per-device and host figures), ``attribution`` (which variables grew), ``warnings``, ``report``
(text and HTML), ``history`` (the history table and its files), ``measure`` (``gpumem.measure``);
whether a peak is exact is :mod:`gpumem.core.monitoring.peaks`.
"""

from __future__ import annotations

from gpumem.core.cells.attribution import MAX_CHANGED_NAMES, HolderFinder
from gpumem.core.cells.record import (
    STATUS_ERROR,
    STATUS_INTERRUPTED,
    STATUS_OK,
    STATUS_OUT_OF_MEMORY,
    STATUSES,
    CellOptions,
    CellRecord,
    CellWarning,
    DeviceChange,
    HeldVariable,
    HostChange,
    VariableChange,
    classify_error,
    first_line_of,
    source_key,
)
from gpumem.core.cells.tracker import ActiveCell, CellTracker
from gpumem.core.monitoring.peaks import KEPT_PEAK_NOTE, PEAK_RESET_NOTE

__all__ = [
    "KEPT_PEAK_NOTE",
    "MAX_CHANGED_NAMES",
    "PEAK_RESET_NOTE",
    "STATUSES",
    "STATUS_ERROR",
    "STATUS_INTERRUPTED",
    "STATUS_OK",
    "STATUS_OUT_OF_MEMORY",
    "ActiveCell",
    "CellOptions",
    "CellRecord",
    "CellTracker",
    "CellWarning",
    "DeviceChange",
    "HeldVariable",
    "HolderFinder",
    "HostChange",
    "VariableChange",
    "classify_error",
    "first_line_of",
    "source_key",
]
