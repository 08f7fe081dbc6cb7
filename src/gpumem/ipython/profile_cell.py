"""``%%gpumem --profile``: start PyTorch's profiler as the cell starts, and after it show the
operators that allocated most (with their input shapes) and what profiling cost.

Wired like ``--trace`` (:mod:`gpumem.ipython.trace_cell`): the hooks call :func:`start` where they
begin measuring a cell and :func:`stop` / :func:`show` where they finish; nothing here raises into
the user's cell. Where the cell cannot be profiled (no torch imported) one line says why and the
cell runs all the same.
"""

from __future__ import annotations

from gpumem.core.profile import CellProfiler, ProfileReport
from gpumem.ipython.arguments import complain, display

__all__ = ["abandon", "show", "start", "stop"]


def start(asked: bool) -> CellProfiler | None:
    """A profiler already recording, or None (not asked, or it cannot: then one line says why)."""
    if not asked:
        return None
    try:
        profiler = CellProfiler()
        reason = profiler.start()
    except (Exception, KeyboardInterrupt) as error:
        complain("--profile could not start", error)
        return None
    if reason is not None:
        print(f"gpumem: --profile: {reason}; the cell runs without a profile.")
        return None
    return profiler


def stop(profiler: CellProfiler | None, cell: int | None) -> ProfileReport | None:
    """Stop profiling and group the operators; the report, or None."""
    if profiler is None:
        return None
    try:
        return profiler.stop(cell)
    except (Exception, KeyboardInterrupt) as error:
        complain("--profile could not read the profiler's events", error)
        return None


def abandon(profiler: CellProfiler | None) -> None:
    """Stop a profiler without showing anything (at unload, with a cell in flight)."""
    if profiler is None:
        return
    try:
        profiler.abandon()
    except (Exception, KeyboardInterrupt) as error:
        complain("--profile could not stop the profiler", error)


def show(report: ProfileReport | None, quiet: bool) -> ProfileReport | None:
    """The table under the cell, unless ``quiet``; the report shown."""
    if report is None or quiet:
        return None
    try:
        display(report)
    except (Exception, KeyboardInterrupt) as error:
        complain("could not show the profile", error)
        return None
    return report
