"""Bounded, multi-resolution history of samples, and min/max decimation that never drops a peak.

Recent samples are kept as they came; older ones survive as per-bucket minima and maxima at
coarser resolutions, so a long session stays within a fixed memory budget and every peak that
was ever sampled is still visible at every zoom level.
"""

from __future__ import annotations

import math
import numbers
import threading
from array import array
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

__all__ = ["DEFAULT_LEVELS", "Level", "Mark", "Series", "Timeline", "decimate_min_max"]

_NAN = math.nan


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
    """A fixed-capacity ring of rows: one time column and ``width`` value columns per channel."""

    def __init__(self, capacity: int, width: int) -> None:
        self.capacity = capacity
        self.width = width
        self.times = array("d", [_NAN]) * capacity
        self.columns: dict[str, array[float]] = {}
        self.count = 0
        self.head = 0

    def add_channel(self, name: str) -> None:
        self.columns[name] = array("d", [_NAN]) * (self.capacity * self.width)

    def push(self, time_s: float, values: Mapping[str, Sequence[float]]) -> None:
        slot = self.head
        self.times[slot] = time_s
        base = slot * self.width
        for name, column in self.columns.items():
            row = values.get(name)
            for k in range(self.width):
                column[base + k] = row[k] if row is not None else _NAN
        self.head = (slot + 1) % self.capacity
        self.count = min(self.count + 1, self.capacity)

    def slots(self) -> Iterable[int]:
        start = (self.head - self.count) % self.capacity
        for i in range(self.count):
            yield (start + i) % self.capacity

    def oldest_time(self) -> float | None:
        if self.count == 0:
            return None
        return self.times[(self.head - self.count) % self.capacity]

    def nbytes(self) -> int:
        item = self.times.itemsize
        return item * (len(self.times) + sum(len(c) for c in self.columns.values()))


class _Bucket:
    """The open bucket of an aggregated level: running min and max per channel."""

    def __init__(self, start_s: float) -> None:
        self.start_s = start_s
        self.low: dict[str, float] = {}
        self.high: dict[str, float] = {}
        self.low_first: dict[str, bool] = {}

    def add(self, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            if value != value:  # NaN: nothing measured for this channel at this instant
                continue
            low = self.low.get(name)
            if low is None:
                self.low[name] = self.high[name] = value
                self.low_first[name] = True
                continue
            if value < low:
                self.low[name] = value
                self.low_first[name] = False
            if value > self.high[name]:
                self.high[name] = value
                self.low_first[name] = True

    def rows(self) -> dict[str, tuple[float, float]]:
        """Per channel, the two extremes in the order they occurred."""
        result: dict[str, tuple[float, float]] = {}
        for name, low in self.low.items():
            high = self.high[name]
            result[name] = (low, high) if self.low_first[name] else (high, low)
        return result


class Timeline:
    """Thread-safe store the sampler appends to and the panel reads windows from."""

    def __init__(self, levels: Sequence[Level] = DEFAULT_LEVELS, max_marks: int = 10_000) -> None:
        if not levels or levels[0].span_s != 0.0:
            raise ValueError("the first level must keep raw samples (span_s=0)")
        spans = [level.span_s for level in levels]
        if spans != sorted(spans) or len(set(spans)) != len(spans):
            raise ValueError("levels must have strictly increasing spans")
        self._lock = threading.Lock()
        self._levels = tuple(levels)
        self._rings = [_Ring(level.capacity, 1 if level.span_s == 0 else 2) for level in levels]
        self._open: list[_Bucket | None] = [None] * len(levels)
        self._channels: list[str] = []
        self._marks: deque[Mark] = deque(maxlen=max_marks)
        self._last_time = -math.inf

    @property
    def channels(self) -> list[str]:
        with self._lock:
            return list(self._channels)

    def append(self, time_s: float, values: Mapping[str, float]) -> None:
        """Add one sample; times must not go backwards (a monotonic clock)."""
        if not math.isfinite(time_s):
            raise ValueError(f"time_s must be a finite number of seconds, not {time_s!r}")
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"the value of channel {name!r} must be a number, not {value!r}")
        with self._lock:
            if time_s < self._last_time:
                raise ValueError("samples must be appended in time order")
            self._last_time = time_s
            for name in values:
                if name not in self._channels:
                    self._channels.append(name)
                    for ring in self._rings:
                        ring.add_channel(name)
            self._rings[0].push(time_s, {name: (value,) for name, value in values.items()})
            for index in range(1, len(self._levels)):
                self._aggregate(index, time_s, values)

    def _aggregate(self, index: int, time_s: float, values: Mapping[str, float]) -> None:
        span = self._levels[index].span_s
        bucket = self._open[index]
        if bucket is not None and time_s >= bucket.start_s + span:
            self._rings[index].push(bucket.start_s, bucket.rows())
            bucket = None
        if bucket is None:
            bucket = _Bucket(math.floor(time_s / span) * span)
            self._open[index] = bucket
        bucket.add(values)

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
            slot = (ring.head - 1) % ring.capacity
            return ring.times[slot], {name: column[slot] for name, column in ring.columns.items()}

    def window(self, start_s: float = -math.inf, end_s: float = math.inf, max_points: int = 2_000) -> Series:
        """Samples in ``[start_s, end_s]`` at the finest resolution kept, at most ``max_points`` per line."""
        with self._lock:
            times, values = self._stitch(start_s, end_s)
        return decimate_min_max(times, values, max_points)

    def _stitch(self, start_s: float, end_s: float) -> tuple[list[float], dict[str, list[float]]]:
        """Coarse levels for what finer ones no longer hold, then finer ones, in time order."""
        times: list[float] = []
        values: dict[str, list[float]] = {name: [] for name in self._channels}
        covered_from = math.inf
        pieces: list[tuple[list[float], dict[str, list[float]]]] = []
        for index, ring in enumerate(self._rings):
            oldest = ring.oldest_time()
            if oldest is None:
                continue
            upper = min(end_s, covered_from)
            piece = self._read_ring(index, start_s, upper, exclusive_upper=covered_from <= end_s)
            pieces.append(piece)
            covered_from = min(covered_from, oldest)
            if oldest <= start_s:
                break
        for piece_times, piece_values in reversed(pieces):
            times.extend(piece_times)
            for name in self._channels:
                values[name].extend(piece_values.get(name, [_NAN] * len(piece_times)))
        return times, values

    def _read_ring(
        self, index: int, start_s: float, end_s: float, *, exclusive_upper: bool
    ) -> tuple[list[float], dict[str, list[float]]]:
        ring = self._rings[index]
        span = self._levels[index].span_s
        times: list[float] = []
        values: dict[str, list[float]] = {name: [] for name in ring.columns}
        for slot in ring.slots():
            t = ring.times[slot]
            if t < start_s or t > end_s:
                continue
            if exclusive_upper and t + span > end_s:
                continue  # a finer level holds (part of) this bucket
            if ring.width == 1:
                times.append(t)
                for name, column in ring.columns.items():
                    values[name].append(column[slot])
            else:
                times.extend((t, t + span / 2))
                for name, column in ring.columns.items():
                    values[name].extend((column[2 * slot], column[2 * slot + 1]))
        return times, values

    def nbytes(self) -> int:
        """Memory held by the stored samples."""
        with self._lock:
            return sum(ring.nbytes() for ring in self._rings)

    def clear(self) -> None:
        with self._lock:
            channels = list(self._channels)
            self._rings = [
                _Ring(level.capacity, ring.width) for level, ring in zip(self._levels, self._rings, strict=True)
            ]
            for ring in self._rings:
                for name in channels:
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
    if max_points < 4:
        raise ValueError("max_points must be at least 4")
    if count <= max_points:
        return Series(list(times), {name: list(series) for name, series in values.items()})
    buckets = max_points // 2
    out_times: list[float] = []
    out_values: dict[str, list[float]] = {name: [] for name in values}
    for b in range(buckets):
        lo = b * count // buckets
        hi = (b + 1) * count // buckets
        if hi <= lo:
            continue
        mid = lo + (hi - lo) // 2
        out_times.extend((times[lo], times[mid]))
        for name, series in values.items():
            chunk = series[lo:hi]
            finite = [(v, i) for i, v in enumerate(chunk) if v == v]
            if not finite:
                out_values[name].extend((_NAN, _NAN))
                continue
            low, low_at = min(finite)
            high, high_at = max(finite)
            out_values[name].extend((low, high) if low_at <= high_at else (high, low))
    return Series(out_times, out_values)
