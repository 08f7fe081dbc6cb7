"""Bounded, multi-resolution history of samples, and min/max decimation that never drops a peak.

Recent samples are kept as they came; older ones survive as per-bucket minima and maxima at
coarser resolutions, so a long session stays within a fixed memory budget and every peak that
was ever sampled is still visible at every zoom level.

The levels form a cascade: the first aggregated level takes every sample, and each coarser level
takes the closed buckets of the level below it. A coarse bucket is therefore exactly a union of
finer ones, and a hand-over between two levels always falls on an edge both of them share. A
window is read, stretch by stretch, from the finest level that still holds all of that stretch;
the bucket that straddles a hand-over is taken whole from the coarser level, so nothing the finer
level has already lost goes missing. A read that would give too many points may ask for a coarser
resolution: it then starts from the coarsest level whose buckets are no longer than that (whose
closed and open buckets, with what the finer open buckets hold, cover everything up to the newest
sample), and skips the finer ones.

Storage is preallocated per level (:mod:`gpumem.core.sampling.rings`): a ring of float64 keys and a float64
column per channel, so that appending writes scalars. Windows are read through numpy views of those
rings and decimated with numpy (:mod:`gpumem.core.sampling.windows`, imported on the first read: loading the
extension imports no numpy).
"""

from __future__ import annotations

import math
import numbers
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from gpumem.core.sampling.rings import Bucket, Ring, Row

if TYPE_CHECKING:
    from gpumem.core.sampling.windows import Floats, Points, Scratch

__all__ = ["DEFAULT_LEVELS", "ArraySeries", "Level", "Mark", "Series", "Timeline", "decimate_min_max"]

_NAN = math.nan
_MIN_POINTS = 4  # two buckets of two extremes each


class Level(NamedTuple):
    """One resolution: buckets ``span_s`` long (0 keeps raw samples), at most ``capacity`` of them."""

    span_s: float
    capacity: int


# 9,000 raw samples (2.5 h at the sampler's default 1 Hz, 15 min at 10 Hz), 6 h at 1 s, 7 days at 30 s.
DEFAULT_LEVELS: tuple[Level, ...] = (Level(0.0, 9_000), Level(1.0, 21_600), Level(30.0, 20_160))


class Series(NamedTuple):
    """Points ready to plot: shared times (monotonic seconds) and one list of values per channel."""

    times: list[float]
    values: dict[str, list[float]]


class ArraySeries(NamedTuple):
    """A window as arrays: shared times, and one row of ``values`` per name in ``channels``."""

    times: Floats  # float64, monotonic seconds
    values: Floats  # float64, shape (len(channels), len(times)); NaN where a channel has no value
    channels: tuple[str, ...]


class Mark(NamedTuple):
    """A labelled instant, such as the start of a measured cell."""

    time_s: float
    label: str


class _Stretch(NamedTuple):
    """One level's part of a window: rows whose key at level ``lower[0]`` is above ``lower[1]``."""

    level: int
    lower: tuple[int, float] | None  # None: everything the level holds, back to its oldest row


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
        self._rings = [Ring(level.capacity, 1 if level.span_s == 0 else 2) for level in levels]
        self._open: list[Bucket | None] = [None] * len(levels)
        self._channels: list[str] = []
        self._index: dict[str, int] = {}  # channel name -> its column in every ring
        self._marks: deque[Mark] = deque(maxlen=max_marks)
        self._last_time = -math.inf
        self._scratch: Scratch | None = None  # a read's work arrays, kept for the next read (made by the first)
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
        for value in values.values():
            if type(value) is not float and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
                _refuse(values)
        with self._lock:
            if time_s < self._last_time:
                raise ValueError("samples must be appended in time order")
            self._last_time = time_s
            if not self._index.keys() >= values.keys():
                self._add_channels(values)
            raw = self._rings[0]
            slot = raw.claim(time_s)
            if len(self._levels) == 1:
                for name, column in zip(self._channels, raw.columns, strict=True):
                    column[slot] = values.get(name, _NAN)
                return
            key = math.floor(time_s / self._levels[1].span_s)
            bucket = self._open[1]
            if bucket is None or bucket.key != key:
                if bucket is not None:
                    self._close(1)
                bucket = self._open[1] = Bucket(key, len(self._channels))
            bucket.record(slot, values, self._channels, raw.columns)

    def _add_channels(self, values: Mapping[str, float]) -> None:
        for name in values:
            if name not in self._index:
                self._index[name] = len(self._channels)
                self._channels.append(name)
                for ring in self._rings:
                    ring.add_channel()
        for bucket in self._open:
            if bucket is not None:
                bucket.widen(len(self._channels))

    def _close(self, index: int) -> None:
        """Store level ``index``'s open bucket and hand it to the next coarser level's open bucket."""
        bucket = self._open[index]
        assert bucket is not None
        self._open[index] = None
        row = bucket.row()
        self._rings[index].push_row(bucket.key, row)
        if index + 1 == len(self._levels):
            return
        key = self._key_above(index + 1, bucket.key)
        coarse = self._open[index + 1]
        if coarse is not None and coarse.key != key:
            self._close(index + 1)
            coarse = None
        if coarse is None:
            coarse = self._open[index + 1] = Bucket(key, len(self._channels))
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
            return ring.keys[slot], {
                name: column[slot] for name, column in zip(self._channels, ring.columns, strict=True)
            }

    def window(
        self,
        start_s: float = -math.inf,
        end_s: float = math.inf,
        max_points: int = 2_000,
        channels: Sequence[str] | None = None,
        *,
        resolution_s: float = 0.0,
    ) -> Series:
        """Samples in ``[start_s, end_s]`` at the finest resolution kept, at most ``max_points`` per line.

        Buckets that overlap the window count whole, their points placed inside it. ``channels``
        picks the lines to read (those the timeline has, in that order); None reads them all.
        When the finest levels would give more than ``max_points``, ``resolution_s`` lets the read
        take, for every stretch of time, the coarsest level whose buckets are at most that long (two
        points per bucket, its extremes in order) instead: a window that then fits in ``max_points``
        is read without decimating. Windows that fit as they are keep every sample's own time.
        """
        arrays = self.window_arrays(start_s, end_s, max_points, channels, resolution_s=resolution_s)
        rows = arrays.values.tolist()
        return Series(arrays.times.tolist(), dict(zip(arrays.channels, rows, strict=True)))

    def window_arrays(
        self,
        start_s: float = -math.inf,
        end_s: float = math.inf,
        max_points: int = 2_000,
        channels: Sequence[str] | None = None,
        *,
        resolution_s: float = 0.0,
    ) -> ArraySeries:
        """:meth:`window` as numpy arrays, for a caller that computes on them (the panel).

        The arrays are new; the work arrays of the read (up to 4 MiB) are kept for the next one.
        """
        from gpumem.core.sampling.windows import Points, Scratch, decimate

        _check_max_points(max_points)
        if not resolution_s >= 0.0:
            raise ValueError(f"resolution_s must be a number of seconds, at least 0, not {resolution_s!r}")
        first = max(i for i, level in enumerate(self._levels) if level.span_s <= resolution_s)
        if isinstance(channels, str):
            raise TypeError(f"channels must be a sequence of channel names, not the string {channels!r}")
        with self._lock:
            names = self._channels if channels is None else [c for c in dict.fromkeys(channels) if c in self._index]
            # No point is drawn after the newest sample (a bucket's second one is placed at its middle).
            drawn_until_s = max(start_s, min(end_s, self._last_time))
            picks = [self._index[name] for name in names]
            tails = self._tails()
            points = self._gather(0, tails, Points(picks, start_s, drawn_until_s))
            if first and points.size > max_points:  # too many to send as they are: read coarser buckets
                points = self._gather(first, tails, Points(picks, start_s, drawn_until_s))
            if self._scratch is None:
                self._scratch = Scratch()
            times, values = points.arrays(self._scratch)
            times, values = decimate(times, values, max_points, self._scratch)  # new arrays, shared with nothing
            return ArraySeries(times, values, tuple(names))

    def _gather(self, level: int, tails: list[list[tuple[int, Row]]], points: Points) -> Points:
        """Add to ``points`` the rows the window takes, from ``level`` and the coarser levels."""
        plan = self._plan(level)
        for index in reversed(range(len(plan))):
            upper = plan[index - 1].lower if index else None
            self._read(plan[index], upper[1] if upper else None, tails[plan[index].level], points)
        return points

    def _plan(self, level: int) -> list[_Stretch]:
        """Finest first, from ``level`` on: the stretches of time each level supplies (see the module docstring)."""
        plan: list[_Stretch] = []
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

    def _tails(self) -> list[list[tuple[int, Row]]]:
        """Per level, the buckets not in its ring yet: its open bucket and what finer open ones hold."""
        tails: list[list[tuple[int, Row]]] = [[]]
        finer: list[tuple[int, Row]] = []
        for index in range(1, len(self._levels)):
            opened = self._open[index]
            buckets = [opened] if opened is not None else []
            for key, row in finer:
                coarse = self._key_above(index, key)
                if not buckets or buckets[-1].key != coarse:
                    buckets.append(Bucket(coarse, len(self._channels)))
                elif buckets[-1] is opened:  # the level's own open bucket: copied only when rows go in
                    buckets[-1] = opened.copy()
                buckets[-1].add_row(row)
            finer = [(bucket.key, bucket.row()) for bucket in buckets]
            tails.append(finer)
        return tails

    def _read(self, stretch: _Stretch, upper: float | None, tail: list[tuple[int, Row]], points: Points) -> None:
        """Add ``stretch``'s rows (those with a key up to ``upper``) that fall in the window."""
        from gpumem.core.sampling.windows import Keys

        level = stretch.level
        span = self._levels[level].span_s
        reach = self._reach[level]  # a bucket holds samples from its start to before start + reach
        start_s, end_s = points.start_s, points.end_s
        if upper is not None and (upper < start_s if level == 0 else upper * span + reach <= start_s):
            return  # the whole stretch ends before the window
        ring = self._rings[level]
        keys = Keys(ring, tail)
        lo, hi = 0, keys.count
        if stretch.lower is not None:
            coarse, bound = stretch.lower
            near = (bound + 1) * self._levels[coarse].span_s / (self._levels[level].span_s or 1.0)
            lo = keys.first(lambda key: self._key_at(coarse, level, key) > bound, near)
        if upper is not None:
            hi = keys.first(lambda key: key > upper, upper, "right")
        if level == 0:
            lo = max(lo, keys.first(lambda key: key >= start_s, start_s))
            hi = min(hi, keys.first(lambda key: key > end_s, end_s, "right"))
            points.add_samples(ring, lo, hi)
            return
        lo = max(lo, keys.first(lambda key: key * span + reach > start_s, (start_s - reach) / span))
        hi = min(hi, keys.first(lambda key: key * span > end_s, end_s / span))
        points.add_ring_buckets(ring, lo, min(hi, ring.count), span)
        for i in range(max(lo, ring.count), hi):
            points.add_bucket(*tail[i - ring.count], span)

    def store_state(self) -> dict[str, Any]:
        """Every level as stored (rows oldest first), each open bucket, the channels and the marks.

        What an export writes so that :meth:`from_state` rebuilds this store exactly; values are
        plain floats (NaN: not measured). A raw level has one value per row and channel, an
        aggregated level two (the bucket's extremes in the order they occurred).
        """
        with self._lock:
            levels = []
            for level, ring, bucket in zip(self._levels, self._rings, self._open, strict=True):
                order = [ring.slot(index) for index in range(ring.count)]
                width = ring.width
                columns = {
                    name: [column[slot * width + part] for slot in order for part in range(width)]
                    for name, column in zip(self._channels, ring.columns, strict=True)
                }
                opened = None
                if bucket is not None:
                    opened = {"key": bucket.key, "low": list(bucket.low), "high": list(bucket.high),
                              "low_first": list(bucket.low_first)}  # fmt: skip
                keys = [ring.keys[slot] for slot in order]
                levels.append({"span_s": level.span_s, "capacity": level.capacity, "keys": keys,
                               "columns": columns, "evicted": ring.evicted, "open": opened})  # fmt: skip
            return {
                "channels": list(self._channels),
                "last_time_s": None if self._last_time == -math.inf else self._last_time,
                "max_marks": self._marks.maxlen,
                "marks": [[mark.time_s, mark.label] for mark in self._marks],
                "levels": levels,
            }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Timeline:
        """The store :meth:`store_state` described (ValueError, TypeError or KeyError if it is not one)."""
        specs = state["levels"]
        timeline = cls([Level(float(spec["span_s"]), int(spec["capacity"])) for spec in specs], int(state["max_marks"]))
        channels = [str(name) for name in state["channels"]]
        timeline._add_channels(dict.fromkeys(channels, 0.0))
        for ring, spec in zip(timeline._rings, specs, strict=True):
            _fill_ring(ring, spec, channels)
        for index, spec in enumerate(specs):
            opened = spec["open"]
            if opened is not None:
                bucket = timeline._open[index] = Bucket(int(opened["key"]), 0)
                bucket.low, bucket.high = [float(v) for v in opened["low"]], [float(v) for v in opened["high"]]
                bucket.low_first = [bool(v) for v in opened["low_first"]]
                if not len(bucket.low) == len(bucket.high) == len(bucket.low_first) == len(channels):
                    raise ValueError(f"level {index}: the open bucket does not have one value per channel")
        last = state["last_time_s"]
        timeline._last_time = -math.inf if last is None else float(last)
        timeline._marks.extend(Mark(float(time_s), str(label)) for time_s, label in state["marks"])
        return timeline

    def nbytes(self) -> int:
        """Memory held by the stored samples."""
        with self._lock:
            return sum(ring.nbytes() for ring in self._rings)

    def clear(self) -> None:
        with self._lock:
            self._rings = [Ring(ring.capacity, ring.width) for ring in self._rings]
            for ring in self._rings:
                for _ in self._channels:
                    ring.add_channel()
            self._open = [None] * len(self._levels)
            self._marks.clear()
            self._last_time = -math.inf


def _fill_ring(ring: Ring, spec: Mapping[str, Any], channels: Sequence[str]) -> None:
    """Write a level's rows (oldest first) into an empty ring, from slot 0."""
    keys = [float(key) for key in spec["keys"]]
    if len(keys) > ring.capacity:
        raise ValueError(f"{len(keys)} rows for a level of {ring.capacity}")
    for slot, key in enumerate(keys):
        ring.keys[slot] = key
    for name, column in zip(channels, ring.columns, strict=True):
        values = spec["columns"][name]
        if len(values) != len(keys) * ring.width:
            raise ValueError(f"channel {name!r}: {len(values)} values for {len(keys)} rows of {ring.width}")
        for position, value in enumerate(values):
            column[position] = float(value)
    ring.count = len(keys)
    ring.head = len(keys) % ring.capacity
    evicted = spec["evicted"]
    ring.evicted = None if evicted is None else float(evicted)


def decimate_min_max(times: Sequence[float], values: Mapping[str, Sequence[float]], max_points: int) -> Series:
    """Reduce to at most ``max_points`` per line by keeping each bucket's minimum and maximum.

    Each bucket of consecutive samples becomes two points (its extremes, in the order they
    occurred), so the highest and lowest values of the whole range always survive.
    """
    import numpy as np

    from gpumem.core.sampling.windows import decimate

    _check_max_points(max_points)
    names = list(values)
    rows = np.array([values[name] for name in names], np.float64).reshape(len(names), len(times))
    out_times, out_values = decimate(np.asarray(times, np.float64), rows, max_points)
    return Series(out_times.tolist(), dict(zip(names, out_values.tolist(), strict=True)))


def _check_max_points(max_points: int) -> None:
    if max_points < _MIN_POINTS:
        raise ValueError(f"max_points must be at least {_MIN_POINTS}")


def _refuse(values: Mapping[str, object]) -> None:
    """Name the first channel whose value is not a number (the fast check in append only found one)."""
    for name, value in values.items():
        if type(value) is not float and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise TypeError(f"the value of channel {name!r} must be a number, not {value!r}")
