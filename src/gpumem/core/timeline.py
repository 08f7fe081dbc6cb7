"""Bounded, multi-resolution history of samples, and min/max decimation that never drops a peak.

Recent samples are kept as they came; older ones survive as per-bucket minima and maxima at
coarser resolutions, so a long session stays within a fixed memory budget and every peak that
was ever sampled is still visible at every zoom level.

The levels form a cascade: the first aggregated level takes every sample, and each coarser level
takes the closed buckets of the level below it. A coarse bucket is therefore exactly a union of
finer ones, and a hand-over between two levels always falls on an edge both of them share. A
window is read, stretch by stretch, from the finest level that still holds all of that stretch;
the bucket that straddles a hand-over is taken whole from the coarser level, so nothing the finer
level has already lost goes missing.
"""

from __future__ import annotations

import bisect
import itertools
import math
import numbers
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import filterfalse
from typing import NamedTuple

__all__ = ["DEFAULT_LEVELS", "Level", "Mark", "Series", "Timeline", "decimate_min_max"]

_NAN = math.nan
_MIN_POINTS = 4  # two buckets of two extremes each

# Per channel, one bucket's two extremes in the order they occurred.
_Row = dict[str, tuple[float, float]]


class Level(NamedTuple):
    """One resolution: buckets ``span_s`` long (0 keeps raw samples), at most ``capacity`` of them."""

    span_s: float
    capacity: int


# At 10 Hz: 15 min of raw samples, 6 h at 1 s, 7 days at 30 s.
DEFAULT_LEVELS: tuple[Level, ...] = (Level(0.0, 9_000), Level(1.0, 21_600), Level(30.0, 20_160))


class Series(NamedTuple):
    """Points ready to plot: shared times (monotonic seconds) and one list of values per channel."""

    times: list[float]
    values: dict[str, list[float]]


class Mark(NamedTuple):
    """A labelled instant, such as the start of a measured cell."""

    time_s: float
    label: str


class _Ring:
    """A fixed-capacity ring of rows: one key and ``width`` values per channel per row.

    Raw rows are keyed by their time, aggregated rows by their bucket number.
    """

    def __init__(self, capacity: int, width: int) -> None:
        self.capacity = capacity
        self.width = width
        self.keys = array("d", [_NAN]) * capacity
        self.columns: dict[str, array[float]] = {}
        self.count = 0
        self.head = 0
        self.evicted: float | None = None  # the key of the newest row overwritten; None: nothing lost yet

    def add_channel(self, name: str) -> None:
        self.columns[name] = array("d", [_NAN]) * (self.capacity * self.width)

    def _claim(self, key: float) -> int:
        slot = self.head
        if self.count == self.capacity:
            self.evicted = self.keys[slot]
        else:
            self.count += 1
        self.keys[slot] = key
        self.head = slot + 1 if slot + 1 < self.capacity else 0
        return slot

    def push_sample(self, time_s: float, values: Mapping[str, float]) -> None:
        slot = self._claim(time_s)
        for name, column in self.columns.items():
            column[slot] = values.get(name, _NAN)

    def push_row(self, key: int, row: _Row) -> None:
        base = 2 * self._claim(key)
        for name, column in self.columns.items():
            column[base], column[base + 1] = row.get(name, (_NAN, _NAN))

    def slot(self, index: int) -> int:
        """The slot of the ``index``-th oldest row."""
        return (self.head - self.count + index) % self.capacity

    def runs(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The rows ``lo`` to ``hi - 1`` (oldest first) as at most two contiguous slot ranges."""
        if hi <= lo:
            return []
        first = self.slot(lo)
        last = first + hi - lo
        if last <= self.capacity:
            return [(first, last)]
        return [(first, self.capacity), (0, last - self.capacity)]

    def nbytes(self) -> int:
        item = self.keys.itemsize
        return item * (len(self.keys) + sum(len(c) for c in self.columns.values()))


class _Bucket:
    """The open bucket of an aggregated level: running min and max per channel."""

    __slots__ = ("high", "key", "low", "low_first")

    def __init__(self, key: int) -> None:
        self.key = key
        self.low: dict[str, float] = {}
        self.high: dict[str, float] = {}
        self.low_first: dict[str, bool] = {}

    def add(self, values: Mapping[str, float]) -> None:
        """On the sampler's hot path: NaN (nothing measured) compares false, so it changes nothing."""
        low, high, low_first = self.low, self.high, self.low_first
        for name, value in values.items():
            current = low.get(name)
            if current is None:
                if not math.isnan(value):
                    low[name] = high[name] = value
                    low_first[name] = True
            elif value < current:
                low[name] = value
                low_first[name] = False
            elif value > high[name]:
                high[name] = value
                low_first[name] = True

    def add_row(self, row: _Row) -> None:
        """A finer bucket's two extremes, in their order: the same result as adding all its samples."""
        self.add({name: pair[0] for name, pair in row.items()})
        self.add({name: pair[1] for name, pair in row.items()})

    def copy(self) -> _Bucket:
        twin = _Bucket(self.key)
        twin.low, twin.high, twin.low_first = dict(self.low), dict(self.high), dict(self.low_first)
        return twin

    def rows(self) -> _Row:
        """Per channel, the two extremes in the order they occurred."""
        result: _Row = {}
        for name, low in self.low.items():
            high = self.high[name]
            result[name] = (low, high) if self.low_first[name] else (high, low)
        return result


class _Stretch(NamedTuple):
    """One level's part of a window: rows whose key at level ``lower[0]`` is above ``lower[1]``."""

    level: int
    lower: tuple[int, float] | None  # None: everything the level holds, back to its oldest row


class _Points:
    """The window being assembled: times and one list of values per channel."""

    def __init__(self, channels: Sequence[str], start_s: float, end_s: float) -> None:
        self.times: list[float] = []
        self.values: dict[str, list[float]] = {name: [] for name in channels}
        self.start_s = start_s
        self.end_s = end_s

    def add_samples(self, ring: _Ring, lo: int, hi: int) -> None:
        for first, last in ring.runs(lo, hi):
            self.times.extend(ring.keys[first:last])
            for name, column in ring.columns.items():
                self.values[name].extend(column[first:last])

    def add_ring_buckets(self, ring: _Ring, lo: int, hi: int, span_s: float) -> None:
        for first, last in ring.runs(lo, hi):
            self._add_times(ring.keys[first:last], span_s)
            for name, column in ring.columns.items():
                self.values[name].extend(column[2 * first : 2 * last])

    def add_bucket(self, key: int, row: _Row, span_s: float) -> None:
        self._add_times((key,), span_s)
        for name, series in self.values.items():
            series.extend(row.get(name, (_NAN, _NAN)))

    def _add_times(self, keys: Iterable[float], span_s: float) -> None:
        """A bucket's two extremes go at its start and middle, kept inside the window."""
        half = span_s / 2
        times = [time_s for key in keys for time_s in (key * span_s, key * span_s + half)]
        low, high = self.start_s, self.end_s
        if times and (times[0] < low or times[-1] > high):
            times = [min(max(time_s, low), high) for time_s in times]
        self.times.extend(times)


def _first(count: int, above: Callable[[int], bool]) -> int:
    """The first index in ``range(count)`` where the monotone ``above`` holds (``count`` if none)."""
    lo, hi = 0, count
    while lo < hi:
        mid = (lo + hi) // 2
        if above(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _check_levels(levels: Sequence[Level]) -> None:
    if not levels or levels[0].span_s != 0.0:
        raise ValueError("the first level must keep raw samples (span_s=0)")
    spans = [level.span_s for level in levels]
    if spans != sorted(spans) or len(set(spans)) != len(spans) or not all(math.isfinite(s) for s in spans):
        raise ValueError("levels must have strictly increasing, finite spans")
    if any(level.capacity < 1 for level in levels):
        raise ValueError("every level must hold at least one row")


def _whole_ratio(coarse_s: float, fine_s: float) -> int | None:
    """``coarse_s / fine_s`` when it is a whole number (bucket numbers then map by integer division)."""
    ratio = coarse_s / fine_s
    whole = round(ratio)
    return whole if whole >= 1 and abs(ratio - whole) <= 1e-9 * ratio else None


class Timeline:
    """Thread-safe store the sampler appends to and the panel reads windows from."""

    def __init__(self, levels: Sequence[Level] = DEFAULT_LEVELS, max_marks: int = 10_000) -> None:
        _check_levels(levels)
        self._lock = threading.Lock()
        self._levels = tuple(levels)
        self._rings = [_Ring(level.capacity, 1 if level.span_s == 0 else 2) for level in levels]
        self._open: list[_Bucket | None] = [None] * len(levels)
        self._channels: list[str] = []
        self._known: set[str] = set()
        self._marks: deque[Mark] = deque(maxlen=max_marks)
        self._last_time = -math.inf
        spans = [level.span_s for level in levels]
        # Level i's bucket number from level i-1's, by integer division where the spans allow it.
        self._ratios: list[int | None] = [None, None]
        self._ratios += [_whole_ratio(spans[i], spans[i - 1]) for i in range(2, len(spans))]
        # How far past its start a bucket's samples can reach: its span, unless finer buckets overhang it.
        self._reach = [0.0] * len(levels)
        for i in range(1, len(levels)):
            overhang = self._reach[i - 1] - (spans[i - 1] if self._ratios[i] is not None else 0.0)
            self._reach[i] = spans[i] + overhang

    @property
    def channels(self) -> list[str]:
        with self._lock:
            return list(self._channels)

    def append(self, time_s: float, values: Mapping[str, float]) -> None:
        """Add one sample; times must not go backwards (a monotonic clock)."""
        if not math.isfinite(time_s):
            raise ValueError(f"time_s must be a finite number of seconds, not {time_s!r}")
        for name, value in values.items():
            if type(value) is not float and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
                raise TypeError(f"the value of channel {name!r} must be a number, not {value!r}")
        with self._lock:
            if time_s < self._last_time:
                raise ValueError("samples must be appended in time order")
            self._last_time = time_s
            if not self._known.issuperset(values):
                self._add_channels(values)
            self._rings[0].push_sample(time_s, values)
            if len(self._levels) > 1:
                key = math.floor(time_s / self._levels[1].span_s)
                bucket = self._open[1]
                if bucket is None or bucket.key != key:
                    if bucket is not None:
                        self._close(1)
                    bucket = self._open[1] = _Bucket(key)
                bucket.add(values)

    def _add_channels(self, values: Mapping[str, float]) -> None:
        for name in values:
            if name not in self._known:
                self._known.add(name)
                self._channels.append(name)
                for ring in self._rings:
                    ring.add_channel(name)

    def _close(self, index: int) -> None:
        """Store level ``index``'s open bucket and hand it to the next coarser level's open bucket."""
        bucket = self._open[index]
        assert bucket is not None
        self._open[index] = None
        row = bucket.rows()
        self._rings[index].push_row(bucket.key, row)
        if index + 1 == len(self._levels):
            return
        key = self._key_above(index + 1, bucket.key)
        coarse = self._open[index + 1]
        if coarse is not None and coarse.key != key:
            self._close(index + 1)
            coarse = None
        if coarse is None:
            coarse = self._open[index + 1] = _Bucket(key)
        coarse.add_row(row)

    def _key_above(self, index: int, key: float) -> int:
        """The level-``index`` bucket holding a level-``index - 1`` key (a time, for level 1)."""
        if index == 1:
            return math.floor(key / self._levels[1].span_s)
        ratio = self._ratios[index]
        if ratio is not None:
            return int(key) // ratio
        return math.floor(key * self._levels[index - 1].span_s / self._levels[index].span_s)

    def _key_at(self, index: int, level: int, key: float) -> float:
        """The level-``index`` key of a level-``level`` key (``index >= level``)."""
        for above in range(level + 1, index + 1):
            key = self._key_above(above, key)
        return key

    def add_mark(self, time_s: float, label: str) -> None:
        if not isinstance(label, str):
            raise TypeError(f"a mark's label must be a string, not {label!r}")
        with self._lock:
            self._marks.append(Mark(time_s, label))

    def marks(self, start_s: float = -math.inf, end_s: float = math.inf) -> list[Mark]:
        with self._lock:
            return [mark for mark in self._marks if start_s <= mark.time_s <= end_s]

    def latest(self) -> tuple[float, dict[str, float]] | None:
        """The newest raw sample."""
        with self._lock:
            ring = self._rings[0]
            if ring.count == 0:
                return None
            slot = ring.slot(ring.count - 1)
            return ring.keys[slot], {name: column[slot] for name, column in ring.columns.items()}

    def window(self, start_s: float = -math.inf, end_s: float = math.inf, max_points: int = 2_000) -> Series:
        """Samples in ``[start_s, end_s]`` at the finest resolution kept, at most ``max_points`` per line.

        Buckets that overlap the window count whole, their points placed inside it.
        """
        with self._lock:
            points = _Points(self._channels, start_s, end_s)
            plan = self._plan()
            tails = self._tails()
            for index in reversed(range(len(plan))):
                upper = plan[index - 1].lower if index else None
                self._read(plan[index], upper[1] if upper else None, tails[plan[index].level], points)
        return decimate_min_max(points.times, points.values, max_points)

    def _plan(self) -> list[_Stretch]:
        """Finest first: the stretches of time each level supplies (see the module docstring)."""
        plan: list[_Stretch] = []
        level = 0
        while True:
            lower = self._handover(level)
            plan.append(_Stretch(level, lower))
            if lower is None:
                return plan
            # When the straddling coarse bucket covers all of a finer stretch, skip that level.
            while len(plan) > 1 and self._key_at(lower[0], level, self._upper_key(plan)) <= lower[1]:
                plan.pop()
                level = plan[-1].level
                plan[-1] = _Stretch(level, lower)
            level = lower[0]

    @staticmethod
    def _upper_key(plan: list[_Stretch]) -> float:
        upper = plan[-2].lower
        assert upper is not None
        return upper[1]

    def _handover(self, level: int) -> tuple[int, float] | None:
        """The coarser level (and its bucket) that takes over where ``level`` has lost rows."""
        evicted = self._rings[level].evicted
        if evicted is None:
            return None
        for coarser in range(level + 1, len(self._levels)):
            key = self._key_at(coarser, level, evicted)
            lost = self._rings[coarser].evicted
            if lost is None or key > lost:
                return coarser, key
        return None

    def _tails(self) -> list[list[tuple[int, _Row]]]:
        """Per level, the buckets not in its ring yet: its open bucket and what finer open ones hold."""
        tails: list[list[tuple[int, _Row]]] = [[]]
        finer: list[tuple[int, _Row]] = []
        for index in range(1, len(self._levels)):
            opened = self._open[index]
            buckets = [opened.copy()] if opened is not None else []
            for key, row in finer:
                coarse = self._key_above(index, key)
                if not buckets or buckets[-1].key != coarse:
                    buckets.append(_Bucket(coarse))
                buckets[-1].add_row(row)
            finer = [(bucket.key, bucket.rows()) for bucket in buckets]
            tails.append(finer)
        return tails

    def _read(self, stretch: _Stretch, upper: float | None, tail: list[tuple[int, _Row]], points: _Points) -> None:
        """Add ``stretch``'s rows (those with a key up to ``upper``) that fall in the window."""
        level = stretch.level
        ring = self._rings[level]
        count = ring.count + len(tail)

        def key(i: int) -> float:
            return ring.keys[ring.slot(i)] if i < ring.count else tail[i - ring.count][0]

        lo, hi = 0, count
        if stretch.lower is not None:
            coarse, bound = stretch.lower
            lo = _first(count, lambda i: self._key_at(coarse, level, key(i)) > bound)
        if upper is not None:
            hi = _first(count, lambda i: key(i) > upper)
        if level == 0:
            lo = max(lo, _first(count, lambda i: key(i) >= points.start_s))
            hi = min(hi, _first(count, lambda i: key(i) > points.end_s))
            points.add_samples(ring, lo, hi)
            return
        span = self._levels[level].span_s
        reach = self._reach[level]  # a bucket holds samples from its start to before start + reach
        lo = max(lo, _first(count, lambda i: key(i) * span + reach > points.start_s))
        hi = min(hi, _first(count, lambda i: key(i) * span > points.end_s))
        points.add_ring_buckets(ring, lo, min(hi, ring.count), span)
        for i in range(max(lo, ring.count), hi):
            points.add_bucket(*tail[i - ring.count], span)

    def nbytes(self) -> int:
        """Memory held by the stored samples."""
        with self._lock:
            return sum(ring.nbytes() for ring in self._rings)

    def clear(self) -> None:
        with self._lock:
            self._rings = [_Ring(ring.capacity, ring.width) for ring in self._rings]
            for ring in self._rings:
                for name in self._channels:
                    ring.add_channel(name)
            self._open = [None] * len(self._levels)
            self._marks.clear()
            self._last_time = -math.inf


def decimate_min_max(times: Sequence[float], values: Mapping[str, Sequence[float]], max_points: int) -> Series:
    """Reduce to at most ``max_points`` per line by keeping each bucket's minimum and maximum.

    Each bucket of consecutive samples becomes two points (its extremes, in the order they
    occurred), so the highest and lowest values of the whole range always survive.
    """
    count = len(times)
    if max_points < _MIN_POINTS:
        raise ValueError(f"max_points must be at least {_MIN_POINTS}")
    if count <= max_points:
        return Series(list(times), {name: list(series) for name, series in values.items()})
    buckets = max_points // 2
    out_times: list[float] = []
    out_values: dict[str, list[float]] = {name: [] for name in values}
    edges = _bucket_edges(times, buckets)
    for lo, hi in itertools.pairwise(edges):
        if hi - lo <= _MIN_POINTS // 2:  # no more than its two extremes: the points as they are, at their times
            out_times.extend(times[lo:hi])
            for name, series in values.items():
                out_values[name].extend(series[lo:hi])
            continue
        mid = lo + (hi - lo) // 2
        out_times.extend((times[lo], times[mid]))
        for name, series in values.items():
            out_values[name].extend(_extremes(series[lo:hi]))
    return Series(out_times, out_values)


def _bucket_edges(times: Sequence[float], buckets: int) -> list[int]:
    """Indices splitting ``times`` into ``buckets`` equal stretches of time, not of sample count.

    A window mixes raw samples with coarse buckets: split by count, a handful of 30 s buckets would
    share one chunk with thousands of samples and their extremes be drawn minutes from where they were.
    """
    count, first, last = len(times), times[0], times[-1]
    width = (last - first) / buckets
    if not (width > 0 and math.isfinite(width)):
        return [b * count // buckets for b in range(buckets + 1)]
    edges = [0]
    for b in range(1, buckets):
        edges.append(max(edges[-1], bisect.bisect_left(times, first + b * width, lo=edges[-1])))
    edges.append(count)
    return edges


def _extremes(chunk: Sequence[float]) -> tuple[float, float]:
    """The lowest and highest finite values in the order they occurred (NaN, NaN when none)."""
    finite = list(filterfalse(math.isnan, chunk))
    if not finite:
        return _NAN, _NAN
    low, high = min(finite), max(finite)
    low_at = chunk.index(low)
    high_at = len(chunk) - 1 - chunk[::-1].index(high)
    return (low, high) if low_at <= high_at else (high, low)
