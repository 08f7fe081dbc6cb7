"""``%%gpumem --trace``: start PyTorch's allocation history as the cell starts, and after it show
where its memory came from (and save the raw snapshot with ``--trace-save``).

The hooks call :func:`start` where they begin measuring a cell and :func:`stop` / :func:`show`
where they finish; nothing here raises into the user's cell. Where the cell cannot be traced (no
torch imported, no CUDA, a torch too old) one line says why and the cell runs all the same.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from gpumem.core.collector import collector_paused
from gpumem.core.trace import CellSnapshot, TraceRecorder, build_report, save_snapshot
from gpumem.ipython.arguments import complain, display

__all__ = ["LAST_COSTS", "TraceRequest", "abandon", "cell_numbers", "show", "start", "stop"]

# What the last traced cell's own end cost, by phase (seconds; entries and HTML bytes): read by
# benchmarks/bench_trace.py to say which part of --trace's overhead is whose.
LAST_COSTS: dict[str, float] = {}


class TraceRequest(NamedTuple):
    """What ``--trace``, ``--trace-entries`` and ``--trace-save`` asked for."""

    entries: int
    save: str | None


def start(trace: TraceRequest | None) -> TraceRecorder | None:
    """A recorder already recording, or None (not asked, or it cannot: then one line says why)."""
    if trace is None:
        return None
    try:
        recorder = TraceRecorder(trace.entries, every_action=trace.save is not None)  # memory_viz reads them all
        reason = recorder.start()
    except (Exception, KeyboardInterrupt) as error:
        complain("--trace could not start", error)
        return None
    if reason is not None:
        print(f"gpumem: --trace: {reason}; the cell runs without a trace.")
        return None
    return recorder


def stop(recorder: TraceRecorder | None) -> CellSnapshot | None:
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


def abandon(recorder: TraceRecorder | None) -> None:
    """Stop recording without reading the history (at unload, with a cell in flight)."""
    if recorder is None:
        return
    try:
        recorder.abandon()
    except (Exception, KeyboardInterrupt) as error:
        complain("--trace could not stop recording", error)


def cell_numbers(shell: Any) -> dict[str, int]:
    """IPython's cell filenames (``/tmp/ipykernel_1/2.py``) -> execution counts, from its compiler."""
    found = getattr(getattr(shell, "compile", None), "_filename_map", None)
    if not isinstance(found, dict):
        return {}
    return {str(name): number for name, number in found.items() if isinstance(number, int)}


def show(taken: CellSnapshot | None, trace: TraceRequest | None, shell: Any, cell: int | None, quiet: bool) -> Any:
    """Save the snapshot if asked, then show the report under the cell (unless ``quiet``); the report shown."""
    if taken is None or trace is None:
        return None
    saved = None
    if trace.save:
        try:
            saved = save_snapshot(taken.snapshot, trace.save)
        except (Exception, KeyboardInterrupt) as error:
            complain(f"could not save the trace to {trace.save}", error)
    if quiet:
        return None
    try:
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
    except (Exception, KeyboardInterrupt) as error:
        complain("could not show the trace", error)
        return None
    return report
