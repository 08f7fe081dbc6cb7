"""Allocation sites of one cell (``%%gpumem --trace``): PyTorch's allocation history, recorded only
while the cell runs, answered as what was alive at the peak, what the cell left behind and what was
temporary, by site, with the timeline drawn as inline SVG that renders offline.

:mod:`~gpumem.core.trace.history_recorder` touches torch (through ``sys.modules``); everything else is a
pure function of the snapshot dict, so it runs on a stored snapshot with no GPU.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpumem.core.gc_pause import collector_paused
from gpumem.core.trace.analysis import DeviceTrace, SiteUsage, analyse_snapshot
from gpumem.core.trace.history_recorder import (
    DEFAULT_MAX_ENTRIES,
    SKIPPED_ACTIONS,
    CellSnapshot,
    TraceRecorder,
    save_snapshot,
)
from gpumem.core.trace.trace_report import TraceReport

__all__ = [
    "DEFAULT_MAX_ENTRIES",
    "SKIPPED_ACTIONS",
    "CellSnapshot",
    "DeviceTrace",
    "SiteUsage",
    "TraceRecorder",
    "TraceReport",
    "build_report",
    "save_snapshot",
]


def build_report(
    taken: CellSnapshot, *, cell_numbers: Mapping[str, int] | None = None, cell: int | None = None
) -> TraceReport:
    """The report of one traced cell; ``cell_numbers`` maps IPython's cell filenames to their numbers."""
    with collector_paused():  # the snapshot's millions of dicts would be walked again by every full collection
        devices = analyse_snapshot(
            taken.snapshot, first_entry=taken.first_entry, cell_numbers=cell_numbers, truncated=taken.truncated
        )
    notes = []
    if taken.user_recording:
        notes.append("Your own recording of allocation history was on: it is kept, with its settings and entries.")
    for device in taken.truncated:
        if taken.max_entries is not None:
            notes.append(
                f"cuda:{device}: the trace kept only the last {taken.max_entries:,} events; what came before is "
                f'shown as "before the trace began" (raise the limit with --trace-entries)'
            )
        else:
            notes.append(
                f"cuda:{device}: the oldest event your recording kept is from inside the cell: if its max_entries "
                'was reached, earlier events are missing and shown as "before the trace began"'
            )
    return TraceReport(devices, notes, cell)
