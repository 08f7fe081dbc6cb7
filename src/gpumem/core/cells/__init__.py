"""Per-cell memory accounting: before, after and peak per CUDA device and for the host, kept as history.

Knows nothing of IPython: a caller says when a cell begins and ends (``_extension.py`` does it from
IPython's events), and gets an immutable :class:`CellRecord` back.

Peaks are read from the allocator's own counters, so memory allocated and freed within the cell is
still seen. By default the counters are reset when a cell starts (this also resets what the user's
``torch.cuda.max_memory_allocated()`` returns); with ``keep_peaks`` they are left alone and the peak
is the highest sampled value, a lower bound, unless the counter rose above its earlier value.
"""

from __future__ import annotations

import hashlib
import re
import statistics
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from gpumem.core.devices import describe_devices
from gpumem.core.monitor import Monitor
from gpumem.core.sources import AllocatorReading, Snapshot
from gpumem.core.units import MIB, format_bytes, format_delta

__all__ = [
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
    "HostChange",
    "VariableChange",
    "classify_error",
    "first_line_of",
    "source_key",
]


STATUS_OK = "ok"
STATUS_ERROR = "error"
STATUS_INTERRUPTED = "interrupted"
STATUS_OUT_OF_MEMORY = "out of memory"
STATUSES = (STATUS_OK, STATUS_ERROR, STATUS_INTERRUPTED, STATUS_OUT_OF_MEMORY)

PEAK_RESET_NOTE = "the peak counter was reset inside the cell; showing the sampled lower bound"
KEPT_PEAK_NOTE = "peak counters kept (not reset): sampled lower bound"


class DeviceChange(NamedTuple):
    """One CUDA device across a cell. Allocated/reserved are PyTorch's; ``used`` is NVML's whole device."""

    device: int
    allocated_before_bytes: int
    allocated_after_bytes: int
    reserved_before_bytes: int
    reserved_after_bytes: int
    peak_allocated_bytes: int  # highest allocated during the cell (absolute)
    peak_exact: bool  # from the allocator's counter; False: highest sampled value, a lower bound
    peak_note: str  # why the peak is not exact, or ""
    peak_reserved_bytes: int
    used_before_bytes: int | None  # None: NVML unavailable
    used_after_bytes: int | None
    total_bytes: int | None
    initialized_in_cell: bool  # CUDA was first used on this device inside the cell

    @property
    def allocated_delta_bytes(self) -> int:
        return self.allocated_after_bytes - self.allocated_before_bytes

    @property
    def reserved_delta_bytes(self) -> int:
        return self.reserved_after_bytes - self.reserved_before_bytes

    @property
    def peak_above_start_bytes(self) -> int:
        return self.peak_allocated_bytes - self.allocated_before_bytes

    @property
    def used_delta_bytes(self) -> int | None:
        if self.used_before_bytes is None or self.used_after_bytes is None:
            return None
        return self.used_after_bytes - self.used_before_bytes


class HostChange(NamedTuple):
    """This process's resident memory across a cell."""

    rss_before_bytes: int
    rss_after_bytes: int
    peak_rss_bytes: int
    peak_exact: bool  # the lifetime peak rose during the cell, so it is this cell's; else sampled, a lower bound

    @property
    def rss_delta_bytes(self) -> int:
        return self.rss_after_bytes - self.rss_before_bytes

    @property
    def peak_above_start_bytes(self) -> int:
        return self.peak_rss_bytes - self.rss_before_bytes


class VariableChange(NamedTuple):
    """A name that holds CUDA memory after the cell and is new, or holds more than before."""

    name: str
    type_name: str
    device: str
    nbytes: int
    previous_bytes: int | None  # None: not holding CUDA memory at the last attribution
    hidden: bool  # one of IPython's own references (Out, _N, the last exception)

    @property
    def grown_bytes(self) -> int:
        return self.nbytes - (self.previous_bytes or 0)


class CellWarning(NamedTuple):
    """Something the user should act on; ``kind`` is one of leak, graph, peak-reset, capacity, fragmentation."""

    kind: str
    message: str


class CellRecord(NamedTuple):
    """What one measured cell did to memory. Immutable; the tracker keeps a bounded history of them."""

    serial: int  # 1-based position among this session's measured cells
    execution_count: int | None
    first_line: str
    source_hash: str
    started_wall_s: float
    duration_s: float
    status: str
    error: str | None
    devices: tuple[DeviceChange, ...]
    host: HostChange | None
    variables: tuple[VariableChange, ...]
    variables_note: str  # what the variable list means, or why there is none
    warnings: tuple[CellWarning, ...]
    cuda_note: str | None  # why no CUDA device is reported, when none is
    keep_peaks: bool
    mode: str  # "magic" (asked for with %%gpumem) or "auto"
    quiet: bool

    def largest_change_bytes(self) -> int:
        """The biggest absolute change of any figure (CUDA allocated/reserved/peak, host RSS)."""
        sizes = [0]
        for change in self.devices:
            sizes += [abs(change.allocated_delta_bytes), abs(change.reserved_delta_bytes)]
            sizes.append(max(change.peak_above_start_bytes, 0))
        if self.host is not None:
            sizes.append(abs(self.host.rss_delta_bytes))
        return max(sizes)


class CellOptions(NamedTuple):
    """How to measure one cell."""

    devices: tuple[int, ...] | None = None  # None: every device in use
    keep_peaks: bool = False
    attribute: bool | None = None  # None: only when CUDA allocated memory changed by attribute_threshold_bytes
    mode: str = "auto"
    quiet: bool = False


class HeldVariable(NamedTuple):
    """The part of a holder report the tracker uses (independent of the holders module's classes)."""

    name: str
    type_name: str
    device: str
    nbytes: int
    graph_paths: tuple[str, ...]
    hidden: bool


# (namespace, device filter such as "cuda" or "cuda:1", names to walk or None for all of them and
# IPython's hidden references) -> a holders report (see gpumem.core.holders.find_holders)
HolderFinder = Callable[[Mapping[str, Any], str, "Collection[str] | None"], Any]

# An automatic-mode walk covers only the names whose value changed; past this many it walks everything.
MAX_CHANGED_NAMES = 100
_SIZED = frozenset({list, dict, set, frozenset, tuple, deque})


class _Attribution(NamedTuple):
    held: dict[str, HeldVariable]
    note: str
    ok: bool


def _signatures(namespace: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Per name: the value's id, and its length for built-in containers (so an append shows)."""
    signatures: dict[str, tuple[int, int]] = {}
    for name, value in list(namespace.items()):
        kind = type(value)
        signatures[name] = (id(value), len(value) if kind in _SIZED else -1)
    return signatures


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
        self.baseline: _Attribution | None = None
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


class _PeakResetCounter:
    """Counts, per device, calls that reset PyTorch's allocator peak counters.

    ``torch.cuda.reset_peak_memory_stats`` (and ``reset_max_memory_allocated``, built on it) call
    ``torch._C._cuda_resetPeakMemoryStats`` by name each time; a counting wrapper around that one
    function tells for certain whether the user's code reset a counter during a cell. Installed only
    once torch is imported and built with CUDA, and only while something is measured: one counter
    serves every tracker in the process (the extension's and ``gpumem.measure``'s), so the wrapper
    never wraps itself, and :meth:`release` removes it when the last measurement ends.
    """

    _NAME = "_cuda_resetPeakMemoryStats"

    def __init__(self) -> None:
        self.calls: dict[int | None, int] = {}
        self._lock = threading.Lock()
        self._module: Any = None
        self._original: Any = None
        self._wrapper: Any = None

    def install(self) -> None:
        with self._lock:
            module = getattr(sys.modules.get("torch"), "_C", None)
            current = getattr(module, self._NAME, None)
            if current is None or (current is self._wrapper and module is self._module):
                return
            original = current
            lock = self._lock

            def counting_reset(*args: Any, **kwargs: Any) -> Any:
                device = args[0] if args and isinstance(args[0], int) else None
                with lock:
                    self.calls[device] = self.calls.get(device, 0) + 1
                return original(*args, **kwargs)

            setattr(module, self._NAME, counting_reset)
            self._module, self._original, self._wrapper = module, original, counting_reset

    def release(self) -> None:
        """Put torch's own function back, unless a measurement still runs somewhere in the process."""
        with _running_lock:
            if any(not cell.finished for cell in _running):
                return
            with self._lock:
                if self._module is not None and getattr(self._module, self._NAME, None) is self._wrapper:
                    setattr(self._module, self._NAME, self._original)
                self._module = self._original = self._wrapper = None

    def snapshot(self) -> dict[int | None, int]:
        with self._lock:
            return dict(self.calls)

    def count(self, device: int) -> int:
        """Resets that may have touched ``device`` (a call without a device index counts for all)."""
        with self._lock:
            return self.calls.get(device, 0) + self.calls.get(None, 0)


_RESETS = _PeakResetCounter()

# Every cell or block being measured in this process, whichever tracker measures it: while one runs,
# another starting inside it leaves the peak counters alone, so that the outer peak stays exact.
_running_lock = threading.Lock()
_running: weakref.WeakSet[ActiveCell] = weakref.WeakSet()


def _others_running(cell: ActiveCell) -> bool:
    with _running_lock:
        return any(other is not cell and not other.finished for other in _running)


def first_line_of(source: str, limit: int = 80) -> str:
    """The first non-blank line of a cell that is not a cell magic's header, shortened for tables."""
    lines = [line.strip() for line in source.splitlines() if line.strip()]
    code = [line for line in lines if not line.startswith("%%")]
    text = (code or lines or [""])[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def source_key(source: str) -> str:
    """Identifies a cell's source across re-runs, ignoring trailing spaces and blank lines around it."""
    normal = "\n".join(line.rstrip() for line in source.strip("\n").splitlines()).strip()
    return hashlib.blake2b(normal.encode("utf-8", "replace"), digest_size=8).hexdigest()


def classify_error(error: BaseException | None) -> tuple[str, str | None]:
    """(status, one-line description). Recognises torch's OutOfMemoryError without importing torch."""
    if error is None:
        return STATUS_OK, None
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    description = f"{type(error).__name__}: {text}" if text else type(error).__name__
    if len(description) > 200:
        description = description[:199] + "…"
    if isinstance(error, KeyboardInterrupt):
        return STATUS_INTERRUPTED, description
    if _is_out_of_memory(error):
        return STATUS_OUT_OF_MEMORY, description
    return STATUS_ERROR, description


def _is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, MemoryError):
        return True
    for cls in type(error).__mro__:
        if cls.__name__ == "OutOfMemoryError" and cls.__module__.split(".")[0] == "torch":
            return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error)[:300].lower()


class CellTracker:
    """Measures cells against a :class:`~gpumem.core.monitor.Monitor` and keeps their records.

    One cell is measured at a time. ``begin`` resets the allocator's peak counters of the devices
    in use (unless ``keep_peaks``); ``end`` reads everything again and builds the record, with
    variable attribution, leak and graph warnings.
    """

    def __init__(
        self,
        monitor: Monitor,
        *,
        history_size: int = 10_000,
        leak_runs: int = 3,
        leak_min_bytes: int = MIB,
        leak_tolerance: float = 0.25,
        attribute_threshold_bytes: int = MIB,
        holder_finder: HolderFinder | None = None,
        start_sampler: bool = True,
        capacity_fraction: float = 0.9,
    ) -> None:
        self.monitor = monitor
        self.leak_runs = leak_runs
        self.leak_min_bytes = leak_min_bytes
        self.leak_tolerance = leak_tolerance
        self.attribute_threshold_bytes = attribute_threshold_bytes
        self.capacity_fraction = capacity_fraction
        self.holder_finder: HolderFinder = holder_finder if holder_finder is not None else self._find_holders
        self.start_sampler = start_sampler
        self.started_sampler = False  # holds a claim on the monitor's sampler
        self._lock = threading.Lock()
        self._history: deque[CellRecord] = deque(maxlen=max(1, history_size))
        self._count = 0
        self._active: list[ActiveCell] = []  # more than one only for concurrent (nested or threaded) blocks
        self._runs: OrderedDict[str, deque[dict[int, int]]] = OrderedDict()
        self._run_counts: dict[str, int] = {}
        self._baseline: dict[str, HeldVariable] = {}
        self._baseline_label = ""
        self._baseline_signatures: dict[str, tuple[int, int]] | None = None
        self.walks = {"full": 0, "changed names": 0}
        self.incremental = True  # automatic mode walks only the names whose value changed
        self._resets = _RESETS
        self._listeners: list[Callable[[CellRecord], None]] = []
        self._listening = False
        self._closed = False

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
            self._runs.clear()
            self._run_counts.clear()

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
            for cell in self._active:
                cell.finished = True
            self._active.clear()
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
        if not concurrent:
            for stale in self._active_cells():
                self.end(stale, error=RuntimeError("the end of this cell was never reported"))
        cell = ActiveCell(source, options, execution_count)
        with _running_lock:
            _running.add(cell)
        if not options.keep_peaks and _others_running(cell):
            options = cell.options = options._replace(keep_peaks=True)
        try:
            if options.attribute and options.mode == "magic" and namespace is not None:
                cell.baseline = self._attribute(namespace, options.devices, None)
                self._baseline_signatures = _signatures(namespace)
            source_ = self.monitor.source
            start = self.monitor.snapshot()
            self._ensure_sampling()
            reset: list[int] = []
            if not options.keep_peaks:
                reset = [
                    reading.device
                    for reading in start.allocator
                    if _selected(reading.device, options.devices)
                    and (
                        reading.peak_allocated_bytes > reading.allocated_bytes
                        or reading.peak_reserved_bytes > reading.reserved_bytes
                    )
                ]
                if reset:
                    try:
                        source_.reset_peaks(reset)
                    except Exception:
                        reset = []
            cell.start = start
            cell.reset_devices = frozenset(reset)
            self._resets.install()
            cell.resets_at_start = self._resets.snapshot()
            cell.take_sample(start)
            if execution_count is not None:
                self.monitor.mark(f"[{execution_count}]", start.monotonic_s)
            with self._lock:
                self._active.append(cell)
        except BaseException:
            cell.finished = True  # a start that failed must not keep other cells from resetting peaks
            raise
        cell.started_perf_s = time.perf_counter()
        return cell

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
        end = self.monitor.snapshot()
        with self._lock:
            cell.finished = True
            if cell in self._active:
                self._active.remove(cell)
        cell.take_sample(end)
        start = cell.start
        assert start is not None
        options = (options or cell.options)._replace(keep_peaks=cell.options.keep_peaks)
        status, error_text = classify_error(error)
        count = execution_count if execution_count is not None else cell.execution_count
        devices = self._device_changes(cell, start, end, options)
        host = _host_change(cell, start, end)
        warnings: list[CellWarning] = []
        for change in devices:
            if change.peak_note == PEAK_RESET_NOTE:
                warnings.append(CellWarning("peak-reset", f"cuda:{change.device}: {PEAK_RESET_NOTE}"))
        warnings += self._capacity_warnings(devices, end)
        key = source_key(cell.source)
        warnings += self._leak_warnings(key, devices, status)
        variables: tuple[VariableChange, ...] = ()
        variables_note = ""
        if devices and namespace is not None and self._should_attribute(options, devices):
            variables, variables_note, graph = self._variable_changes(cell, namespace, options, count, devices, hidden)
            warnings += graph
        elif not devices:
            variables_note = "no CUDA device in use"
        elif options.attribute is False:
            variables_note = "variables not inspected (turned off)"
        elif namespace is None:
            variables_note = "variables not inspected (no namespace)"
        else:
            variables_note = (
                f"variables not inspected: CUDA allocated memory changed by less than "
                f"{format_bytes(self.attribute_threshold_bytes)}"
            )
        cuda_note = self._cuda_note(options, devices, end)
        with self._lock:
            self._count += 1
            record = CellRecord(
                serial=self._count,
                execution_count=count,
                first_line=first_line_of(cell.source),
                source_hash=key,
                started_wall_s=cell.started_wall_s,
                duration_s=duration_s,
                status=status,
                error=error_text,
                devices=devices,
                host=host,
                variables=variables,
                variables_note=variables_note,
                warnings=tuple(warnings),
                cuda_note=cuda_note,
                keep_peaks=options.keep_peaks,
                mode=options.mode,
                quiet=options.quiet,
            )
            self._history.append(record)
        self._resets.release()
        for listener in list(self._listeners):
            try:
                listener(record)
            except Exception:
                self._listeners.remove(listener)
        return record

    # Internals ------------------------------------------------------------------------------------
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

    def _device_changes(
        self, cell: ActiveCell, start: Snapshot, end: Snapshot, options: CellOptions
    ) -> tuple[DeviceChange, ...]:
        changes: list[DeviceChange] = []
        for after in end.allocator:
            device = after.device
            before = start.allocator_for(device)
            if not _selected(device, options.devices):
                continue
            if options.devices is None and not _in_use(before, after):
                continue
            changes.append(self._device_change(cell, device, before, after, start, end))
        return tuple(changes)

    def _device_change(
        self,
        cell: ActiveCell,
        device: int,
        before: AllocatorReading | None,
        after: AllocatorReading,
        start: Snapshot,
        end: Snapshot,
    ) -> DeviceChange:
        allocated_before = before.allocated_bytes if before is not None else 0
        reserved_before = before.reserved_bytes if before is not None else 0
        sampled_allocated = max(cell.sampled_allocated.get(device, 0), allocated_before, after.allocated_bytes)
        sampled_reserved = max(cell.sampled_reserved.get(device, 0), reserved_before, after.reserved_bytes)
        counter_consistent = (
            after.peak_allocated_bytes >= sampled_allocated and after.peak_reserved_bytes >= sampled_reserved
        )
        # The counter covers exactly this cell when it started at the cell's own level: CUDA was
        # initialized inside the cell, the tracker reset it, or it had never risen above current use.
        counter_is_cells = (
            before is None
            or device in cell.reset_devices
            or (
                before.peak_allocated_bytes == before.allocated_bytes
                and before.peak_reserved_bytes == before.reserved_bytes
            )
        )
        before_resets = cell.resets_at_start.get(device, 0) + cell.resets_at_start.get(None, 0)
        reset_in_cell = self._resets.count(device) > before_resets
        if reset_in_cell:
            # What the counter says now happened after the reset, inside the cell: a lower bound too.
            exact, note = False, PEAK_RESET_NOTE
            sampled_allocated = max(sampled_allocated, after.peak_allocated_bytes)
            sampled_reserved = max(sampled_reserved, after.peak_reserved_bytes)
        elif counter_is_cells:
            exact = counter_consistent
            note = "" if exact else PEAK_RESET_NOTE
        else:
            # Kept counters: exact only if the counter rose above its value at the start (then it rose in the cell).
            assert before is not None
            rose = after.peak_allocated_bytes > before.peak_allocated_bytes
            exact = rose and counter_consistent
            if exact:
                note = ""
            elif after.peak_allocated_bytes < before.peak_allocated_bytes or not counter_consistent:
                note = PEAK_RESET_NOTE
            else:
                note = KEPT_PEAK_NOTE
        peak_allocated = after.peak_allocated_bytes if exact else sampled_allocated
        peak_reserved = max(after.peak_reserved_bytes, sampled_reserved) if exact else sampled_reserved
        used_before = start.device_for(device)
        used_after = end.device_for(device)
        total = used_after.total_bytes if used_after is not None else None
        return DeviceChange(
            device=device,
            allocated_before_bytes=allocated_before,
            allocated_after_bytes=after.allocated_bytes,
            reserved_before_bytes=reserved_before,
            reserved_after_bytes=after.reserved_bytes,
            peak_allocated_bytes=peak_allocated,
            peak_exact=exact,
            peak_note=note,
            peak_reserved_bytes=peak_reserved,
            used_before_bytes=used_before.used_bytes if used_before is not None else None,
            used_after_bytes=used_after.used_bytes if used_after is not None else None,
            total_bytes=total,
            initialized_in_cell=before is None,
        )

    def _cuda_note(self, options: CellOptions, devices: Sequence[DeviceChange], end: Snapshot) -> str | None:
        """Why a requested device, or any device, is missing from the report (None: nothing is missing)."""
        if options.devices is not None:
            shown = {change.device for change in devices}
            missing = ", ".join(f"cuda:{d}" for d in options.devices if d not in shown)
            if not missing:
                return None
            visible = sorted(reading.device for reading in end.allocator)
            if visible:  # CUDA is initialized, so the allocator lists every device this process can use
                return f"{missing}: no such device; this process sees {describe_devices(visible)}"
            return f"{missing}: not initialized in this process (no PyTorch tensor has been put there)"
        if devices:
            return None
        try:
            torch_status = self.monitor.status().get("torch", "unavailable")
        except Exception as error:
            torch_status = f"unavailable: {type(error).__name__}: {error}"
        if torch_status == "ok":
            return "CUDA is initialized but no device has allocated memory"
        return "CUDA is not in use: " + torch_status.removeprefix("unavailable: ")

    def _capacity_warnings(self, devices: Sequence[DeviceChange], end: Snapshot) -> list[CellWarning]:
        warnings: list[CellWarning] = []
        for change in devices:
            reading = end.device_for(change.device)
            if reading is not None and reading.total_bytes > 0:
                fraction = reading.used_bytes / reading.total_bytes
                if fraction >= self.capacity_fraction:
                    warnings.append(
                        CellWarning(
                            "capacity",
                            f"cuda:{change.device} is {fraction:.0%} full after this cell "
                            f"({format_bytes(reading.used_bytes)} of {format_bytes(reading.total_bytes)} used, "
                            "all processes)",
                        )
                    )
            allocator = end.allocator_for(change.device)
            if allocator is not None:
                split = allocator.inactive_split_bytes
                if split >= 1 << 30 and split >= allocator.reserved_bytes // 4:
                    warnings.append(
                        CellWarning(
                            "fragmentation",
                            f"cuda:{change.device}: {format_bytes(split)} of the "
                            f"{format_bytes(allocator.reserved_bytes)} reserved is split into unusable fragments; "
                            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before CUDA starts) avoids this",
                        )
                    )
        return warnings

    def _leak_warnings(self, key: str, devices: Sequence[DeviceChange], status: str) -> list[CellWarning]:
        with self._lock:
            self._run_counts[key] = self._run_counts.get(key, 0) + 1
            runs_total = self._run_counts[key]
            if status != STATUS_OK or not devices:
                return []
            runs = self._runs.get(key)
            if runs is None:
                runs = deque(maxlen=max(2, self.leak_runs))
                self._runs[key] = runs
                if len(self._runs) > 1_000:
                    stale, _ = self._runs.popitem(last=False)
                    self._run_counts.pop(stale, None)
            else:
                self._runs.move_to_end(key)
            runs.append({change.device: change.allocated_delta_bytes for change in devices})
            recent = list(runs)[-self.leak_runs :]
        if len(recent) < self.leak_runs:
            return []
        warnings: list[CellWarning] = []
        for change in devices:
            deltas = [run.get(change.device) for run in recent]
            growth = [d for d in deltas if d is not None]
            if len(growth) < self.leak_runs or min(growth) < self.leak_min_bytes:
                continue
            typical = statistics.median(growth)
            if max(growth) - min(growth) > self.leak_tolerance * typical:
                continue
            each = ", ".join(format_delta(d) for d in growth)
            warnings.append(
                CellWarning(
                    "leak",
                    f"possible leak on re-run: this cell has run {runs_total} times and each of the last "
                    f"{len(growth)} runs left cuda:{change.device} allocated memory higher by about "
                    f"{format_bytes(typical)} ({each}); something it creates outlives the cell "
                    "(a list it appends to, a cache, or IPython's Out history)",
                )
            )
        return warnings

    def _should_attribute(self, options: CellOptions, devices: Sequence[DeviceChange]) -> bool:
        if options.attribute is not None:
            return options.attribute
        return any(abs(change.allocated_delta_bytes) >= self.attribute_threshold_bytes for change in devices)

    def _find_holders(self, namespace: Mapping[str, Any], device: str, names: Collection[str] | None) -> Any:
        from gpumem.core.holders import find_holders

        if names is None:
            return find_holders(namespace, device=device, source=self.monitor.source)
        return find_holders(namespace, device=device, source=self.monitor.source, names=names, include_hidden=False)

    def _attribute(
        self, namespace: Mapping[str, Any], devices: tuple[int, ...] | None, names: Collection[str] | None
    ) -> _Attribution:
        device = f"cuda:{devices[0]}" if devices is not None and len(devices) == 1 else "cuda"
        try:
            report = self.holder_finder(namespace, device, names)
        except KeyboardInterrupt:
            # Ctrl-C while gpumem walks the namespace (the user's code is not running): stop the walk only.
            return _Attribution({}, "inspection interrupted", False)
        except ImportError as error:
            return _Attribution({}, f"variable attribution unavailable: {error}", False)
        except Exception as error:
            return _Attribution({}, f"variable attribution failed: {type(error).__name__}: {error}", False)
        self.walks["full" if names is None else "changed names"] += 1
        held = _held_variables(report)
        if devices is not None and len(devices) > 1:
            wanted = {f"cuda:{d}" for d in devices}
            held = [h for h in held if wanted.intersection(h.device.split(","))]
        note = ""
        if getattr(report, "truncated", False):
            note = "the namespace walk stopped early (too many objects); the list may be incomplete"
        return _Attribution({h.name: h for h in held}, note, True)

    def _walk(
        self,
        namespace: Mapping[str, Any],
        options: CellOptions,
        devices: Sequence[DeviceChange],
        hidden: Mapping[str, Any] | None,
    ) -> _Attribution:
        """Who holds what now. In automatic mode only the names whose value changed are walked, unless
        that leaves most of the cell's growth unexplained (memory grew inside an unchanged object)."""
        signatures = _signatures(namespace)
        previous = self._baseline_signatures
        self._baseline_signatures = signatures
        if options.mode == "magic" or previous is None or not self.incremental:
            return self._attribute(namespace, options.devices, None)
        changed = [name for name, signature in signatures.items() if previous.get(name) != signature]
        if len(changed) > MAX_CHANGED_NAMES:
            return self._attribute(namespace, options.devices, None)
        part = self._attribute(namespace, options.devices, changed)
        if not part.ok:
            return part
        held = {
            name: value
            for name, value in self._baseline.items()
            if (value.hidden or name in signatures) and name not in part.held and name not in changed
        }
        held.update(part.held)
        if hidden:
            extra = self._attribute(hidden, options.devices, list(hidden))
            held.update({name: value._replace(hidden=True) for name, value in extra.held.items()})
        growth = sum(max(change.allocated_delta_bytes, 0) for change in devices)
        explained = sum(
            max(value.nbytes - (self._baseline[name].nbytes if name in self._baseline else 0), 0)
            for name, value in held.items()
            if name in part.held or value.hidden
        )
        if growth >= self.attribute_threshold_bytes and explained < growth // 2:
            return self._attribute(namespace, options.devices, None)
        return _Attribution(held, part.note, True)

    def _variable_changes(
        self,
        cell: ActiveCell,
        namespace: Mapping[str, Any],
        options: CellOptions,
        count: int | None,
        devices: Sequence[DeviceChange],
        hidden: Mapping[str, Any] | None,
    ) -> tuple[tuple[VariableChange, ...], str, list[CellWarning]]:
        attribution = self._walk(namespace, options, devices, hidden)
        if not attribution.ok:
            self._baseline_signatures = None
            return (), attribution.note, []
        if cell.baseline is not None and cell.baseline.ok:
            baseline, since, then = cell.baseline.held, "since the start of the cell", "at the start of the cell"
        elif self._baseline_label:
            baseline, since, then = self._baseline, f"since {self._baseline_label}", f"after {self._baseline_label}"
        else:
            baseline, since, then = {}, "(first inspection)", ""
        changes: list[VariableChange] = []
        for held in attribution.held.values():
            previous = baseline.get(held.name)
            previous_bytes = previous.nbytes if previous is not None else None
            if previous_bytes is None or held.nbytes > previous_bytes:
                changes.append(
                    VariableChange(held.name, held.type_name, held.device, held.nbytes, previous_bytes, held.hidden)
                )
        changes.sort(key=lambda change: (-change.grown_bytes, change.name))
        self._baseline = attribution.held
        label = f"cell [{count}]" if count is not None else "the previous inspection"
        self._baseline_label = label
        grown = {change.name for change in changes}
        graph_paths: list[str] = []
        for held in sorted(attribution.held.values(), key=lambda h: -h.nbytes):
            if held.graph_paths and (options.mode == "magic" or held.name in grown):
                graph_paths.extend(held.graph_paths)
        warnings = [_graph_warning(graph_paths)] if graph_paths else []
        if any(change.hidden for change in changes):
            names = ", ".join(change.name for change in changes if change.hidden)
            warnings.append(
                CellWarning(
                    "output-cache",
                    f"IPython keeps references to {names}: end the cell with ';' or use %gpumem free --deep",
                )
            )
        if changes:
            note = f"new or grown {since}"
        elif then:
            note = f"no variable holds more GPU memory than {then}"
        else:
            note = "no variable holds GPU memory"
        if attribution.note:
            note += f"; {attribution.note}"
        return tuple(changes), note, warnings


def _graph_warning(paths: Sequence[str]) -> CellWarning:
    groups = _group_indexed_paths(paths)
    shown = ", ".join(groups[:3])
    more = f" and {len(groups) - 3} more" if len(groups) > 3 else ""
    what = (
        "keeps its whole autograd graph alive (a CUDA tensor with a grad_fn)"
        if len(paths) == 1
        else "keep their whole autograd graphs alive (CUDA tensors with a grad_fn)"
    )
    return CellWarning(
        "graph", f"{shown}{more} {what}: store `.item()` for a number or `.detach()` for a tensor instead"
    )


_INDEXED = re.compile(r"^(.*)\[(-?\d+)\]$")


def _group_indexed_paths(paths: Sequence[str]) -> list[str]:
    """``losses[0]``, ``losses[1]``, ``losses[2]`` -> ``losses[0]`` ... ``losses[2]`` (3 elements)."""
    groups: list[tuple[str, list[str]]] = []
    for path in paths:
        match = _INDEXED.match(path)
        prefix = match.group(1) if match else None
        if prefix is not None and groups and groups[-1][0] == prefix:
            groups[-1][1].append(path)
        else:
            groups.append((prefix if prefix is not None else "\0" + path, [path]))
    shown: list[str] = []
    for _prefix, members in groups:
        if len(members) >= 3:
            shown.append(f"`{members[0]}` … `{members[-1]}` ({len(members)} elements)")
        else:
            shown.extend(f"`{member}`" for member in members)
    return shown


def _selected(device: int, devices: tuple[int, ...] | None) -> bool:
    return devices is None or device in devices


def _in_use(before: AllocatorReading | None, after: AllocatorReading) -> bool:
    if after.reserved_bytes or after.allocated_bytes or after.peak_allocated_bytes:
        return True
    return before is not None and bool(before.reserved_bytes or before.allocated_bytes)


def _host_change(cell: ActiveCell, start: Snapshot, end: Snapshot) -> HostChange | None:
    if start.host is None or end.host is None:
        return None
    before, after = start.host, end.host
    if after.peak_rss_bytes > before.peak_rss_bytes:
        return HostChange(before.rss_bytes, after.rss_bytes, after.peak_rss_bytes, True)
    sampled = max(cell.sampled_rss, before.rss_bytes, after.rss_bytes)
    return HostChange(before.rss_bytes, after.rss_bytes, sampled, False)


def _held_variables(report: Any) -> list[HeldVariable]:
    """Read a holders report (``holders`` and ``hidden`` lists of Holder-like objects) defensively."""
    held: list[HeldVariable] = []
    for hidden, holders in ((False, getattr(report, "holders", ())), (True, getattr(report, "hidden", ()))):
        for holder in _iterable(holders):
            name = str(getattr(holder, "name", "?"))
            device = getattr(holder, "device", "")
            device_text = f"cuda:{device}" if isinstance(device, int) else str(device or "")
            paths = getattr(holder, "graph_paths", ()) or ()
            held.append(
                HeldVariable(
                    name=name,
                    type_name=str(getattr(holder, "type_name", "")),
                    device=device_text,
                    nbytes=int(getattr(holder, "nbytes", 0) or 0),
                    graph_paths=tuple(str(path) for path in paths),
                    hidden=hidden,
                )
            )
    return held


def _iterable(value: Any) -> Iterable[Any]:
    return value if isinstance(value, (list, tuple)) else ()
