"""``%%gpumem --profile``'s recorder: PyTorch's CPU-side operator recorder, read into the memory table.

``torch.profiler.profile`` (Kineto) records an operator call cheaply but pays for it after the cell:
stopping it turns every call into a Kineto activity and an event (1.93 s for a 300-step training
cell on an H200), and reading those events back from Python costs as much again. PyTorch's older
recorder (``torch.autograd._enable_profiler_legacy``, ``ProfilerState.CPU``) sees the same operator
calls through the same RecordFunction callbacks and the same allocator reports (CPU and CUDA), and
hands back, per thread, the begin and end of each call and each allocation or free, in the order
they happened. A call's total is the sum of the memory records between its begin and end on its
thread, its self figure that total less its children's. PyTorch's table (``key_averages``) finds the
same figures by timestamps across threads; the two agree wherever calls on different threads do not
overlap in time, as in a notebook's training loop, where autograd's device thread runs backward while
the main thread waits (``test_profile_records.py`` and ``test_profile_gpu.py`` compare them row by row).

Each field of a record is a call into PyTorch's bindings, the bulk of the cost: each is read a column
at a time (one call a record, no Python loop around it) and only from the records that need it (a
handle from every record, a name from each begin, bytes from each memory record, whether a call is
asynchronous only where that can change the table, input shapes only for the operators with a figure
that is not 0); pairing begins with ends, nesting, sums and grouping are done over arrays. Records in an
order the arrays cannot take (a call that never ended, or ended after a call around it) are read in
order, one at a time, with the same outcome.

A call that ends on another thread than it began on (a block ended by a future another thread
completes) is asynchronous, as in ``key_averages``: a total (the records between its begin and its
end), no self figure, no parent and no children. A call whose end was never recorded has no row.
Kernels are not recorded (the table never used them), so the calls counted are the operators'. The
rows are those with a figure that is not 0 (``key_averages`` also lists the operators that moved
nothing, which the report never shows).
"""

from __future__ import annotations

import itertools
import marshal
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from gpumem.core.diagnoses.profile_events import (
    LEFT_OUT,
    MEMORY_EVENT,
    OperatorMemory,
    OperatorTable,
    shapes_text,
    sort_rows,
)
from gpumem.core.gc_pause import collector_paused

__all__ = ["RecordsProfiler", "available", "read_records"]

_NO_PARENT = -1
_LEFT = -1  # the name id of a call left out of the table
_STEP = "ProfilerStep#"
_SAMPLE = 64  # the memory records looked at to choose which of their two fields to read first
_Index = npt.NDArray[np.intp]
_Ints = npt.NDArray[np.int64]
_Flags = npt.NDArray[np.bool_]


def available(torch: Any) -> bool:
    """Whether this torch has the recorder (it is deprecated and may go in a later release)."""
    autograd = getattr(torch, "autograd", None)
    return all(
        hasattr(autograd, name) for name in ("_enable_profiler_legacy", "_disable_profiler_legacy", "ProfilerConfig")
    ) and hasattr(getattr(getattr(torch, "_C", None), "_profiler", None), "_ExperimentalConfig")


class RecordsProfiler:
    """Start before the cell, ``stop()`` after it: the records, a list per thread (:func:`read_records` reads them)."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch

    def start(self) -> None:
        autograd = self.torch.autograd
        config = autograd.ProfilerConfig(
            autograd.ProfilerState.CPU,
            True,  # record_shapes
            True,  # profile_memory
            False,  # with_stack
            False,  # with_flops
            False,  # with_modules
            self.torch._C._profiler._ExperimentalConfig(),  # noqa: SLF001 - as PyTorch's own profiler_legacy
        )
        autograd._enable_profiler_legacy(config)  # noqa: SLF001

    def stop(self) -> Any:
        """Stop recording; the records, a list per thread."""
        return self.torch.autograd._disable_profiler_legacy()  # noqa: SLF001


def read_records(threads: Sequence[Sequence[Any]]) -> OperatorTable | None:
    """The memory table of the records ``_disable_profiler_legacy`` returned; None where they are unexpected."""
    try:
        with collector_paused():
            names = _Names()
            calls = [_read_thread(records, names) for records in threads if len(records)]
            return _table(calls, names)
    except Exception:
        return None


def _fields(field: Callable[[Any], Any], records: Sequence[Any], dtype: type[Any]) -> npt.NDArray[Any]:
    """One field of every record, as an array: a call into PyTorch's bindings a record, no Python loop."""
    return np.fromiter(map(field, records), dtype, len(records))


def _pick(items: Sequence[Any], at: _Index) -> Sequence[Any]:
    """The items at these places, in their order."""
    return itemgetter(*at.tolist())(items) if len(at) > 1 else [items[index] for index in at.tolist()]


class _Names(dict[str, int]):
    """Each name PyTorch recorded, looked up once: the id of its name in the table (every ``ProfilerStep#N``
    is ``ProfilerStep*``), or _LEFT for a call left out of the table."""

    def __init__(self) -> None:
        super().__init__()
        self.shown: dict[str, int] = {}  # the table's names, their ids in order

    def __missing__(self, name: str) -> int:
        shown = _LEFT if name in LEFT_OUT else self.shown.setdefault(_shown(name), len(self.shown))
        self[name] = shown
        return shown

    def ids(self, names: Iterable[str], count: int) -> _Index:
        return np.fromiter(map(self.__getitem__, names), np.intp, count)


def _shown(name: str) -> str:
    return "ProfilerStep*" if name.startswith(_STEP) else name


class _Nesting(NamedTuple):
    """One thread's calls (those left out aside) in the order they began: where each began and ended
    among the thread's records (-1: never ended), the call around it, its name's id and its begin
    record; and for each record without a handle, whether a call was open around it."""

    begin_at: _Index
    end_at: _Index
    parents: _Index
    names: _Index
    begins: Sequence[Any]
    inside: _Flags


class _Thread(NamedTuple):
    """One thread's calls and their figures: a call's totals are the memory records between its begin
    and its end (0 where it never ended)."""

    nesting: _Nesting
    ended: _Flags
    host: _Ints
    device: _Ints
    sync: _Flags  # not asynchronous by itself, and (where it ended) ended on the thread it began on
    strays: tuple[_Ints, _Ints]  # the host and device bytes of each memory record inside no call


def _read_thread(records: Sequence[Any], names: _Names) -> _Thread:
    """One thread's records, read a field at a time for the records that have it; sums over arrays.

    A record is told apart by its handle: a call's begin and end carry the call's handle (never 0, and
    no two calls share one), memory records and marks carry 0.
    """
    kind = type(records[0])
    handles = _fields(kind.handle, records, np.uint64)
    at_calls, at_memory = np.flatnonzero(handles), np.flatnonzero(handles == 0)
    host, device, counted = _memory(_pick(records, at_memory), kind)
    nesting = _nested(records, handles, at_calls, at_memory, names) or _in_order(
        records, handles, at_calls, at_memory, names
    )
    ended = nesting.end_at >= 0
    totals = []
    for values in (host, device):
        sums = np.zeros(len(records) + 1, np.int64)
        sums[at_memory + 1] = values
        np.cumsum(sums, out=sums)  # sums[k]: the bytes of the records before the k-th
        totals.append(np.where(ended, sums[nesting.end_at] - sums[nesting.begin_at], 0))
    sync = _sync(records, nesting, ended, (totals[0], totals[1]))
    stray = counted & ~nesting.inside
    return _Thread(nesting, ended, totals[0], totals[1], sync, (host[stray], device[stray]))


def _memory(records: Sequence[Any], kind: type[Any]) -> tuple[_Ints, _Ints, _Flags]:
    """The host and device bytes of each record without a handle, and whether it is a memory record (a
    mark is not; its kind is read only where no bytes were: memory records are most of them).

    PyTorch's memory record holds the bytes of one device, host or CUDA (``LegacyEvent::updateMemoryStats``
    sets one of its two fields, the other stays 0), so the second field is read only where the first is 0,
    the first being the one most of the first records hold.
    """
    fields = [kind.cuda_memory_usage, kind.cpu_memory_usage]
    sample = records[:_SAMPLE]
    host_first = 2 * sum(map(bool, map(fields[1], sample))) > len(sample)
    if host_first:
        fields.reverse()
    first = _fields(fields[0], records, np.int64)
    second = np.zeros_like(first)
    unset = np.flatnonzero(first == 0)
    second[unset] = _fields(fields[1], _pick(records, unset), np.int64)
    host, device = (first, second) if host_first else (second, first)
    counted = np.ones(len(records), np.bool_)
    for index in np.flatnonzero((host == 0) & (device == 0)).tolist():
        what = records[index].kind()
        if what == "mark":
            counted[index] = False
        elif what != "memory_alloc":
            raise ValueError(f"a {what} record without a handle")  # its call could not be paired
    return host, device, counted


def _sync(records: Sequence[Any], nesting: _Nesting, ended: _Flags, totals: tuple[_Ints, _Ints]) -> _Flags:
    """Whether each call is synchronous: not asynchronous by itself, and ended on the thread it began on.

    Begins are recorded on the thread that runs them, so they all share the thread of the first; an end
    is recorded on its begin's thread, with the thread that ended it. Read where it can change the table
    only. An asynchronous call has no self figure and is no one's child, its children being its parent's:
    where its self figure (its total less its children's) is 0, no figure changes, nor does any row but
    by a merge, which concerns only a call holding a call of its own name and the calls inside it. So
    it is read for those and for the calls whose self figure is not 0, as if every call were synchronous;
    if one of them is not, for every call. A call that never ended has no row and is never a parent.
    """
    sync = np.ones(len(ended), np.bool_)
    if not len(ended):
        return sync
    parents = nesting.parents
    children = np.flatnonzero(ended & (parents != _NO_PARENT))
    alone = np.zeros(len(ended), np.bool_)
    for total in totals:
        alone |= total != _sums(parents[children], total[children], len(ended))
    calls = np.flatnonzero(ended & (alone | _merge_zone(nesting, len(records))))
    _read_sync(records, nesting, calls, sync)
    if not sync[calls].all():
        _read_sync(records, nesting, np.flatnonzero(ended), sync)
    return sync


def _read_sync(records: Sequence[Any], nesting: _Nesting, calls: _Index, sync: _Flags) -> None:
    kind = type(records[0])
    thread = nesting.begins[0].thread_id()
    alone = _fields(kind.thread_id, _pick(records, nesting.end_at[calls]), np.uint64) == thread
    sync[calls] = alone & ~_fields(kind.is_async, _pick(nesting.begins, calls), np.bool_)


def _merge_zone(nesting: _Nesting, size: int) -> _Flags:
    """The calls a merge could concern: each call holding a call of its own name, and the calls inside it
    (a call that never ended reaches past the last record). The calls of each name in the order they
    began: one holds a call of its name where the next of them begins before it ends."""
    ends = np.where(nesting.end_at >= 0, nesting.end_at, size)
    order = _stable_order(nesting.names)
    same = nesting.names[order][1:] == nesting.names[order][:-1]
    holding = order[:-1][same & (nesting.begin_at[order][1:] < ends[order][:-1])]
    starts, stops = np.sort(nesting.begin_at[holding]), np.sort(ends[holding])
    begins = nesting.begin_at  # a call inside one of them begins between its start and its stop
    return np.searchsorted(starts, begins, "right") - np.searchsorted(stops, begins, "left") > 0


def _stable_order(values: _Index) -> _Index:
    """``argsort``, stable (numpy sorts 16-bit integers by radix, far faster than 64-bit ones)."""
    small = len(values) and values.min() >= -(1 << 15) and values.max() < 1 << 15
    return np.argsort(values.astype(np.int16) if small else values, kind="stable")


def _nested(
    records: Sequence[Any], handles: npt.NDArray[np.uint64], at_calls: _Index, at_memory: _Index, names: _Names
) -> _Nesting | None:
    """The calls, where each handle is recorded twice and the calls kept nest (as they do but where a
    call never ended or ended after a call around it): found over arrays. None otherwise."""
    order = np.argsort(handles[at_calls], kind="stable")
    paired = handles[at_calls][order]
    if len(paired) % 2 or not np.array_equal(paired[0::2], paired[1::2]) or np.any(paired[2::2] == paired[1:-1:2]):
        return None
    by_begin = np.argsort(at_calls[order[0::2]])
    begin_at, end_at = at_calls[order[0::2]][by_begin], at_calls[order[1::2]][by_begin]
    begins = _pick(records, begin_at)
    ids = names.ids(map(type(records[0]).name, begins), len(begins))
    unnamed = np.flatnonzero(ids == names[""]).tolist() if "" in names else []
    if any(begins[at].kind() != "push" for at in unnamed):
        return None  # an end whose begin came before the records: left out, in order
    kept = np.flatnonzero(ids != _LEFT)
    begin_at, end_at = begin_at[kept], end_at[kept]
    nest = _parents(begin_at, end_at, len(records))
    if nest is None:
        return None
    parents, depth = nest
    begins = begins if len(kept) == len(begins) else _pick(begins, kept)
    return _Nesting(begin_at, end_at, parents, ids[kept], begins, depth[at_memory] > 0)


def _parents(begin_at: _Index, end_at: _Index, size: int) -> tuple[_Index, _Index] | None:
    """Each call's parent and the calls open after each record, where the calls nest; None otherwise.

    A call's level is how many calls are open around it. The calls nest if and only if, taking the
    begins and ends level by level in the order recorded, each begin is followed by its own end; the
    parent of a call is then the last call to begin one level up before it did.
    """
    calls = np.arange(len(begin_at))
    step = np.zeros(size, np.int64)
    step[begin_at], step[end_at] = 1, -1
    depth = np.cumsum(step)  # how many calls are open after each record
    events = np.flatnonzero(step)
    level = depth[events] - (step[events] > 0)  # a begin's level is the depth before it; an end's, after it
    order = _stable_order(level)
    call = np.empty(size, np.intp)
    call[begin_at], call[end_at] = calls, calls
    sequence = call[events[order]]
    if not np.array_equal(sequence[0::2], sequence[1::2]):
        return None
    keys = level[order] * (size + 1) + events[order]  # ascending: by level, then as recorded
    begin_level = depth[begin_at] - 1
    found = np.searchsorted(keys, (begin_level - 1) * (size + 1) + begin_at) - 1
    return np.where(begin_level > 0, sequence[found], _NO_PARENT), depth


def _in_order(
    records: Sequence[Any], handles: npt.NDArray[np.uint64], at_calls: _Index, at_memory: _Index, names: _Names
) -> _Nesting:
    """The calls in any order, one record at a time as recorded: a call ended after a call around it
    ended is left out with it, and so are the calls inside a call that never ended inside it."""
    begin_at: list[int] = []
    end_at: list[int] = []
    parents: list[int] = []
    ids: list[int] = []
    begins: list[Any] = []
    opened: dict[int, int] = {}  # the open calls' handles (_LEFT for a call left out)
    current = _NO_PARENT  # the innermost open call; the calls open around it are its parents
    after = np.full(len(at_calls) + 1, _NO_PARENT)  # the innermost open call after each begin or end
    for step, (position, handle) in enumerate(zip(at_calls.tolist(), handles[at_calls].tolist(), strict=True)):
        index = opened.pop(handle, None)
        if index is None:  # a begin
            record = records[position]
            name = record.name()
            shown = _LEFT if not name and record.kind() != "push" else names[name]
            if shown == _LEFT:
                opened[handle] = _LEFT
            else:
                parents.append(current)
                opened[handle] = current = len(begin_at)
                begin_at.append(position)
                end_at.append(-1)
                ids.append(shown)
                begins.append(record)
        elif index != _LEFT and _open(parents, current, index):
            current = parents[index]  # the calls inside it that never ended are left out, as in PyTorch's table
            end_at[index] = position
        after[step] = current
    inside = after[np.searchsorted(at_calls, at_memory) - 1] != _NO_PARENT  # after[-1]: before any call
    arrays = [np.array(one, np.intp) for one in (begin_at, end_at, parents, ids)]
    return _Nesting(arrays[0], arrays[1], arrays[2], arrays[3], begins, inside)


def _open(parents: list[int], current: int, index: int) -> bool:
    """Whether call ``index`` is still open: ``current`` or one of the calls around it."""
    while current not in {index, _NO_PARENT}:
        current = parents[current]
    return current == index


class _Calls(NamedTuple):
    """Every thread's calls together (index = call, threads one after another)."""

    parents: _Index  # the nearest ancestor that can be a parent (ended and synchronous), or _NO_PARENT
    ended: _Flags
    names: _Index
    host: _Ints
    device: _Ints
    sync: _Flags
    begins: list[Any]

    @classmethod
    def join(cls, threads: list[_Thread]) -> _Calls:
        offsets = itertools.accumulate((len(thread.ended) for thread in threads), initial=0)
        parents = [np.where(one.nesting.parents >= 0, one.nesting.parents + offset, _NO_PARENT)
                   for one, offset in zip(threads, offsets, strict=False)]  # fmt: skip
        ended, sync = (
            _joined([one.ended for one in threads], np.bool_),
            _joined([one.sync for one in threads], np.bool_),
        )
        raw = _joined(parents, np.intp)
        return cls(
            _usable(raw, ended, sync),
            ended,
            _joined([one.nesting.names for one in threads], np.intp),
            _joined([one.host for one in threads], np.int64),
            _joined([one.device for one in threads], np.int64),
            sync,
            list(itertools.chain.from_iterable(one.nesting.begins for one in threads)),
        )


def _joined(arrays: list[npt.NDArray[Any]], dtype: type[Any]) -> npt.NDArray[Any]:
    return np.concatenate([np.zeros(0, dtype), *arrays])


def _usable(parents: _Index, ended: _Flags, sync: _Flags) -> _Index:
    """The nearest ancestor that can be a parent: an asynchronous call is no one's parent and has none,
    and a call that never ended has no row (walked past only for the rare calls whose parent is one)."""
    usable = ended & sync
    found = np.where(sync, parents, _NO_PARENT)
    for index in np.flatnonzero((found != _NO_PARENT) & ~usable[found]).tolist():
        parent = int(parents[index])
        while parent != _NO_PARENT and not usable[parent]:
            parent = int(parents[parent])
        found[index] = parent
    return found


def _table(threads: list[_Thread], names: _Names) -> OperatorTable:
    calls = _Calls.join(threads)
    below_host, below_device, merged = _below(calls)
    strays = [_joined([one.strays[side] for one in threads], np.int64) for side in (0, 1)]
    kept = calls.ended & ~merged
    rows = _rows(calls, below_host, below_device, kept, list(names.shown))
    if len(strays[0]):
        host, device = int(strays[0].sum()), int(strays[1].sum())
        rows.append(OperatorMemory(MEMORY_EVENT, "", len(strays[0]), host, host, device, device))
    return OperatorTable(sort_rows(rows), int(kept.sum()) + len(strays[0]))


def _below(calls: _Calls) -> tuple[_Ints, _Ints, _Flags]:
    """Per call, what its children add up to (host and device totals), and whether it is merged into its
    parent: a call named as its parent, and the parent's only child, is merged into it (as PyTorch does),
    children first, so that a chain of them merges into its outermost call, which takes over what the
    innermost's children add up to."""
    children = np.flatnonzero(calls.ended & (calls.parents != _NO_PARENT))
    parent = calls.parents[children]
    below = [_sums(parent, values[children], len(calls.ended)) for values in (calls.host, calls.device)]
    only = np.bincount(parent, minlength=len(calls.ended))[parent] == 1
    merging = children[only & (calls.names[children] == calls.names[parent])]
    merged = np.zeros(len(calls.ended), np.bool_)
    merged[merging] = True
    for child in merging[::-1].tolist():  # a call's children begin after it: each child is settled first
        up = calls.parents[child]
        below[0][up], below[1][up] = below[0][child], below[1][child]
    return below[0], below[1], merged


def _rows(
    calls: _Calls, below_host: _Ints, below_device: _Ints, kept: _Flags, shown: list[str]
) -> list[OperatorMemory]:
    """The calls by operator and input shapes: the rows with a figure that is not 0 (the others are never
    shown), read for the operators with such a call alone (input shapes are the costliest field). An
    asynchronous call has a total, never a self figure."""
    alive = np.flatnonzero(kept)
    self_host = np.where(calls.sync, calls.host - below_host, 0)
    self_device = np.where(calls.sync, calls.device - below_device, 0)
    moved = (calls.host != 0) | (calls.device != 0) | (self_host != 0) | (self_device != 0)
    moving = np.zeros(len(shown), np.bool_)
    moving[calls.names[alive[moved[alive]]]] = True
    shaped = alive[moving[calls.names[alive]]]
    begins = _pick(calls.begins, shaped)
    shapes = map(type(begins[0]).shapes, begins) if len(begins) else ()
    keys = map(marshal.dumps, zip(calls.names[shaped].tolist(), shapes, strict=True), itertools.repeat(2))
    groups: defaultdict[bytes, int] = defaultdict(itertools.count().__next__)  # in the order first seen
    group = np.fromiter(map(groups.__getitem__, keys), np.intp, len(shaped))
    figures = [
        np.bincount(group, minlength=len(groups)),
        *(_sums(group, values[shaped], len(groups)) for values in (self_host, calls.host, self_device, calls.device)),
    ]
    each = zip(*(one.tolist() for one in figures), strict=True)  # each row's calls and four figures
    rows = [
        OperatorMemory(shown[name], shapes_text(shapes), *row)
        for (name, shapes), row in zip(map(marshal.loads, groups), each, strict=True)
    ]
    return [row for row in rows if row.moved_memory()]


def _sums(group: _Index, values: _Ints, size: int) -> _Ints:
    """The values summed by group (exact: int64)."""
    sums = np.zeros(size, np.int64)
    np.add.at(sums, group, values)
    return sums
