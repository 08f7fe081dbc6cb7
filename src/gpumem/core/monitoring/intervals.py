"""Peaks between points of a script (tags, logged steps, a whole ``gpumem run``), exact for every stream.

The allocator has one peak counter per device. Tags, step metrics and the run report each want the peak
since *their own* previous point, so the counter cannot be reset for one without spoiling the others.
One clock per memory source cuts time into segments at every point of any stream: a segment is a
:class:`~gpumem.core.monitoring.spans.Span` (its peak exact by the rule of :mod:`gpumem.core.monitoring.peaks`),
and each stream's figures are its segments combined, exact where each segment is.
"""

from __future__ import annotations

import threading
import weakref

from gpumem.core.monitoring.spans import Span, SpanRecord, combine, first_tag_record
from gpumem.core.readers.readings import Snapshot
from gpumem.core.readers.sources import MemorySource, SystemSource

__all__ = ["IntervalClock", "Stream", "clock_for"]


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
                result = stream.pending._replace(label=label, path=(label,))
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
                    segment.end("", "segment", ())

    def _end_segment(self) -> Snapshot | None:
        """End the open segment and hand its figures to every started stream; the end's snapshot."""
        segment, self._segment = self._segment, None
        if segment is None or segment.finished:
            return None
        record, end = segment.end("", "segment", ())
        for other in list(self._streams):
            if other.started:
                other.pending = record if other.pending is None else combine(other.pending, record, other.name)
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
