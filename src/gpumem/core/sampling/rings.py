"""The timeline's storage: preallocated float64 rings, one per level, and the open bucket of each level.

Stdlib arrays rather than numpy arrays: appending a sample writes one scalar per channel, which an
``array.array`` does faster, and importing the timeline (at ``%load_ext``) stays free of numpy.
Windows are read through numpy views of these arrays (:mod:`gpumem.core.sampling.windows`); the arrays are
never resized, so the views stay valid.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["Bucket", "Ring", "Row"]

_NAN = math.nan

# Per channel (in the timeline's channel order), one bucket's two extremes in the order they occurred.
Row = list[tuple[float, float]]


class Ring:
    """A fixed-capacity ring of rows: one key and ``width`` values per channel per row.

    Raw rows are keyed by their time, aggregated rows by their bucket number.
    """

    def __init__(self, capacity: int, width: int) -> None:
        self.capacity = capacity
        self.width = width
        self.keys = array("d", [_NAN]) * capacity
        self.columns: list[array[float]] = []  # in the timeline's channel order
        self.count = 0
        self.head = 0
        self.evicted: float | None = None  # the key of the newest row overwritten; None: nothing lost yet
        self.views: dict[int, npt.NDArray[np.float64]] = {}  # numpy views of keys (-1) and columns, once read

    def add_channel(self) -> None:
        self.columns.append(array("d", [_NAN]) * (self.capacity * self.width))

    def claim(self, key: float) -> int:
        """The slot for a new row keyed ``key``, overwriting the oldest when full."""
        slot = self.head
        if self.count == self.capacity:
            self.evicted = self.keys[slot]
        else:
            self.count += 1
        self.keys[slot] = key
        self.head = slot + 1 if slot + 1 < self.capacity else 0
        return slot

    def push_row(self, key: int, row: Row) -> None:
        base = 2 * self.claim(key)
        for column, (first, second) in zip(self.columns, row, strict=True):
            column[base] = first
            column[base + 1] = second

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
        return item * (len(self.keys) + sum(len(c) for c in self.columns))


class Bucket:
    """The open bucket of an aggregated level: running min and max per channel (NaN: none yet)."""

    __slots__ = ("high", "key", "low", "low_first")

    def __init__(self, key: int, width: int) -> None:
        self.key = key
        self.low = [_NAN] * width
        self.high = [_NAN] * width
        self.low_first = [True] * width

    def widen(self, width: int) -> None:
        grow = width - len(self.low)
        self.low += [_NAN] * grow
        self.high += [_NAN] * grow
        self.low_first += [True] * grow

    def record(
        self, slot: int, values: Mapping[str, float], names: Sequence[str], columns: Sequence[array[float]]
    ) -> None:
        """On the sampler's hot path: write a sample into the raw ``columns`` and take it into this bucket.

        :meth:`add`, inlined: one scalar write and at most three comparisons per channel.
        """
        low, high, low_first, get = self.low, self.high, self.low_first, values.get
        for index, column in enumerate(columns):
            value = column[slot] = get(names[index], _NAN)
            if value < low[index]:
                low[index] = value
                low_first[index] = False
            elif value > high[index]:
                high[index] = value
                low_first[index] = True
            elif low[index] != low[index] and value == value:  # noqa: PLR0124 - the first value not NaN
                low[index] = high[index] = value
                low_first[index] = True

    def add(self, index: int, value: float) -> None:
        """NaN (nothing measured) compares false, so it changes nothing."""
        low = self.low[index]
        if value < low:
            self.low[index] = value
            self.low_first[index] = False
        elif value > self.high[index]:
            self.high[index] = value
            self.low_first[index] = True
        elif low != low and value == value:  # noqa: PLR0124 - the first value that is not NaN
            self.low[index] = self.high[index] = value
            self.low_first[index] = True

    def add_row(self, row: Row) -> None:
        """A finer bucket's two extremes, in their order: the same result as adding all its samples."""
        for index, (first, second) in enumerate(row):
            self.add(index, first)
            self.add(index, second)

    def copy(self) -> Bucket:
        twin = Bucket(self.key, 0)
        twin.low, twin.high, twin.low_first = list(self.low), list(self.high), list(self.low_first)
        return twin

    def row(self) -> Row:
        """Per channel, the two extremes in the order they occurred."""
        pairs = zip(self.low, self.high, self.low_first, strict=True)
        return [(low, high) if first else (high, low) for low, high, first in pairs]
