"""``%gpumem auto``, ``%gpumem history`` and ``%gpumem status``: they act on the loaded extension's
state (its settings, cell tracker and monitor), which the magics pass in."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpumem.core.atomic_files import ForeignFileError
from gpumem.core.cells import CellRecord
from gpumem.core.readers.allocator_backend import allocator_line
from gpumem.core.readers.cuda_fault import fault_for
from gpumem.core.units import format_bytes
from gpumem.ipython.arguments import (
    THRESHOLD_HELP,
    UsageError,
    argument,
    display,
    magic_arguments,
    parse_amount,
    parse_argstring,
    parse_path,
)
from gpumem.ipython.state import VARS_HELP, VARS_MODES, ExtensionState

__all__ = ["auto_mode_text", "magic_auto", "magic_history", "magic_status"]


@magic_arguments("gpumem auto")
@argument(
    "switch",
    nargs="?",
    type=str.lower,
    choices=("on", "off"),
    metavar="on|off",
    help="turn automatic mode on or off (omit to see its settings)",
)
@argument(
    "--threshold",
    metavar="AMOUNT",
    help=f"show a summary line under a cell whose memory changed by at least AMOUNT: {THRESHOLD_HELP}; a share "
    "counts against each device's capacity (default 64MiB)",
)
@argument("--vars", choices=VARS_MODES, metavar="MODE", help=f"{VARS_HELP} (default changed)")
@argument("--keep-peaks", action="store_true", help="leave PyTorch's peak counters alone (sampled peaks)")
@argument("--reset-peaks", action="store_true", help="reset the peak counters at each cell start (exact peaks)")
def magic_auto(state: ExtensionState, line: str) -> None:
    """Measure every cell (quietly): each is recorded in the history; a one-line summary appears under
    a cell only when it changed memory by at least the threshold or has a warning. The default comes
    from the IPython config option c.GpuMem.auto.
    """
    args = parse_argstring(magic_auto, line)
    config = state.config
    if args.keep_peaks and args.reset_peaks:
        raise UsageError("choose one of --keep-peaks and --reset-peaks")
    if args.threshold is not None:
        config.threshold = parse_amount(args.threshold)
    if args.vars is not None:
        config.vars = args.vars
    if args.keep_peaks or args.reset_peaks:
        config.keep_peaks = bool(args.keep_peaks)
    if args.switch is not None:
        config.auto = args.switch == "on"
    print(auto_mode_text(state))


def auto_mode_text(state: ExtensionState) -> str:
    """Two short lines (a notebook wraps one long line mid-word): what is measured and shown, then how."""
    config = state.config
    if not config.auto:
        return "gpumem automatic mode is off (%gpumem auto on, or %%gpumem on one cell)."
    peaks = "peaks sampled (lower bounds)" if config.keep_peaks else "peaks exact (reset per cell)"
    variables = {
        "changed": f"holders looked up after {format_bytes(config.attribute_threshold_bytes)}+ changes",
        "always": "holders looked up after every cell",
        "never": "holders not looked up",
    }[config.vars]
    threshold = config.threshold
    amount = f"{threshold}+" if threshold.nbytes is not None else f"{threshold}+ of a device's capacity"
    return (
        "gpumem automatic mode is on: every cell is measured (%gpumem history); a line shows under cells\n"
        f"that change memory by {amount} or warn; {peaks}; {variables}."
    )


@magic_arguments("gpumem history")
@argument("--last", type=int, default=30, metavar="N", help="show the last N cells (default 30)")
@argument("--all", action="store_true", help="show every recorded cell")
@argument("--csv", metavar="PATH", help="write the history to a CSV file (one row per cell)")
@argument(
    "--json",
    metavar="PATH",
    help='write the history to a JSON file: {"gpumem_history": 1, "cells": [one object per cell]}',
)
@argument(
    "--force",
    action="store_true",
    help="replace an existing file even if it is not a gpumem export (without it, only an empty file, a CSV "
    "whose header is gpumem's or a JSON object whose first key is gpumem_history is replaced)",
)
@argument("--clear", action="store_true", help="forget the recorded cells")
def magic_history(state: ExtensionState, line: str) -> None:
    """Show the measured cells (number, start, duration, status, per-device allocated change and peak,
    host change, largest change by kind, warnings and notes, first line), or export them. In Python,
    gpumem.history() returns a DataFrame.

    An export is written to a temporary file next to the target and renamed over it only once it is
    complete: if writing fails, the previous file is left as it was.
    """
    from gpumem.core.cells.report import HistoryTable

    args = parse_argstring(magic_history, line)
    records = state.tracker.history
    if args.last < 0:
        raise UsageError(f"--last must be 0 or more, not {args.last}")
    exports = [(kind, parse_path(f"--{kind.lower()}", path)) for kind, path in (("CSV", args.csv), ("JSON", args.json))]
    exported = False
    for kind, target in exports:
        if target is not None:
            _export(records, kind, target, force=bool(args.force))
            exported = True
    if args.clear:
        state.tracker.clear_history()
        print(f"forgot {_count(len(records), 'cell')}")
        return
    if exported:
        return
    shown = records if args.all else records[len(records) - args.last :] if args.last else ()
    display(HistoryTable(shown, total=len(records)))


def _export(records: Sequence[CellRecord], kind: str, target: Path, *, force: bool) -> None:
    """Write one export file and say so; a refusal or a failure is a one-line UsageError."""
    from gpumem.core.cells.report import write_csv, write_json

    writer = write_csv if kind == "CSV" else write_json
    try:
        replaced = writer(records, target, force=force)
    except ForeignFileError:
        raise UsageError(
            f"{target} exists and is not a gpumem {kind} export; it was left as it was (--force replaces it)"
        ) from None
    except OSError as error:
        raise UsageError(f"cannot write {kind} to {str(target)!r}: {error.strerror or error}") from None
    cells = _count(len(records), "cell")
    print(f"replaced {target} with {cells}" if replaced else f"wrote {cells} to {target}")


@magic_arguments("gpumem status")
def magic_status(state: ExtensionState, line: str) -> None:
    """Show the figures now (per device: PyTorch allocated and reserved, whole-device used; host RSS), what
    gpumem can read here (PyTorch allocator, NVML, host), the automatic mode, the sampler, and the standing
    conditions: what holds now of what the warnings say (a device nearly full or fragmented,
    autograd graphs or outputs kept alive), each warned of once under the cell that caused it."""
    parse_argstring(magic_status, line)
    lines = ["gpumem status", *_now_lines(state)]
    lines.extend(f"  {reader:<8} {status}" for reader, status in state.monitor.status().items())
    lines.append(f"  alloc    {allocator_line()}")
    sampler = state.monitor.sampler
    cost = sampler.cost()
    rate = f"{sampler.rate_hz:g} Hz"
    running = f"running at {rate}" if sampler.running else f"stopped ({rate} when running)"
    if cost.recent_reads:
        windowed = cost.recent_reads < cost.samples
        over = f"the last {cost.recent_reads:,}" if windowed else "all"
        slowest = "the slowest of those" if windowed else "the slowest"
        taken = (
            f"{_count(cost.samples, 'sample')} taken; a read typically takes {_duration(cost.recent_median_s)} "
            f"(median of {over}), {slowest} {_duration(cost.recent_max_s)}"
        )
    else:
        taken = "no samples taken yet"
    lines.append(f"  sampler  {running}; {taken}")
    if sampler.last_error:
        lines.append(f"           the last read failed: {sampler.last_error}")
    auto = auto_mode_text(state).removeprefix("gpumem automatic mode is ").splitlines()
    lines.extend(("  auto     " if number == 0 else "           ") + text for number, text in enumerate(auto))
    cells = _count(len(state.tracker.history), "cell")
    lines.append(f"  history  {cells} recorded (keeps up to {state.tracker.history_size:,})")
    lines.extend(_standing_lines(state))
    print("\n".join(lines))


def _now_lines(state: ExtensionState) -> list[str]:
    """One snapshot through the monitor's reader: the figures now (a terminal has no panel; these are its
    figures), a row per device labelled with the device and one for the host labelled ``host RAM``."""
    try:
        snapshot = state.monitor.snapshot()
    except Exception as error:
        return [f"  {'figures':<8} could not be read now ({type(error).__name__}: {error})"]
    devices = sorted({r.device for r in snapshot.allocator} | {r.device for r in snapshot.devices})
    rows = []
    for device in devices:
        figures = []
        allocator = snapshot.allocator_for(device)
        fault = fault_for(device)
        if allocator is not None:
            figures.append(f"allocated {format_bytes(allocator.allocated_bytes)}")
            figures.append(f"reserved {format_bytes(allocator.reserved_bytes)}")
        elif fault is not None:  # not read since the CUDA error (the torch line says which)
            figures.append(f"PyTorch's figures frozen {fault.where}")
        whole = snapshot.device_for(device)
        if whole is not None:
            figures.append(
                f"device used {format_bytes(whole.used_bytes)} of {format_bytes(whole.total_bytes)} (all processes)"
            )
        rows.append((f"cuda:{device}", ", ".join(figures)))
    if not devices:
        rows.append(("cuda", "no CUDA device in use"))
    if snapshot.host is not None:
        rows.append(("host RAM", f"RSS {format_bytes(snapshot.host.rss_bytes)} (this process)"))
    return [f"  {label:<8} {text}" for label, text in rows]


def _standing_lines(state: ExtensionState) -> list[str]:
    """The conditions that hold now; each was warned of once, under the cell that caused it (if measured)."""
    user_ns = state.shell.user_ns
    outputs = user_ns.get("Out")
    cached = {f"Out[{n}]": value for n, value in outputs.items()} if isinstance(outputs, dict) else {}
    try:
        conditions = state.tracker.standing_conditions(user_ns, cached)
    except Exception as error:
        return [f"  standing could not be checked ({type(error).__name__}: {error})"]
    if not conditions:
        return ["  standing none (no device nearly full or fragmented, no autograd graph or output kept alive)"]
    return [f"  standing {condition.message}" for condition in conditions]


_MILLISECOND = 1e-3


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= _MILLISECOND else f"{seconds * 1e6:.0f} us"


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'' if number == 1 else 's'}"
