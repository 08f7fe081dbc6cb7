"""``%%gpumem --trace`` and ``--profile``: the recorders a measured cell may run alongside its figures.

``--trace`` records PyTorch's allocation history while the cell runs and shows where its memory came from
(and saves the raw snapshot with ``--trace-save``); ``--profile`` runs PyTorch's profiler and shows the
operators that allocated most, with their input shapes, and what profiling cost. Both have one shape: the
hooks call ``start_*`` where they begin measuring a cell and ``stop_*`` / ``show_*`` where they finish
(:func:`abandon` at unload, with a cell in flight); nothing here raises into the user's cell. Where a cell
cannot be recorded (no torch imported; for a trace, no CUDA or a torch too old) one line says why and the
cell runs all the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar

from gpumem.core.diagnoses.profile import CellProfiler, ProfileReport
from gpumem.core.gc_pause import collector_paused
from gpumem.core.trace import CellSnapshot, TraceRecorder, build_report, save_snapshot
from gpumem.ipython.arguments import complain, display

__all__ = [
    "LAST_COSTS",
    "TraceRequest",
    "abandon",
    "cell_numbers",
    "show_profile",
    "show_trace",
    "start_profile",
    "start_trace",
    "stop_profile",
    "stop_trace",
]

_T = TypeVar("_T")

# What the last traced cell's own end cost, by phase (seconds; entries and HTML bytes): read by
# benchmarks/bench_trace.py to say which part of --trace's overhead is whose.
LAST_COSTS: dict[str, float] = {}


class TraceRequest(NamedTuple):
    """What ``--trace``, ``--trace-entries`` and ``--trace-save`` asked for."""

    entries: int
    save: str | None


class _Recorder(Protocol):
    def start(self) -> str | None: ...  # None once recording, else why it cannot

    def abandon(self) -> None: ...


_R = TypeVar("_R", bound=_Recorder)


def _started(option: str, without: str, make: Callable[[], _R]) -> _R | None:
    """``make()`` a recorder and start it; None when it cannot (one line says why, the cell runs ``without``)."""
    try:
        recorder = make()
        reason = recorder.start()
    except (Exception, KeyboardInterrupt) as error:
        complain(f"{option} could not start", error)
        return None
    if reason is not None:
        print(f"gpumem: {option}: {reason}; the cell runs without {without}.")
        return None
    return recorder


def _attempted(what: str, call: Callable[[], _T]) -> _T | None:
    """``call()``, or None after one line saying ``what`` failed."""
    try:
        return call()
    except (Exception, KeyboardInterrupt) as error:
        complain(what, error)
        return None


def abandon(recorder: _Recorder | None) -> None:
    """Stop a recorder without reading or showing anything (at unload, with a cell in flight)."""
    if recorder is not None:
        option = "--profile" if isinstance(recorder, CellProfiler) else "--trace"
        _attempted(f"{option} could not stop recording", recorder.abandon)


# --trace --------------------------------------------------------------------------------------------


def start_trace(trace: TraceRequest | None) -> TraceRecorder | None:
    """A recorder already recording, or None (not asked, or it cannot: then one line says why)."""
    if trace is None:
        return None
    # Every action is kept for a saved snapshot: PyTorch's memory_viz reads them all.
    return _started("--trace", "a trace", lambda: TraceRecorder(trace.entries, every_action=trace.save is not None))


def stop_trace(recorder: TraceRecorder | None) -> CellSnapshot | None:
    """Stop recording (restoring the user's own setting); the snapshot, or None."""
    if recorder is None:
        return None
    began = time.perf_counter()
    try:
        taken = recorder.stop()
    except (Exception, KeyboardInterrupt) as error:
        complain("--trace could not read the allocation history", error)
        return None
    LAST_COSTS.clear()
    LAST_COSTS["snapshot_s"] = time.perf_counter() - began
    if taken is not None:
        traces = taken.snapshot.get("device_traces") or ()
        LAST_COSTS["entries"] = sum(
            len(entries) - taken.first_entry.get(device, 0) for device, entries in enumerate(traces)
        )
    return taken


def cell_numbers(shell: Any) -> dict[str, int]:
    """IPython's cell filenames (``/tmp/ipykernel_1/2.py``) -> execution counts, from its compiler."""
    found = getattr(getattr(shell, "compile", None), "_filename_map", None)
    if not isinstance(found, dict):
        return {}
    return {str(name): number for name, number in found.items() if isinstance(number, int)}


def show_trace(
    taken: CellSnapshot | None, trace: TraceRequest | None, shell: Any, cell: int | None, quiet: bool
) -> Any:
    """Save the snapshot if asked, then show the report under the cell (unless ``quiet``); the report shown."""
    if taken is None or trace is None:
        return None
    saved = None
    path = trace.save
    if path:
        saved = _attempted(f"could not save the trace to {path}", lambda: save_snapshot(taken.snapshot, path))
    if quiet:
        return None
    return _attempted("could not show the trace", lambda: _show_trace(taken, shell, cell, saved))


def _show_trace(taken: CellSnapshot, shell: Any, cell: int | None, saved: object) -> Any:
    began = time.perf_counter()
    report = build_report(taken, cell_numbers=cell_numbers(shell), cell=cell)
    if saved is not None:
        report.notes.append(f"Snapshot saved to {saved} (PyTorch's memory_viz opens it).")
    analysed = time.perf_counter()
    with collector_paused():
        text, page = repr(report), report._repr_html_()
    LAST_COSTS.update(analysis_s=analysed - began, render_s=time.perf_counter() - analysed)
    LAST_COSTS["html_bytes"] = len(page.encode())
    display(text=text, html=page)
    return report


# --profile ------------------------------------------------------------------------------------------


def start_profile(asked: bool) -> CellProfiler | None:
    """A profiler already recording, or None (not asked, or it cannot: then one line says why)."""
    return _started("--profile", "a profile", CellProfiler) if asked else None


def stop_profile(profiler: CellProfiler | None, cell: int | None) -> ProfileReport | None:
    """Stop profiling and group the operators; the report, or None."""
    if profiler is None:
        return None
    return _attempted("--profile could not read the profiler's events", lambda: profiler.stop(cell))


def show_profile(report: ProfileReport | None, quiet: bool) -> ProfileReport | None:
    """The table under the cell, unless ``quiet``; the report shown."""
    if report is None or quiet:
        return None
    return _attempted("could not show the profile", lambda: _displayed(report))


def _displayed(report: _T) -> _T:
    display(report)
    return report
