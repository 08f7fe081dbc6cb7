"""Which allocation each free in a cell's trace freed, with numpy: the replay's bookkeeping as arrays.

A cell's trace has 100,000 entries; matching frees to allocations one entry at a time in Python was
most of the analysis. Here the entries are read once into columns and sorted by address (stable, so
each address's entries stay in order); every decision the replay makes depends only on the previous
entry at the same address:

- a ``free_completed`` is skipped when the previous entry at its address is a ``free_requested``
  (the bytes were already counted as freed when the free was requested);
- a free (of those left) freed the allocation before it at its address, if that entry is an alloc,
  and otherwise memory from before the cell;
- an alloc stays alive until the next entry at its address (a free, or an alloc that replaced it).

Pure functions of the entries and the site of each allocation; no torch, no sites.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Columns", "Pairing"]

_KINDS = {"alloc": 0, "free_requested": 1, "free_completed": 2, "oom": 4}
_ALLOC, _REQUESTED, _COMPLETED, _OTHER, _OOM = 0, 1, 2, 3, 4
_LIMIT = 1 << 62  # sums of sizes stay below int64's range
_Ints = npt.NDArray[np.int64]


@dataclass
class Columns:
    """The entries as arrays: kind, address and size per entry, the times as read (ints stay ints)."""

    kinds: npt.NDArray[np.int8]
    addresses: _Ints
    sizes: _Ints
    times: list[Any]
    allocs: npt.NDArray[np.intp]  # the entries that are allocs, in order

    @classmethod
    def read(cls, entries: Sequence[Mapping[str, Any]]) -> Columns | None:
        """None where an entry lacks a key, or an address or size is not an int64 (sizes also >= 0)."""
        try:
            kinds = np.fromiter(
                map(_KINDS.get, map(itemgetter("action"), entries), repeat(_OTHER)), dtype=np.int8, count=len(entries)
            )
            addresses = np.asarray(list(map(itemgetter("addr"), entries)))
            sizes = np.asarray(list(map(itemgetter("size"), entries)))
            times = list(map(itemgetter("time_us"), entries))
        except (KeyError, TypeError, ValueError, OverflowError):
            return None
        if not len(kinds):
            addresses, sizes = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        if addresses.dtype != np.int64 or sizes.dtype != np.int64 or addresses.ndim != 1 or sizes.ndim != 1:
            return None
        if len(sizes) and (sizes.min() < 0 or int(sizes.max()) * len(sizes) >= _LIMIT):
            return None
        return cls(kinds, addresses, sizes, times, np.flatnonzero(kinds == _ALLOC))

    @property
    def failed(self) -> list[int]:
        """The sizes of the allocations that ran out of memory."""
        return self.sizes[self.kinds == _OOM].tolist()  # type: ignore[no-any-return]


def _after(values: npt.NDArray[Any], fill: Any) -> npt.NDArray[Any]:
    """``values`` moved one place later (the first place is ``fill``): each entry's predecessor."""
    moved = np.empty_like(values)
    if len(values):
        moved[0] = fill
        moved[1:] = values[:-1]
    return moved


class Pairing:
    """The events (allocs and the frees that count), each free paired with the allocation it freed."""

    def __init__(self, columns: Columns, sites: Sequence[int], *, before: int) -> None:
        """``sites``: the site of each of ``columns.allocs``, in order; ``before``: the owner of the frees
        of memory allocated before the cell."""
        kinds, addresses, sizes = columns.kinds, columns.addresses, columns.sizes
        count = len(kinds)
        relevant = np.flatnonzero(kinds <= _COMPLETED)
        order = relevant[np.argsort(addresses[relevant], kind="stable")]
        kind, same = kinds[order], _same_as_previous(addresses[order])
        skipped = (kind == _COMPLETED) & same & (_after(kind, _OTHER) == _REQUESTED)
        order = order[~skipped]  # still by address, then entry
        kind, same = kind[~skipped], same[~skipped]
        after_alloc = same & (_after(kind, _OTHER) == _ALLOC)
        frees = kind != _ALLOC
        paired = frees & after_alloc
        source = np.arange(count)  # per entry: the alloc it freed (itself where none)
        source[order[paired]] = _after(order, 0)[paired]
        self.unpaired = np.zeros(count, dtype=bool)
        self.unpaired[order[frees & ~after_alloc]] = True
        site_of = np.full(count, before, dtype=np.int64)  # per entry: the site of its alloc
        site_of[columns.allocs] = np.asarray(sites, dtype=np.int64)
        delta = np.where(kinds == _ALLOC, sizes, -sizes[source])
        owner = site_of[source]
        self.before = before
        self.events = _sorted(order, count)
        self.deltas, self.owners = delta[self.events], owner[self.events]
        self.freed_before = int(sizes[self.unpaired].sum())
        self.source, self.site_of, self.sizes = source, site_of, sizes
        self.paired_frees = _sorted(order[paired], count)
        self.is_alloc = kinds == _ALLOC
        self._chains(order, kind, same, after_alloc, count)

    def _chains(self, order: npt.NDArray[np.intp], kind: npt.NDArray[np.int8], same: npt.NDArray[np.bool_],
                after_alloc: npt.NDArray[np.bool_], count: int) -> None:  # fmt: skip
        """Per alloc: the entry that ends it (``count``: alive at the end) and the entry that put its
        address in the replay's dict of live blocks (an alloc replacing a live one keeps that place)."""
        allocs = kind == _ALLOC
        next_same = np.zeros(len(order), dtype=bool)
        next_same[:-1] = same[1:]
        following = np.full(len(order), count, dtype=np.int64)
        following[:-1] = order[1:]
        self.ends = np.full(count, count, dtype=np.int64)
        self.ends[order[allocs]] = np.where(next_same, following, count)[allocs]
        started = np.where(allocs & ~after_alloc, np.arange(len(order)), 0)
        self.places = np.zeros(count, dtype=np.int64)
        self.places[order[allocs]] = order[np.maximum.accumulate(started)][allocs]

    def alive_after(self, until: int) -> _Ints:
        """The allocs alive just after event ``until`` (-1: none), in the order the replay's dict held them."""
        allocs = self.events[: until + 1]
        allocs = allocs[self.is_alloc[allocs]]
        if until >= 0:
            allocs = allocs[self.ends[allocs] > self.events[until]]
        ordered: _Ints = allocs[np.argsort(self.places[allocs], kind="stable")]
        return ordered

    def temporary(self) -> list[tuple[int, int, int, int, int]]:
        """Per site that the cell freed memory of, in the order of its first free: ``(site, bytes, count,
        largest, the alloc of its largest block)``, the last such alloc freed where several tie."""
        frees = self.paired_frees
        allocs = self.source[frees]
        sites, sizes = self.site_of[allocs], self.sizes[allocs]
        order = np.argsort(sites, kind="stable")
        grouped, sized = sites[order], sizes[order]
        starts = np.flatnonzero(~_same_as_previous(grouped))
        if not len(starts):
            return []
        counts = np.diff(starts, append=len(grouped))
        largest = np.maximum.reduceat(sized, starts)
        at_largest = np.where(sized == np.repeat(largest, counts), np.arange(len(grouped)), -1)
        stacks = allocs[order[np.maximum.reduceat(at_largest, starts)]]
        rank = np.argsort(order[starts], kind="stable")  # by each site's first free
        columns = (grouped[starts], np.add.reduceat(sized, starts), counts, largest, stacks)
        return list(zip(*(column[rank].tolist() for column in columns), strict=True))

    def before_until(self, until: int) -> int:
        """The bytes of events from before the cell up to event ``until``."""
        owners, deltas = self.owners[: until + 1], self.deltas[: until + 1]
        return int(deltas[owners == self.before].sum())

    def peak(self, start: int) -> tuple[int, int] | None:
        """``(peak bytes, the event that first reached it)`` (-1: the start), None where start does not fit."""
        if type(start) is not int or abs(start) >= _LIMIT:
            return None
        totals = np.empty(len(self.deltas) + 1, dtype=np.int64)
        totals[0] = start
        np.cumsum(self.deltas, out=totals[1:])
        totals[1:] += start
        where = int(np.argmax(totals))
        return int(totals[where]), where - 1


def _sorted(entries: npt.NDArray[np.intp], count: int) -> npt.NDArray[np.intp]:
    """Distinct entry numbers below ``count``, in order (by marking them: faster than sorting)."""
    marked = np.zeros(count, dtype=bool)
    marked[entries] = True
    return np.flatnonzero(marked)


def _same_as_previous(values: _Ints) -> npt.NDArray[np.bool_]:
    same = np.zeros(len(values), dtype=bool)
    same[1:] = values[1:] == values[:-1]
    return same
