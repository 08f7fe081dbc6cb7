"""The cell tracker: says when measuring starts and ends, keeps the records, tells the listeners.

The figures come from the cell's measured stretch (:class:`gpumem.core.monitoring.spans.Stretch`, with
:mod:`gpumem.core.monitoring.peaks` deciding whether a peak is exact), the names from
:mod:`~gpumem.core.cells.attribution` and the warnings from :mod:`~gpumem.core.cells.warnings`; this module
only puts them together at the right moments, and says why no CUDA device is reported when none is.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpumem.core.cells.attribution import (
    Attribution,
    HolderFinder,
    VariableAttribution,
    VariableReport,
    held_variables,
    holders_walk,
    not_inspected_note,
    should_attribute,
)
from gpumem.core.cells.conditions import Condition, ToldConditions, device_warnings, standing_conditions
from gpumem.core.cells.patterns import STAIRCASE_MIN_BYTES, staircase_notes
from gpumem.core.cells.record import (
    CellOptions,
    CellRecord,
    CellWarning,
    DeviceChange,
    HeldVariable,
    HostChange,
    classify_error,
    first_line_of,
    source_key,
)
from gpumem.core.cells.warnings import (
    RerunLog,
    host_leak_warning,
    leak_warnings,
    peak_reset_warnings,
    variable_warnings,
)
from gpumem.core.diagnoses.fragmentation import ReserveReader
from gpumem.core.monitoring.monitor import Monitor
from gpumem.core.monitoring.peaks import PEAK_RESETS, RUNNING
from gpumem.core.monitoring.spans import Stretch
from gpumem.core.readers.cuda_fault import cuda_faults, fault_explanation, frozen_note, record_fault, take_untold
from gpumem.core.readers.devices import describe_devices
from gpumem.core.readers.sources import Snapshot
from gpumem.core.sampling.sampler import MAX_RATE_HZ
from gpumem.core.units import MIB

__all__ = ["TRACKER_DEFAULTS", "ActiveCell", "CellTracker", "cuda_note"]

# The tracker's settings a user may change while it runs (each is an attribute of the tracker, and a
# c.GpuMem setting of the same name), with their defaults: spelled here once.
TRACKER_DEFAULTS: dict[str, int] = {
    "history_size": 10_000,
    "leak_runs": 3,
    "leak_min_bytes": MIB,
    "attribute_threshold_bytes": MIB,
    "host_leak_min_bytes": 32 * MIB,  # host RSS moves by a few MiB on its own
    "pattern_min_bytes": STAIRCASE_MIN_BYTES,  # staircases and kept gradients smaller than this go unsaid
}


class ActiveCell(Stretch):
    """A cell between :meth:`CellTracker.begin` and :meth:`CellTracker.end`: a measured stretch with the cell's
    source, options and attribution baseline (mutable, private to the tracker)."""

    def __init__(self, source: str, options: CellOptions, execution_count: int | None) -> None:
        super().__init__()
        self.source = source
        self.options = options
        self.execution_count = execution_count
        self.started_wall_s = time.time()
        self.started_perf_s = 0.0
        self.baseline: Attribution | None = None


class CellTracker:
    """Measures cells against a :class:`~gpumem.core.monitoring.monitor.Monitor` and keeps their records.

    One cell is measured at a time. ``begin`` resets the allocator's peak counters of the devices
    in use (unless ``keep_peaks``); ``end`` reads everything again and builds the record, with
    variable attribution, leak and graph warnings.
    """

    def __init__(
        self,
        monitor: Monitor,
        *,
        history_size: int = TRACKER_DEFAULTS["history_size"],
        leak_runs: int = TRACKER_DEFAULTS["leak_runs"],
        leak_min_bytes: int = TRACKER_DEFAULTS["leak_min_bytes"],
        leak_tolerance: float = 0.25,
        attribute_threshold_bytes: int = TRACKER_DEFAULTS["attribute_threshold_bytes"],
        holder_finder: HolderFinder | None = None,
        start_sampler: bool = True,
        capacity_fraction: float = 0.9,
        host_leak_min_bytes: int = TRACKER_DEFAULTS["host_leak_min_bytes"],
        pattern_min_bytes: int = TRACKER_DEFAULTS["pattern_min_bytes"],
    ) -> None:
        self.monitor = monitor
        self.leak_runs = leak_runs
        self.leak_min_bytes = leak_min_bytes
        self.leak_tolerance = leak_tolerance
        self.attribute_threshold_bytes = attribute_threshold_bytes
        self.capacity_fraction = capacity_fraction
        self.host_leak_min_bytes = host_leak_min_bytes
        self.pattern_min_bytes = pattern_min_bytes
        self._attribution = VariableAttribution(holder_finder if holder_finder is not None else holders_walk(monitor))
        self.start_sampler = start_sampler
        self.started_sampler = False  # holds a claim on the monitor's sampler
        self._lock = threading.Lock()
        self._history: deque[CellRecord] = deque(maxlen=max(1, history_size))
        self._count = 0
        self._active: list[ActiveCell] = []  # more than one only for concurrent (nested or threaded) blocks
        self._reruns = RerunLog()
        # The last source, its key and first line: most cells are re-runs or repeats.
        self._last_source = ("", source_key(""), first_line_of(""))
        self._told = ToldConditions()  # device conditions already warned of, so no later cell repeats them
        self._reserves = ReserveReader()
        self._resets = PEAK_RESETS
        self._listeners: list[Callable[[CellRecord], None]] = []
        self._listening = False
        self._closed = False

    # Attribution settings -------------------------------------------------------------------------
    @property
    def holder_finder(self) -> HolderFinder:
        """Who holds what: ``(namespace, device, names) -> holders report``."""
        return self._attribution.holder_finder

    @holder_finder.setter
    def holder_finder(self, finder: HolderFinder) -> None:
        self._attribution.holder_finder = finder

    @property
    def incremental(self) -> bool:
        """Automatic mode walks only the names whose value changed."""
        return self._attribution.incremental

    @incremental.setter
    def incremental(self, value: bool) -> None:
        self._attribution.incremental = value

    @property
    def walks(self) -> dict[str, int]:
        """How many namespace walks were made, "full" and of "changed names" only."""
        return self._attribution.walks

    # History --------------------------------------------------------------------------------------
    @property
    def history(self) -> tuple[CellRecord, ...]:
        with self._lock:
            return tuple(self._history)

    @property
    def history_size(self) -> int:
        return self._history.maxlen or 0

    @history_size.setter
    def history_size(self, value: int) -> None:
        with self._lock:
            self._history = deque(self._history, maxlen=max(1, value))

    def clear_history(self) -> None:
        with self._lock:
            self._history.clear()
            self._reruns.clear()

    @property
    def active(self) -> ActiveCell | None:
        """The cell measured now (the innermost, for nested blocks)."""
        with self._lock:
            return self._active[-1] if self._active else None

    def add_listener(self, listener: Callable[[CellRecord], None]) -> None:
        """Call ``listener(record)`` after every measured cell (on the thread that ended it)."""
        if listener not in self._listeners:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[CellRecord], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def close(self) -> None:
        """Detach from the sampler and release this tracker's claim on it (it stops if no one else needs it)."""
        self._closed = True
        if self._listening:
            self.monitor.sampler.remove_listener(self._on_sample)
            self._listening = False
        self.release_sampler()
        with self._lock:
            cells = list(self._active)
            for cell in cells:
                cell.finished = True
            self._active.clear()
        for cell in cells:
            self.monitor.release(_claim_of(cell))
        self._resets.release()

    def release_sampler(self) -> None:
        """Give up this tracker's claim on the sampler; the next measured cell claims it again."""
        if self.started_sampler:
            self.monitor.release(self)
            self.started_sampler = False

    # Measuring ------------------------------------------------------------------------------------
    def begin(
        self,
        source: str,
        *,
        options: CellOptions | None = None,
        execution_count: int | None = None,
        namespace: Mapping[str, Any] | None = None,
        concurrent: bool = False,
    ) -> ActiveCell:
        """Start measuring a cell. With ``options.attribute`` and a namespace, first record who holds what.

        A cell still running here is taken as one whose end was never reported and is ended with an
        error, unless ``concurrent`` (blocks that nest or run on several threads, ``gpumem.measure``).
        While any other measurement runs in the process, the peak counters are left alone
        (``keep_peaks``), so that the other's peak stays exact.
        """
        options = options or CellOptions()
        if not concurrent and self._active:
            for stale in self._active_cells():
                self.end(stale, error=RuntimeError("the end of this cell was never reported"))
        cell = ActiveCell(source, options, execution_count)
        if RUNNING.add(cell) and not options.keep_peaks:
            cell.options = options._replace(keep_peaks=True)
        try:
            self._start(cell, namespace)
        except BaseException:
            cell.finished = True  # a start that failed must not keep other cells from resetting peaks
            raise
        cell.started_perf_s = time.perf_counter()
        return cell

    def _start(self, cell: ActiveCell, namespace: Mapping[str, Any] | None) -> None:
        """Read the start of ``cell`` and reset the raised peak counters it is measured by."""
        options = cell.options
        if options.attribute and options.mode == "magic" and namespace is not None:
            cell.baseline = self._attribution.at_start(namespace, options.devices)
        start = self.monitor.snapshot()
        self._ensure_sampling()
        if options.mode != "auto" and self.start_sampler and not self._closed:
            # A cell measured on purpose is sampled as finely as the panel's finest view: a staircase in a
            # cell of a few seconds needs more than the idle rate's samples.
            self.monitor.acquire(_claim_of(cell), MAX_RATE_HZ)
        # No sample of the start (or the end) itself: the figures take the maximum with both readings anyway.
        cell.open(self.monitor.source, start, keep_peaks=options.keep_peaks, devices=options.devices)
        if cell.execution_count is not None:
            self.monitor.mark(f"[{cell.execution_count}]", start.monotonic_s)
        with self._lock:
            self._active.append(cell)

    def end(
        self,
        cell: ActiveCell,
        *,
        error: BaseException | None = None,
        namespace: Mapping[str, Any] | None = None,
        execution_count: int | None = None,
        options: CellOptions | None = None,
        hidden: Mapping[str, Any] | None = None,
    ) -> CellRecord:
        """Finish measuring ``cell`` and record it. ``options`` may replace the ones given to begin
        (a ``%%gpumem`` found inside an automatically measured cell), except for ``keep_peaks``.
        ``hidden`` names references the host keeps for the user (``{"Out[7]": value}``)."""
        duration_s = time.perf_counter() - cell.started_perf_s
        options = options or cell.options
        if options.keep_peaks != cell.options.keep_peaks:
            options = options._replace(keep_peaks=cell.options.keep_peaks)
        end = self._close(cell, options)
        start = cell.start
        assert start is not None
        status, error_text = classify_error(error)
        count = execution_count if execution_count is not None else cell.execution_count
        fault = record_fault(error, count, end.allocator) if error is not None else None
        devices = cell.device_changes(end, options.devices)
        host = cell.host_change(end)
        key, first_line = self._source_names(cell.source)
        warnings = self._figure_warnings(key, devices, start, end, host, status)
        # Said once, here (or under the first cell measured after a fault seen elsewhere); later cells say
        # their CUDA figures are frozen.
        warnings[:0] = [CellWarning("cuda-error", fault_explanation(untold, count)) for untold in take_untold()]
        variables = self._variables(cell, namespace, options, count, devices, hidden)
        if variables.changes or variables.graph_paths:  # else there is nothing to warn of (most cells)
            warnings += variable_warnings(variables.changes, variables.graph_paths, variables.graph_saved_bytes)
        staircases, notes = staircase_notes(
            self.monitor.timeline, start, end, devices, variables, namespace, self.pattern_min_bytes
        )
        warnings += staircases
        faults = cuda_faults()
        note = frozen_note(faults) if faults and fault is None else cuda_note(
            options.devices, devices, end, self.monitor.status
        )
        with self._lock:
            self._count += 1
            record = CellRecord(
                serial=self._count,  # numbered when kept
                execution_count=count,
                first_line=first_line,
                source_hash=key,
                started_wall_s=cell.started_wall_s,
                duration_s=duration_s,
                monotonic_s=end.monotonic_s,
                status=status,
                error=error_text,
                devices=devices,
                host=host,
                variables=variables.changes,
                variables_note=variables.note,
                warnings=tuple(warnings),
                cuda_note=note,
                keep_peaks=options.keep_peaks,
                mode=options.mode,
                quiet=options.quiet,
                kinds=variables.kinds,
                kinds_since=variables.kinds_since,
                notes=notes,
            )
            self._history.append(record)
        self._resets.release()
        self._tell_listeners(record)
        return record

    def _close(self, cell: ActiveCell, options: CellOptions) -> Snapshot:
        """The cell's end reading; the cell stops being active (nothing more is sampled into it)."""
        # Only a full report splits "device used" by who uses it; NVML's per-process read costs ~80 us a
        # cell, too much for every automatic-mode cell, whose one-line summary never shows the split.
        end = self.monitor.snapshot(process_memory=options.mode != "auto")
        with self._lock:
            cell.finished = True
            if cell in self._active:
                self._active.remove(cell)
        if cell.options.mode != "auto":  # only a cell measured on purpose asked for a faster rate
            self.monitor.release(_claim_of(cell))
        return end

    def standing_conditions(
        self, namespace: Mapping[str, Any] | None = None, hidden: Mapping[str, Any] | None = None
    ) -> list[Condition]:
        """What holds now, warned of under an earlier cell or not: devices nearly full or fragmented,
        and (with a namespace, and ``hidden`` for the host's own references) autograd graphs kept alive."""
        held: list[HeldVariable] = []
        finder = self._attribution.holder_finder
        for mapping, names in ((namespace, None), (hidden, list(hidden or ()))):
            if not mapping:
                continue
            try:
                rows = held_variables(finder(mapping, "cuda", names))
            except Exception:
                rows = []  # the device conditions are still worth listing
            held.extend(row._replace(hidden=True) if names is not None else row for row in rows)
        try:
            snapshot: Snapshot | None = self.monitor.snapshot()
        except Exception:
            snapshot = None  # the devices cannot be read now: what the walk found still holds
        return standing_conditions(snapshot, self.capacity_fraction, self._reserves, self.monitor.source, held)

    # Internals ------------------------------------------------------------------------------------
    def _figure_warnings(
        self,
        key: str,
        devices: Sequence[DeviceChange],
        start: Snapshot,
        end: Snapshot,
        host: HostChange | None,
        status: str,
    ) -> list[CellWarning]:
        """Peak counters reset, devices nearly full or fragmented (by this cell), and growth alike on every
        re-run (CUDA allocated memory, and host RSS)."""
        warnings = peak_reset_warnings(devices) + device_warnings(
            devices, start, end, self.capacity_fraction, self._told, self._reserves, self.monitor.source
        )
        host_bytes = host.rss_delta_bytes if host is not None else None
        runs_total, recent = self._reruns.add(key, devices, status, self.leak_runs, host_bytes)
        if recent is None or not self._may_leak(devices, host_bytes):
            return warnings
        warnings += leak_warnings(
            devices,
            recent,
            runs_total,
            runs=self.leak_runs,
            min_bytes=self.leak_min_bytes,
            tolerance=self.leak_tolerance,
        )
        host_leak = host_leak_warning(
            recent, runs_total, runs=self.leak_runs, min_bytes=self.host_leak_min_bytes, tolerance=self.leak_tolerance
        )
        return warnings if host_leak is None else [*warnings, host_leak]

    def _source_names(self, source: str) -> tuple[str, str]:
        """The source's key and first line (both functions of the text alone, kept for the last source)."""
        last_source, key, first_line = self._last_source
        if source != last_source:
            key, first_line = source_key(source), first_line_of(source)
            self._last_source = (source, key, first_line)
        return key, first_line

    def _may_leak(self, devices: Sequence[DeviceChange], host_bytes: int | None) -> bool:
        """Whether this run grew anything enough for a leak warning: one needs every recent run, this
        one included, to have grown by at least the minimum (most cells grow nothing)."""
        if host_bytes is not None and host_bytes >= self.host_leak_min_bytes:
            return True
        return any(change.allocated_delta_bytes >= self.leak_min_bytes for change in devices)

    def _variables(
        self,
        cell: ActiveCell,
        namespace: Mapping[str, Any] | None,
        options: CellOptions,
        count: int | None,
        devices: Sequence[DeviceChange],
        hidden: Mapping[str, Any] | None,
    ) -> VariableReport:
        threshold = self.attribute_threshold_bytes
        if devices and namespace is not None and should_attribute(options, devices, threshold):
            return self._attribution.variable_changes(
                cell.baseline, namespace, options, count, devices, hidden, threshold
            )
        return VariableReport((), not_inspected_note(options, devices, namespace, threshold), ())

    def _tell_listeners(self, record: CellRecord) -> None:
        """A listener that raises is dropped: one broken listener must not break every cell."""
        for listener in list(self._listeners):
            if not _delivered(listener, record):
                self._listeners.remove(listener)

    def _ensure_sampling(self) -> None:
        if self._closed:
            return
        if not self._listening:
            self.monitor.sampler.add_listener(self._on_sample)
            self._listening = True
        if self.start_sampler and not self.started_sampler:
            self.monitor.acquire(self)  # shared with panels: it stops when the last user releases it
            self.started_sampler = True

    def _on_sample(self, snapshot: Snapshot) -> None:
        """Sampler thread: remember the highest values seen while a cell runs (lower bounds for peaks)."""
        for cell in self._active_cells():
            cell.take_sample(snapshot)

    def _active_cells(self) -> list[ActiveCell]:
        with self._lock:
            return [cell for cell in self._active if not cell.finished]


def _claim_of(cell: ActiveCell) -> tuple[str, int]:
    """The name a measured cell's claim on the sampler goes by."""
    return ("cell", id(cell))


def _delivered(listener: Callable[[CellRecord], None], record: CellRecord) -> bool:
    try:
        listener(record)
    except Exception:
        return False
    return True


def cuda_note(
    requested: tuple[int, ...] | None,
    devices: Sequence[DeviceChange],
    end: Snapshot,
    status: Callable[[], Mapping[str, str]],
) -> str | None:
    """Why a requested device, or any device, is missing from the report (None: nothing is missing).
    ``status`` is the monitor's, read only when no device is reported."""
    if requested is not None:
        shown = {change.device for change in devices}
        missing = ", ".join(f"cuda:{d}" for d in requested if d not in shown)
        if not missing:
            return None
        visible = sorted(reading.device for reading in end.allocator)
        if visible:  # CUDA is initialized, so the allocator lists every device this process can use
            return f"{missing}: no such device; this process sees {describe_devices(visible)}"
        return f"{missing}: not initialized in this process (no PyTorch tensor has been put there)"
    if devices:
        return None
    try:
        torch_status = status().get("torch", "unavailable")
    except Exception as error:
        torch_status = f"unavailable: {type(error).__name__}: {error}"
    if torch_status == "ok":
        return "CUDA is initialized but no device has allocated memory"
    return "CUDA is not in use: " + torch_status.removeprefix("unavailable: ")
