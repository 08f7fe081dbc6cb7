"""Reading a window out of the timeline's rings with numpy, and min/max decimation on arrays.

The timeline decides which rows of which level a window takes (see :mod:`gpumem.core.sampling.timeline`);
this module finds them by binary search, copies them out through numpy views of the rings, and
reduces the result to a bounded number of points without dropping any extreme.

The large intermediate arrays of a read live in a :class:`Scratch` kept from one read to the next:
freshly allocated memory of a few hundred KiB costs a page fault per 4 KiB on first touch, which in
the panel's writer thread cost more than the arithmetic (about 400 faults per read for eight GPUs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from gpumem.core.sampling.rings import Ring, Row

__all__ = ["Floats", "Keys", "Points", "Scratch", "decimate", "view"]

Floats = npt.NDArray[np.float64]
_Ints = npt.NDArray[np.int64]
_GRAIN = 8_192  # elements: buffers grow in these steps, so a window that slides by a sample reuses them


class Scratch:
    """Work arrays reused from one read to the next, at most ``keep_bytes`` of them in all.

    A read that needs more gets fresh arrays for the excess (as does ``keep_bytes=0``). Whoever
    holds a scratch uses it from one thread at a time (the timeline: under its lock).
    """

    def __init__(self, keep_bytes: int = 4 << 20) -> None:
        self.keep_bytes = keep_bytes
        self._arrays: dict[str, npt.NDArray[Any]] = {}

    def floats(self, name: str, shape: tuple[int, ...]) -> Floats:
        return self._array(name, shape, np.float64)

    def ints(self, name: str, shape: tuple[int, ...]) -> _Ints:
        return self._array(name, shape, np.int64)

    def flags(self, name: str, shape: tuple[int, ...]) -> npt.NDArray[np.bool_]:
        return self._array(name, shape, np.bool_)

    def positions(self, count: int) -> _Ints:
        """``arange(count)``, kept."""
        found = self._arrays.get("positions")
        if found is None or found.size < count:
            self._arrays.pop("positions", None)
            found = self.ints("positions", (-(-count // _GRAIN) * _GRAIN,))
            found[:] = np.arange(found.size)
        return found[:count]

    def nbytes(self) -> int:
        return sum(found.nbytes for found in self._arrays.values())

    def _array(self, name: str, shape: tuple[int, ...], dtype: type[np.generic]) -> npt.NDArray[Any]:
        """An uninitialised array of ``shape``, reusing the one called ``name`` when it is large enough."""
        size = math.prod(shape)
        found = self._arrays.get(name)
        if found is None or found.size < size or found.dtype != dtype:
            kept = 0 if found is None else found.nbytes
            found = np.empty(-(-size // _GRAIN) * _GRAIN, dtype)
            if found.nbytes + self.nbytes() - kept <= self.keep_bytes:
                self._arrays[name] = found
        return found[:size].reshape(shape)


def view(ring: Ring, index: int) -> Floats:
    """The ring's keys (``index`` -1) or one channel's column as a numpy array sharing their memory."""
    found = ring.views.get(index)
    if found is None:
        found = ring.views[index] = np.frombuffer(ring.keys if index < 0 else ring.columns[index], np.float64)
    return found


class Keys:
    """A level's keys, oldest first: its ring's, then those of the buckets not in the ring yet."""

    def __init__(self, ring: Ring, tail: Sequence[tuple[int, Row]]) -> None:
        self.ring = ring
        self.tail = [key for key, _ in tail]
        self.count = ring.count + len(tail)
        keys = view(ring, -1)
        self.runs = [keys[first:last] for first, last in ring.runs(0, ring.count)]  # each sorted

    def key(self, index: int) -> float:
        ring = self.ring
        return ring.keys[ring.slot(index)] if index < ring.count else self.tail[index - ring.count]

    def first(self, above: Callable[[float], bool], near: float, side: Literal["left", "right"] = "left") -> int:
        """The first row whose key satisfies the monotone ``above`` (``count`` if none).

        A binary search finds ``near`` (a key about where ``above`` starts to hold) and a short walk
        from there makes the answer exact.
        """
        index = 0
        for run in self.runs:
            index += int(run.searchsorted(near, side))
        while index > 0 and above(self.key(index - 1)):
            index -= 1
        while index < self.count and not above(self.key(index)):
            index += 1
        return index


class _Open(NamedTuple):
    """A bucket not in its ring yet (an open one, or one made of finer open ones)."""

    key: int
    row: Row
    span_s: float


class Points:
    """The window being assembled: which rows of which ring, copied out once, in order, by :meth:`arrays`."""

    def __init__(self, picks: Sequence[int], start_s: float, end_s: float) -> None:
        self.picks = picks  # channel indices
        self.start_s = start_s
        self.end_s = end_s
        # (ring, first slot, last slot, bucket span or 0 for raw samples), or a bucket not in a ring yet
        self._parts: list[tuple[Ring, int, int, float] | _Open] = []
        self._size = 0

    @property
    def size(self) -> int:
        """Points per line added so far."""
        return self._size

    def add_samples(self, ring: Ring, lo: int, hi: int) -> None:
        for first, last in ring.runs(lo, hi):
            self._parts.append((ring, first, last, 0.0))
            self._size += last - first

    def add_ring_buckets(self, ring: Ring, lo: int, hi: int, span_s: float) -> None:
        for first, last in ring.runs(lo, hi):
            self._parts.append((ring, first, last, span_s))
            self._size += 2 * (last - first)

    def add_bucket(self, key: int, row: Row, span_s: float) -> None:
        self._parts.append(_Open(key, row, span_s))
        self._size += 2

    def arrays(self, scratch: Scratch) -> tuple[Floats, Floats]:
        """Times and one row of values per picked channel, copied into ``scratch`` (not into new arrays)."""
        times = scratch.floats("times", (self._size,))
        values = scratch.floats("values", (len(self.picks), self._size))
        at = 0
        for part in self._parts:
            if isinstance(part, _Open):  # its two extremes at its start and middle
                key, row, span_s = part
                times[at : at + 2] = (key * span_s, key * span_s + span_s / 2)
                values[:, at : at + 2] = [row[index] for index in self.picks] if self.picks else 0.0
                at += 2
                continue
            ring, first, last, span_s = part
            keys = view(ring, -1)[first:last]
            if span_s:  # each bucket's two extremes, at its start and middle
                first, last = 2 * first, 2 * last
                starts = times[at : at + last - first : 2]
                np.multiply(keys, span_s, out=starts)
                np.add(starts, span_s / 2, out=times[at + 1 : at + last - first : 2])
            else:
                times[at : at + last - first] = keys
            for line, index in enumerate(self.picks):
                values[line, at : at + last - first] = view(ring, index)[first:last]
            at += last - first
        # Buckets that overlap the window are drawn inside it (raw samples already are).
        np.maximum(times, self.start_s, out=times)  # np.clip's bounds, without its Python wrappers
        np.minimum(times, self.end_s, out=times)
        return times, values


def _bucket_starts(times: Floats, buckets: int) -> Any:
    """First indices of ``buckets`` equal stretches of time (empty ones dropped), not of sample count.

    A window mixes raw samples with coarse buckets: split by count, a handful of 30 s buckets would share
    one chunk with thousands of samples, and their extremes be drawn minutes from where they were.
    """
    count = times.size
    width = (times[-1] - times[0]) / buckets
    if not (width > 0 and math.isfinite(width)):
        return np.arange(buckets, dtype=np.int64) * count // buckets
    edges = np.searchsorted(times, times[0] + np.arange(buckets) * width, side="left")
    return np.unique(edges)


def decimate(times: Floats, values: Floats, max_points: int, scratch: Scratch | None = None) -> tuple[Floats, Floats]:
    """At most ``max_points`` per row, in new arrays: per bucket of consecutive samples, its two extremes.

    Each bucket keeps its lowest and highest values that are not NaN (NaN, NaN when it has none) in
    the order they occurred (the first lowest against the last highest), placed at the times of the
    bucket's first and middle samples. ``scratch`` holds the intermediate arrays.
    """
    count = times.size
    if count <= max_points:
        return times.copy(), values.copy()
    scratch = Scratch(keep_bytes=0) if scratch is None else scratch
    starts = _bucket_starts(times, max_points // 2)
    buckets = starts.size
    sizes = np.diff(starts, append=count)
    out_times = np.empty(2 * buckets)
    out_times[0::2] = times[starts]
    out_times[1::2] = times[starts + sizes // 2]
    shape = values.shape
    equal = scratch.flags("equal", shape)
    low = np.minimum.reduceat(values, starts, axis=1)  # faster than fmin, but a NaN makes its bucket's NaN
    high = np.maximum.reduceat(values, starts, axis=1)
    if np.isnan(low).any():  # then skip the NaN (nothing measured)
        low = np.fmin.reduceat(values, starts, axis=1)
        high = np.fmax.reduceat(values, starts, axis=1)
    # Where in each bucket its first lowest and its last highest value are.
    positions, bucket_of = scratch.positions(count), np.repeat(np.arange(buckets), sizes)
    extreme, at = scratch.floats("extreme", shape), scratch.ints("at", shape)
    found = []
    for per_bucket, missing, reduce in ((low, count, np.minimum), (high, -1, np.maximum)):
        np.take(per_bucket, bucket_of, axis=1, out=extreme, mode="clip")
        np.equal(values, extreme, out=equal)
        at.fill(missing)
        np.copyto(at, positions, where=equal)
        found.append(reduce.reduceat(at, starts, axis=1))
    low_first = found[0] <= found[1]
    out_values = np.empty((shape[0], 2 * buckets))
    out_values[:, 0::2] = np.where(low_first, low, high)
    out_values[:, 1::2] = np.where(low_first, high, low)
    return out_times, out_values
