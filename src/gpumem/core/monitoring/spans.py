"""A measured stretch of time and its figures: a cell, a ``gpumem.measure`` block, a segment of a script's
tags and scopes, the panel's "since it opened"; and the one record a measured block leaves (:class:`SpanRecord`).

A stretch follows the process-wide peak rule of :mod:`gpumem.core.monitoring.peaks`: it resets the raised peak
counters when it starts unless its peaks are kept or another measurement runs (then the outer one keeps
its exact peak and this one's peak is exact only if the counter rose above its earlier value), and a reset
by anyone else during the stretch makes its peak a labelled lower bound.

Peaks between points of a script (tags, logged steps, a whole ``gpumem run``) are exact for every stream
of points: the allocator has one peak counter per device and each stream wants the peak since *its own*
previous point, so the counter cannot be reset for one without spoiling the others. One
:class:`IntervalClock` per memory source cuts time into segments at every point of any stream: a segment
is a :class:`Span`, and each stream's figures are its segments combined, exact where each segment is.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import NamedTuple

from gpumem.core.monitoring.peaks import PEAK_RESETS, RUNNING, RunningPeak, cell_peak, reset_raised_peaks
from gpumem.core.readers.readings import AllocatorReading, Snapshot
from gpumem.core.readers.sources import MemorySource, SystemSource

__all__ = [
    "FIRST_TAG_NOTE",
    "CellWarning",
    "DeviceChange",
    "HostChange",
    "IntervalClock",
    "KindChange",
    "Span",
    "SpanRecord",
    "Stream",
    "Stretch",
    "VariableChange",
    "clock_for",
    "counter_changes",
    "first_tag_record",
    "selected",
]

FIRST_TAG_NOTE = "first tag: the counter's value since CUDA started or the counters were last reset"


class DeviceChange(NamedTuple):
    """One CUDA device over a measured stretch. Allocated/reserved are PyTorch's; ``used`` is NVML's whole device."""

    device: int
    allocated_before_bytes: int
    allocated_after_bytes: int
    reserved_before_bytes: int
    reserved_after_bytes: int
    peak_allocated_bytes: int  # highest allocated during the stretch (absolute)
    peak_exact: bool  # from the allocator's counter; False: highest sampled value, a lower bound
    peak_note: str  # why the peak is not exact, or ""
    peak_reserved_bytes: int
    used_before_bytes: int | None  # None: NVML unavailable
    used_after_bytes: int | None
    total_bytes: int | None
    initialized_in_cell: bool  # CUDA was first used on this device inside the stretch
    process_used_after_bytes: int | None = None  # NVML: this process's share of the device at the end
    driver_reserved_after_bytes: int | None = None  # NVML: the driver's own reservation, at the end
    others_used_after_bytes: int | None = None  # NVML: the other processes it lists, summed, at the end

    @property
    def allocated_bytes(self) -> int:
        """Allocated at the end (a tag's or scope's "now")."""
        return self.allocated_after_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.reserved_after_bytes

    @property
    def used_bytes(self) -> int | None:
        return self.used_after_bytes

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
    """This process's resident memory over a measured stretch."""

    rss_before_bytes: int
    rss_after_bytes: int
    peak_rss_bytes: int
    peak_exact: bool  # the lifetime peak rose during the stretch, so it is the stretch's; else sampled, a lower bound

    @property
    def rss_bytes(self) -> int:
        """Resident at the end."""
        return self.rss_after_bytes

    @property
    def rss_delta_bytes(self) -> int:
        return self.rss_after_bytes - self.rss_before_bytes

    @property
    def peak_above_start_bytes(self) -> int:
        return self.peak_rss_bytes - self.rss_before_bytes


STATUS_OK = "ok"
STATUS_ERROR = "error"
STATUS_INTERRUPTED = "interrupted"
STATUS_OUT_OF_MEMORY = "out of memory"
STATUSES = (STATUS_OK, STATUS_ERROR, STATUS_INTERRUPTED, STATUS_OUT_OF_MEMORY)
_ERROR_LIMIT = 200  # characters of an error's description kept in a record


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
    """Something the user should act on; ``kind``: leak, graph, staircase, output-cache, peak-reset, capacity,
    fragmentation."""

    kind: str
    message: str


class KindChange(NamedTuple):
    """One kind (as :data:`gpumem.core.holders.model` names them) before and after a cell."""

    kind: str
    before_bytes: int
    after_bytes: int

    @property
    def delta_bytes(self) -> int:
        return self.after_bytes - self.before_bytes


class SpanRecord(NamedTuple):
    """What one measured block did to memory: a cell or a ``gpumem.measure`` block (``kind`` "cell", kept by
    the cell tracker), a ``Monitor.track`` scope ("scope"), a tag ("tag"), a ``gpumem run`` ("run"). Immutable.

    Every block has the figures of its stretch; the parts only a cell has (its source, the variables that
    grew, warnings, kinds) and only a scope has (its path) keep their defaults elsewhere.
    """

    first_line: str  # a cell's first line of code; the label of a block, scope or tag
    started_wall_s: float
    duration_s: float
    devices: tuple[DeviceChange, ...]
    host: HostChange | None
    status: str = STATUS_OK
    error: str | None = None  # a block left by an exception: its type and message
    kind: str = "cell"
    path: tuple[str, ...] = ()  # a scope's enclosing scopes' labels and its own; (label,) for tags
    monotonic_s: float | None = None  # the end on the timeline's clock; None in exports older than the field
    serial: int = 0  # a cell's 1-based position among this session's measured cells
    execution_count: int | None = None
    source_hash: str = ""
    variables: tuple[VariableChange, ...] = ()
    variables_note: str = ""  # what the variable list means, or why there is none
    warnings: tuple[CellWarning, ...] = ()
    cuda_note: str | None = None  # why no CUDA device is reported, when none is
    keep_peaks: bool = False
    mode: str = "magic"  # "magic": measured on purpose (%%gpumem, gpumem.measure, a scope); "auto"
    quiet: bool = False
    kinds: tuple[KindChange, ...] = ()  # by kind, from the cell's holder walk; empty when none covered it all
    kinds_since: str = ""  # what ``kinds`` compares with: "since the start of the cell", "since cell [3]"
    notes: tuple[str, ...] = ()  # findings worth knowing that call for no action (not warnings)

    @property
    def label(self) -> str:
        return self.first_line

    @property
    def wall_time_s(self) -> float:
        """When it ended (a tag: when it was taken)."""
        return self.started_wall_s + self.duration_s

    @property
    def depth(self) -> int:
        return max(len(self.path) - 1, 0)

    def device(self, index: int) -> DeviceChange | None:
        return next((figures for figures in self.devices if figures.device == index), None)

    def largest_change_bytes(self) -> int:
        """The biggest absolute change of any figure (CUDA allocated/reserved/peak, host RSS)."""
        largest = 0
        for change in self.devices:
            largest = max(
                largest,
                abs(change.allocated_delta_bytes),
                abs(change.reserved_delta_bytes),
                change.peak_above_start_bytes,
            )
        return largest if self.host is None else max(largest, abs(self.host.rss_delta_bytes))


def classify_error(error: BaseException | None) -> tuple[str, str | None]:
    """(status, one-line description). Recognises torch's OutOfMemoryError without importing torch."""
    if error is None:
        return STATUS_OK, None
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    description = f"{type(error).__name__}: {text}" if text else type(error).__name__
    if len(description) > _ERROR_LIMIT:
        description = description[: _ERROR_LIMIT - 1] + "…"
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


def selected(device: int, devices: tuple[int, ...] | None) -> bool:
    """Whether ``device`` is among those asked for (None: every device)."""
    return devices is None or device in devices


def _in_use(before: AllocatorReading | None, after: AllocatorReading) -> bool:
    if after.reserved_bytes or after.allocated_bytes or after.peak_allocated_bytes:
        return True
    return before is not None and bool(before.reserved_bytes or before.allocated_bytes)


class Stretch:
    """A measured stretch of time: its start, the highest values sampled since, and its figures at the end.

    One type serves a measured cell (and a ``gpumem.measure`` block), a segment of a script's tags and
    scopes, and the panel's "since it opened". :meth:`open` takes the start and resets the raised peak
    counters unless the peaks are kept; a stretch never opened (the panel's) resets nothing and takes its
    first sample as its start. :meth:`take_sample` is the one fold of a sample into the running maxima (a
    :class:`~gpumem.core.monitoring.peaks.RunningPeak` per device's allocated memory and for the host's RSS, which
    also watch the peak counters when ``counters``). ``finished`` is what
    :data:`gpumem.core.monitoring.peaks.RUNNING` reads.
    """

    def __init__(self, *, counters: bool = False) -> None:
        self.counters = counters  # watch the shared peak counters at every sample (a stretch that never resets)
        self.finished = False
        self.start: Snapshot | None = None
        self.reset_devices: frozenset[int] = frozenset()
        self.resets_at_start: dict[int | None, int] = {}
        self._lock = threading.Lock()
        self._allocated: dict[int, RunningPeak] = {}
        self._reserved: dict[int, int] = {}
        self._host = RunningPeak()

    def open(self, source: MemorySource, start: Snapshot, *, keep_peaks: bool, devices: tuple[int, ...] | None) -> None:
        """Start at ``start``: reset the raised counters of ``devices`` (None: all) unless ``keep_peaks``,
        and count resets by anyone else from now on."""
        chosen = start.allocator if devices is None else [r for r in start.allocator if r.device in devices]
        reset = [] if keep_peaks else reset_raised_peaks(source, chosen)
        self.start, self.reset_devices = start, frozenset(reset)
        PEAK_RESETS.install()
        self.resets_at_start = PEAK_RESETS.snapshot()

    def take_sample(self, snapshot: Snapshot) -> None:
        """Fold one sample into the running maxima (the sampler's thread and the caller's alike)."""
        counters = self.counters
        with self._lock:
            if self.start is None:
                self.start = snapshot
            for reading in snapshot.allocator:
                device = reading.device
                peak = self._allocated.get(device)
                if peak is None:
                    peak = self._allocated[device] = RunningPeak()
                peak.update(reading.allocated_bytes, reading.peak_allocated_bytes if counters else None)
                if reading.reserved_bytes > self._reserved.get(device, -1):
                    self._reserved[device] = reading.reserved_bytes
            if snapshot.host is not None:
                self._host.update(snapshot.host.rss_bytes, snapshot.host.peak_rss_bytes if counters else None)

    def running_peaks(self) -> tuple[dict[int, RunningPeak], RunningPeak]:
        """Copies of the running peaks (allocated per device, host RSS) that later samples leave alone."""
        with self._lock:
            return {device: peak.copy() for device, peak in self._allocated.items()}, self._host.copy()

    def device_changes(
        self, end: Snapshot, devices: tuple[int, ...] | None = None, *, every: bool = False
    ) -> tuple[DeviceChange, ...]:
        """One change per device asked for; when none was asked for, per device in use (``every``: per
        device the end shows)."""
        start = self.start
        assert start is not None
        changes: list[DeviceChange] = []
        for after in end.allocator:
            if not selected(after.device, devices):
                continue
            before = start.allocator_for(after.device)
            if devices is None and not every and not _in_use(before, after):
                continue
            changes.append(self._device_change(before, after, start, end))
        return tuple(changes)

    def _device_change(
        self, before: AllocatorReading | None, after: AllocatorReading, start: Snapshot, end: Snapshot
    ) -> DeviceChange:
        device = after.device
        allocated_before = before.allocated_bytes if before is not None else 0
        reserved_before = before.reserved_bytes if before is not None else 0
        # No lock: each read is one atomic step, and a sample folded in meanwhile only raises a lower bound.
        running = self._allocated.get(device)
        sampled_allocated = int(running.sampled or 0) if running is not None else 0
        sampled_reserved = self._reserved.get(device, 0)
        peak = cell_peak(
            before,
            after,
            max(sampled_allocated, allocated_before, after.allocated_bytes),
            max(sampled_reserved, reserved_before, after.reserved_bytes),
            reset_at_start=device in self.reset_devices,
            reset_in_cell=PEAK_RESETS.reset_since(device, self.resets_at_start),
        )
        used_before = start.device_for(device)
        used_after = end.device_for(device)
        return DeviceChange(
            device=device,
            allocated_before_bytes=allocated_before,
            allocated_after_bytes=after.allocated_bytes,
            reserved_before_bytes=reserved_before,
            reserved_after_bytes=after.reserved_bytes,
            peak_allocated_bytes=peak.allocated_bytes,
            peak_exact=peak.exact,
            peak_note=peak.note,
            peak_reserved_bytes=peak.reserved_bytes,
            used_before_bytes=used_before.used_bytes if used_before is not None else None,
            used_after_bytes=used_after.used_bytes if used_after is not None else None,
            total_bytes=used_after.total_bytes if used_after is not None else None,
            initialized_in_cell=before is None,
            process_used_after_bytes=used_after.process_used_bytes if used_after is not None else None,
            driver_reserved_after_bytes=used_after.driver_reserved_bytes if used_after is not None else None,
            others_used_after_bytes=used_after.others_used_bytes if used_after is not None else None,
        )

    def host_change(self, end: Snapshot) -> HostChange | None:
        """Resident memory over the stretch; the peak is exact when the lifetime peak rose during it."""
        start = self.start
        if start is None or start.host is None or end.host is None:
            return None
        before, after = start.host, end.host
        if after.peak_rss_bytes > before.peak_rss_bytes:
            return HostChange(before.rss_bytes, after.rss_bytes, after.peak_rss_bytes, True)
        sampled = int(self._host.sampled or 0)
        return HostChange(before.rss_bytes, after.rss_bytes, max(sampled, before.rss_bytes, after.rss_bytes), False)


class Span(Stretch):
    """A segment of a script's tags and scopes, between :meth:`begin` and :meth:`end`."""

    def __init__(self, source: MemorySource, *, keep_peaks: bool = False) -> None:
        super().__init__()
        self.source = source
        self.keep_peaks = keep_peaks
        self._began_perf_s = 0.0
        self._began_wall_s = 0.0

    def begin(self, start: Snapshot | None = None) -> Span:
        """Read the start (or take ``start``) and reset the raised counters unless another measurement runs."""
        keep = RUNNING.add(self) or self.keep_peaks
        try:
            start = start if start is not None else self.source.snapshot()
            self.open(self.source, start, keep_peaks=keep, devices=None)
        except BaseException:
            self.finished = True
            raise
        self._began_perf_s, self._began_wall_s = time.perf_counter(), time.time()
        return self

    def end(self) -> tuple[SpanRecord, Snapshot]:
        """Read the end and build the segment's record; the counter wrapper goes when nothing else is measured."""
        duration_s = time.perf_counter() - self._began_perf_s
        try:
            end = self.source.snapshot()
        finally:
            self.finished = True
        devices = self.device_changes(end, every=True)
        PEAK_RESETS.release()
        figures = (self._began_wall_s, duration_s, devices, self.host_change(end))
        return SpanRecord("", *figures, kind="segment", monotonic_s=end.monotonic_s), end


def counter_changes(snapshot: Snapshot, note: str) -> tuple[DeviceChange, ...]:
    """Each device as ``snapshot`` shows it, its peak the counter's own value (exact, ``note`` says since when)."""
    devices = []
    for reading in snapshot.allocator:
        nvml = snapshot.device_for(reading.device)
        used = nvml.used_bytes if nvml is not None else None
        devices.append(
            DeviceChange(
                reading.device, reading.allocated_bytes, reading.allocated_bytes, reading.reserved_bytes,
                reading.reserved_bytes, reading.peak_allocated_bytes, True, note, reading.peak_reserved_bytes,
                used, used, nvml.total_bytes if nvml is not None else None, False,
            )
        )  # fmt: skip
    return tuple(devices)


def first_tag_record(label: str, snapshot: Snapshot) -> SpanRecord:
    """The first tag has no earlier tag: its peak is the counter's own value, whatever it covers."""
    host = snapshot.host
    host_change = HostChange(host.rss_bytes, host.rss_bytes, host.peak_rss_bytes, True) if host is not None else None
    devices = counter_changes(snapshot, FIRST_TAG_NOTE)
    figures = (snapshot.wall_time_s, 0.0, devices, host_change)
    return SpanRecord(label, *figures, kind="tag", path=(label,), monotonic_s=snapshot.monotonic_s)


def combine(earlier: SpanRecord, later: SpanRecord) -> SpanRecord:
    """One record for two back-to-back spans: the start of the first, the end of the second, the higher peak.

    Exact only where both peaks are; a device that appeared in the second span alone keeps its figures.
    """
    devices = []
    for second in later.devices:
        first = earlier.device(second.device)
        if first is None:
            devices.append(second)
            continue
        exact = first.peak_exact and second.peak_exact
        devices.append(
            second._replace(
                allocated_before_bytes=first.allocated_before_bytes,
                reserved_before_bytes=first.reserved_before_bytes,
                used_before_bytes=first.used_before_bytes,
                initialized_in_cell=first.initialized_in_cell or second.initialized_in_cell,
                peak_allocated_bytes=max(first.peak_allocated_bytes, second.peak_allocated_bytes),
                peak_reserved_bytes=max(first.peak_reserved_bytes, second.peak_reserved_bytes),
                peak_exact=exact,
                peak_note="" if exact else (first.peak_note or second.peak_note),
            )
        )
    host = later.host
    if host is not None and earlier.host is not None:
        host = host._replace(
            rss_before_bytes=earlier.host.rss_before_bytes,
            peak_rss_bytes=max(earlier.host.peak_rss_bytes, host.peak_rss_bytes),
            peak_exact=(host.peak_exact and host.peak_rss_bytes >= earlier.host.peak_rss_bytes)
            or (earlier.host.peak_exact and earlier.host.peak_rss_bytes >= host.peak_rss_bytes),
        )
    return later._replace(
        started_wall_s=earlier.started_wall_s,
        duration_s=earlier.duration_s + later.duration_s,
        devices=tuple(devices),
        host=host,
    )


# ----------------------------------------------------------------------------------------------
# Streams of points on one clock (tags, step metrics, a run)
# ----------------------------------------------------------------------------------------------


class Stream:
    """One kind of point (tags, step metrics, a run); figures run from its previous point to the next."""

    def __init__(self, clock: IntervalClock, name: str, *, keep_peaks: bool = False) -> None:
        self.clock = clock
        self.name = name
        self.keep_peaks = keep_peaks
        self.started = False  # has had a first point
        self.pending: SpanRecord | None = None  # segments since the previous point, combined

    def point(self, label: str) -> SpanRecord:
        """The figures since this stream's previous point (the first: the counters' own values)."""
        return self.clock.point(self, label)

    def close(self) -> None:
        """Stop counting; the clock's open segment ends when no stream is left."""
        self.clock.close(self)


class IntervalClock:
    """Segments of time on one memory source, shared by every stream reading it."""

    def __init__(self, source: MemorySource) -> None:
        self.source = source
        self._lock = threading.RLock()
        self._streams: weakref.WeakSet[Stream] = weakref.WeakSet()
        self._segment: Span | None = None

    def stream(self, name: str, *, keep_peaks: bool = False) -> Stream:
        return Stream(self, name, keep_peaks=keep_peaks)

    @property
    def segment(self) -> Span | None:
        return self._segment

    def take_sample(self, snapshot: Snapshot) -> None:
        """A sampler's sample, for the sampled lower bounds when a peak cannot be exact."""
        segment = self._segment
        if segment is not None and not segment.finished:
            segment.take_sample(snapshot)

    def point(self, stream: Stream, label: str) -> SpanRecord:
        with self._lock:
            end = self._end_segment() or self.source.snapshot()
            if stream.started and stream.pending is not None:
                result = stream.pending._replace(first_line=label, kind="tag", path=(label,))
            else:
                result = first_tag_record(label, end)
            stream.started, stream.pending = True, None
            self._streams.add(stream)
            self._begin_segment(end)
            return result

    def close(self, stream: Stream) -> None:
        with self._lock:
            self._streams.discard(stream)
            stream.started, stream.pending = False, None
            if not any(other.started for other in self._streams):
                segment, self._segment = self._segment, None
                if segment is not None and not segment.finished:
                    segment.end()

    def _end_segment(self) -> Snapshot | None:
        """End the open segment and hand its figures to every started stream; the end's snapshot."""
        segment, self._segment = self._segment, None
        if segment is None or segment.finished:
            return None
        record, end = segment.end()
        for other in list(self._streams):
            if other.started:
                other.pending = record if other.pending is None else combine(other.pending, record)
        return end

    def _begin_segment(self, start: Snapshot) -> None:
        keep = any(stream.keep_peaks for stream in self._streams if stream.started)
        self._segment = Span(self.source, keep_peaks=keep).begin(start)


_clocks_lock = threading.Lock()
_system_clock: IntervalClock | None = None
_clocks: weakref.WeakKeyDictionary[object, IntervalClock] = weakref.WeakKeyDictionary()


def clock_for(source: MemorySource) -> IntervalClock:
    """The clock of ``source``: one for the whole process on the real counters, one per fake source."""
    global _system_clock
    with _clocks_lock:
        if isinstance(source, SystemSource):
            if _system_clock is None:
                _system_clock = IntervalClock(source)
            return _system_clock
        try:
            clock = _clocks.get(source)
            if clock is None:
                clock = _clocks[source] = IntervalClock(source)
        except TypeError:  # a source that cannot be weakly referenced gets its own clock
            return IntervalClock(source)
        return clock
