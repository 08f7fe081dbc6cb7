"""``%gpumem summary``, ``%gpumem export`` and ``%gpumem load``: the allocator's state annotated, and
the session (timeline, marks, cell history) written to a file and shown again read-only."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpumem.core.atomic_files import ForeignFileError
from gpumem.core.diagnoses.summary import SummaryUnavailableError, read_stats, summaries, write_stats_json
from gpumem.core.readers.readings import DeviceInfo, Snapshot
from gpumem.core.sessions.loaded_session import LoadedSession
from gpumem.core.sessions.session_file import (
    PARQUET_INSTALL,
    SavedReport,
    SessionData,
    SessionFormatError,
    capture_session,
    read_session,
    write_parquet,
    write_session,
)
from gpumem.ipython.arguments import (
    DEVICE_HELP,
    UsageError,
    argument,
    display,
    magic_arguments,
    parse_argstring,
    parse_cuda_devices,
    parse_path,
)
from gpumem.ipython.state import ExtensionState

__all__ = ["magic_export", "magic_load", "magic_summary"]


@magic_arguments("gpumem summary")
@argument("-d", "--device", metavar="DEVICES", help=f"the CUDA devices: {DEVICE_HELP} (default: every one in use)")
@argument(
    "--json",
    metavar="PATH",
    help='also write every figure of torch.cuda.memory_stats to PATH: {"gpumem_memory_stats": 1, "devices": {...}}',
)
@argument("--force", action="store_true", help="replace an existing file even if it is not such an export")
def magic_summary(state: ExtensionState, line: str) -> None:
    """PyTorch's caching allocator, one line per figure saying what it means: allocated, reserved, active
    and inactive-split memory (all, large pool, small pool; current and peak), the free reserve, the
    largest free block and what empty_cache() would free (from the segments), segments, allocation
    retries, out-of-memory errors, device mallocs and frees. Under backend:cudaMallocAsync, CUDA's pool
    allocates: only allocated, reserved and the free reserve mean something there, and only they are shown.
    Never starts CUDA.
    """
    args = parse_argstring(magic_summary, line)
    source = state.monitor.source
    target = parse_path("--json", args.json)
    devices = parse_cuda_devices(args.device, source) or tuple(source.cuda_devices())
    if not devices:
        try:
            read_stats(source, 0)  # says why there is no device to summarize
        except SummaryUnavailableError as why:
            print(f"gpumem summary: {why}.")
            return
        print("gpumem summary: no CUDA device is in use in this process.")
        return
    try:
        found = summaries(source, devices)
    except SummaryUnavailableError as why:
        if str(why).startswith("no such device"):
            raise UsageError(f"--device: {why}") from None
        print(f"gpumem summary: {why}.")
        return
    for summary in found:
        display(summary)
    if target is not None:
        stats = {summary.device: summary.stats for summary in found}
        _write(lambda: write_stats_json(stats, target, force=bool(args.force)), target, "the memory statistics")


@magic_arguments("gpumem export")
@argument("path", help="the JSON file to write")
@argument(
    "--parquet",
    action="store_true",
    help="also write PATH's stem .samples.parquet, .cells.parquet and one .levelN.parquet per timeline level "
    f"(needs pyarrow: {PARQUET_INSTALL}); %%gpumem load reads either",
)
@argument("--force", action="store_true", help="replace an existing file even if it is not a gpumem session export")
def magic_export(state: ExtensionState, line: str, reports: Sequence[SavedReport] = ()) -> None:
    """Write this session to a file: the memory timeline (every sample still kept, and each older
    stretch's minima and maxima; and every level of its store exactly, which load rebuilds), its
    marks, the cell history and the latest --trace and --profile reports shown (as text).
    %gpumem load PATH shows it again, on any machine. The file is written aside and renamed over
    PATH only once complete.
    """
    args = parse_argstring(magic_export, line)
    target = parse_path("path", args.path)
    assert target is not None
    data = capture_session(state.monitor.timeline, state.tracker.history, reports, *_machine(state))
    if args.parquet and importlib.util.find_spec("pyarrow") is None:  # checked before anything is written
        raise UsageError(f"--parquet needs pyarrow: {PARQUET_INSTALL}")
    what = f"{len(data.timeline.times):,} points, {len(data.marks):,} marks, {len(data.cells):,} cells"
    what += f" and {len(data.reports):,} reports"
    _write(lambda: write_session(data, target, force=bool(args.force)), target, what)
    if args.parquet:
        stem = target.with_suffix("") if target.suffix == ".json" else target
        try:
            written = write_parquet(data, stem)
        except OSError as error:
            raise UsageError(f"cannot write Parquet next to {str(target)!r}: {error.strerror or error}") from None
        print("wrote " + " and ".join(str(path) for path in written))


@magic_arguments("gpumem load")
@argument(
    "path",
    help="a file written by %%gpumem export: the JSON file, or any of its --parquet files (or their stem); "
    "or one by %%gpumem history --json (cells only)",
)
def magic_load(state: ExtensionState, line: str) -> None:
    """Show an exported session, read-only: its memory curves in the panel (in a notebook; elsewhere an inline
    SVG), the figures at export, its cell history and each cell's report. Nothing of the running session changes.
    The format is told by the file's content: JSON, or Parquet (needs pyarrow). In Python:
    gpumem.core.sessions.session_file.read_session(PATH).
    """
    args = parse_argstring(magic_load, line)
    target = parse_path("path", args.path)
    assert target is not None
    try:
        data = read_session(target)
    except SessionFormatError as error:
        raise UsageError(f"{target}: {error}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{target}: not a gpumem export (not UTF-8 text)") from None
    except OSError as error:
        raise UsageError(f"cannot read {str(target)!r}: {error.strerror or error}") from None
    panel = _loaded_panel(state, data, target)
    if panel is not None:
        display(panel)
    display(LoadedSession(data, str(target), curves=panel is None))


def _loaded_panel(state: ExtensionState, data: SessionData, target: Path) -> Any:
    """The session's curves in the panel's widgets, read-only; None without a kernel to show widgets in
    (a terminal: the text lists the figures), or for an export with no timeline."""
    if not data.timeline.times or getattr(state.shell, "kernel", None) is None:
        return None
    try:
        from gpumem.panel.loaded import LoadedPanel
    except ImportError:  # no ipywidgets or bqplot: the HTML draws the curves
        return None
    return LoadedPanel(data, target.name)


def _machine(state: ExtensionState) -> tuple[Snapshot | None, list[DeviceInfo]]:
    """The figures now and each device's description, for the header of a loaded panel (none when unreadable)."""
    source = state.monitor.source
    try:
        snapshot = state.monitor.snapshot()
        infos = [source.device_info(index) for index in source.cuda_devices()]
    except Exception:
        return None, []
    return snapshot, [info for info in infos if info is not None]


def _write(write: Callable[[], bool], target: Path, what: str) -> None:
    """Run one atomic writer and say what it did; a refusal or a failure is a one-line UsageError."""
    try:
        replaced = write()
    except ForeignFileError:
        raise UsageError(f"{target} exists and is not a gpumem export; it was left as it was (--force)") from None
    except OSError as error:
        raise UsageError(f"cannot write {str(target)!r}: {error.strerror or error}") from None
    print(f"replaced {target} with {what}" if replaced else f"wrote {what} to {target}")
