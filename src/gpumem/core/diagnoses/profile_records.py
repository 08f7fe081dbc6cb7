"""``%%gpumem --profile``'s recorder: PyTorch's CPU-side operator recorder, read into the memory table.

``torch.profiler.profile`` (Kineto) records an operator call cheaply but pays for it after the cell:
stopping it turns every call into a Kineto activity and an event (1.93 s for a 300-step training
cell on an H200), and reading those events back from Python costs as much again. PyTorch's older
recorder (``torch.autograd._enable_profiler_legacy``, ``ProfilerState.CPU``) sees the same operator
calls through the same RecordFunction callbacks and the same allocator reports (CPU and CUDA), and
hands back, per thread, the begin and end of each call and each allocation or free, in the order
they happened. So the table is one pass per thread with running sums: a call's total is the sum
of the memory records between its begin and end on its thread, its self figure that total less its
children's. PyTorch's table (``key_averages``) finds the same figures by timestamps across threads;
the two agree wherever calls on different threads do not overlap in time, as in a notebook's
training loop, where autograd's device thread runs backward while the main thread waits
(``test_profile_records.py`` and ``test_profile_gpu.py`` compare them row by row).

A call that ends on another thread than it began on (a block ended by a future another thread
completes) is asynchronous, as in ``key_averages``: a total (the records between its begin and its
end), no self figure, no parent and no children. A call whose end was never recorded has no row.
Kernels are not recorded (the table never used them), so the calls counted are the operators'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
_LEFT_OUT = -2  # the handle of a call left out of the table
_LEFT = "\0left out"  # the table name of a call left out of it
_STEP = "ProfilerStep#"


def available(torch: Any) -> bool:
    """Whether this torch has the recorder (it is deprecated and may go in a later release)."""
    autograd = getattr(torch, "autograd", None)
    return all(
        hasattr(autograd, name) for name in ("_enable_profiler_legacy", "_disable_profiler_legacy", "ProfilerConfig")
    ) and hasattr(getattr(getattr(torch, "_C", None), "_profiler", None), "_ExperimentalConfig")


class RecordsProfiler:
    """Start before the cell, ``stop()`` after it: the table, or None where the records were unreadable."""

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
            calls = _Calls()
            for records in threads:
                calls.scan(records)
            return calls.table()
    except Exception:
        return None


class _Calls:
    """Every call as parallel lists (index = call): far cheaper than an object per call."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.pushes: list[Any] = []  # the begin record: input shapes are read from it, for few calls
        self.parents: list[int] = []
        self.cpu: list[int] = []  # while open: the running sum at its begin; once ended: its total
        self.device: list[int] = []
        self.ended: list[bool] = []
        self.sync: list[bool] = []  # ended on the thread it began on, and not asynchronous by itself
        self.strays: list[tuple[int, int]] = []  # memory records inside no call: rows of their own
        self.known: dict[str, str] = {}  # each name seen: its name in the table, or _LEFT

    def scan(self, records: Sequence[Any]) -> None:
        """One thread's records in order: begins, ends and memory, with running sums.

        Each field is a call into PyTorch's bindings, so a record is told apart by its handle alone where
        it can be: a call's begin and end carry the call's handle (never 0, and no two calls share one),
        memory and marks carry 0. Begins are recorded on the thread that runs them, so they all share
        the thread of the first; an end is recorded on its begin's thread, with the thread that ended it.
        """
        cpu = device = 0
        current = _NO_PARENT  # the innermost open call; the calls open around it are its parents
        handles: dict[int, int] = {}  # the open calls' handles (_LEFT_OUT for a left-out call)
        names, cpu_at, device_at, ended, sync = self.names, self.cpu, self.device, self.ended, self.sync
        add_name, add_push, add_parent = names.append, self.pushes.append, self.parents.append
        add_cpu, add_device, add_ended, add_sync = cpu_at.append, device_at.append, ended.append, sync.append
        parents, opened = self.parents, handles.pop
        known = self.known
        thread = None
        for record in records:
            handle = record.handle()
            if not handle:
                host, cuda = self._memory(record, current != _NO_PARENT)
                cpu += host
                device += cuda
                continue
            index = opened(handle, None)
            if index is None:  # a begin
                name = known.get(name := record.name()) or self._name(name, record)
                if name is _LEFT:
                    handles[handle] = _LEFT_OUT
                    continue
                if thread is None:
                    thread = record.thread_id()
                index = len(names)
                add_name(name)
                add_push(record)
                add_parent(current)
                add_cpu(cpu)
                add_device(device)
                add_ended(False)
                add_sync(not record.is_async())
                handles[handle] = index
                current = index
            elif index != _LEFT_OUT:  # an end
                if index != current and not self._open(current, index):
                    continue  # ended after a call around it ended: left out with it
                current = parents[index]  # the calls inside it that never ended are left out, as in PyTorch's table
                cpu_at[index] = cpu - cpu_at[index]
                device_at[index] = device - device_at[index]
                ended[index] = True
                if record.thread_id() != thread:
                    sync[index] = False

    def _name(self, name: str, record: Any) -> str:
        """A begin's name in the table, first sight: _LEFT for a call left out (or an end begun before)."""
        if not name and record.kind() != "push":
            return _LEFT  # not remembered: a call may be named ""
        self.known[name] = shown = _LEFT if name in LEFT_OUT else "ProfilerStep*" if name.startswith(_STEP) else name
        return shown

    def _memory(self, record: Any, inside: bool) -> tuple[int, int]:
        """A record without a handle: the host and device bytes of a memory record, none of a mark (whose
        kind is read only where no bytes were: memory records are most of them)."""
        host, cuda = record.cpu_memory_usage(), record.cuda_memory_usage()
        if not (host or cuda):
            kind = record.kind()
            if kind == "mark":
                return 0, 0
            if kind != "memory_alloc":
                raise ValueError(f"a {kind} record without a handle")  # its call could not be paired
        if not inside:
            self.strays.append((host, cuda))
        return host, cuda

    def _open(self, current: int, index: int) -> bool:
        """Whether call ``index`` is still open: ``current`` or one of the calls around it."""
        parents = self.parents
        while current not in {index, _NO_PARENT}:
            current = parents[current]
        return current == index

    def _parent(self, index: int) -> int:
        """The nearest synchronous ancestor: an asynchronous call is no one's parent and has none, and a
        call that never ended has no row."""
        if not self.sync[index]:
            return _NO_PARENT
        parent = self.parents[index]
        while parent != _NO_PARENT and not (self.ended[parent] and self.sync[parent]):
            parent = self.parents[parent]
        return parent

    def table(self) -> OperatorTable:
        ended, sync = self.ended, self.sync
        kept = [index for index, done in enumerate(ended) if done]
        usable = [done and alone for done, alone in zip(ended, sync, strict=True)]  # can be a parent
        parents = [  # the nearest usable ancestor, walked only past the rare calls that are not
            _NO_PARENT if not alone else parent if parent == _NO_PARENT or usable[parent] else self._parent(index)
            for index, (parent, alone) in enumerate(zip(self.parents, sync, strict=True))
        ]
        below = _Below(len(ended))
        below.add(kept, parents, self.cpu, self.device)
        merged = below.merge_repeats(kept, self.names)
        rows = self._group([index for index in kept if not merged[index]], parents, below)
        return OperatorTable(rows, len(kept) - sum(merged) + len(self.strays))

    def _group(self, kept: list[int], parents: list[int], below: _Below) -> list[OperatorMemory]:
        names, cpu, device, sync, pushes = self.names, self.cpu, self.device, self.sync, self.pushes
        moving: set[str] = set()
        for index in kept:
            if cpu[index] or device[index]:
                moving.add(names[index])
                if parents[index] != _NO_PARENT:
                    moving.add(names[parents[index]])
        groups: dict[tuple[str, str], list[int]] = {}  # the calls of each row
        texts: dict[tuple[str, str], str] = {}
        for index in [index for index in kept if names[index] in moving]:
            shapes = pushes[index].shapes()
            key = (names[index], str(shapes))
            calls = groups.get(key)
            if calls is None:
                calls = groups[key] = []
                texts[key] = shapes_text(shapes)
            calls.append(index)
        rows = [
            OperatorMemory(key[0], texts[key], *below.figures(calls, cpu, device, sync))
            for key, calls in groups.items()
        ]
        if self.strays:
            host, cuda = sum(one[0] for one in self.strays), sum(one[1] for one in self.strays)
            rows.append(OperatorMemory(MEMORY_EVENT, "", len(self.strays), host, host, cuda, cuda))
        return sort_rows(rows)


class _Below:
    """Per call, what its children add up to (host and device totals), how many it has and the last."""

    def __init__(self, size: int) -> None:
        self.cpu = [0] * size
        self.device = [0] * size
        self.count = [0] * size
        self.last = [_NO_PARENT] * size

    def add(self, kept: list[int], parents: list[int], cpu: list[int], device: list[int]) -> None:
        below_cpu, below_device, count, last = self.cpu, self.device, self.count, self.last
        for index in kept:
            parent = parents[index]
            if parent != _NO_PARENT:
                below_cpu[parent] += cpu[index]
                below_device[parent] += device[index]
                count[parent] += 1
                last[parent] = index

    def merge_repeats(self, kept: list[int], names: list[str]) -> list[bool]:
        """A call named as its parent, and the parent's only child, is merged into it (as PyTorch does),
        children first, so that a chain of them merges into its outermost call: the parent takes over the
        child's children (same-named, so which of the two a grandchild names as its parent is moot)."""
        merged = [False] * len(names)
        below_cpu, below_device, count, last = self.cpu, self.device, self.count, self.last
        for index in reversed(kept):  # a call's children begin after it: every child is settled first
            while count[index] == 1 and names[last[index]] == names[index]:
                child = last[index]
                merged[child] = True
                below_cpu[index], below_device[index] = below_cpu[child], below_device[child]
                count[index], last[index] = count[child], last[child]
        return merged

    def figures(self, calls: list[int], cpu: list[int], device: list[int], sync: list[bool]) -> tuple[int, ...]:
        """One row's calls, self and total host bytes, self and total device bytes: an asynchronous call
        has a total, never a self figure."""
        host, cuda = sum(map(cpu.__getitem__, calls)), sum(map(device.__getitem__, calls))
        alone = calls if all(map(sync.__getitem__, calls)) else [index for index in calls if sync[index]]
        self_host = sum(map(cpu.__getitem__, alone)) - sum(map(self.cpu.__getitem__, alone))
        self_cuda = sum(map(device.__getitem__, alone)) - sum(map(self.device.__getitem__, alone))
        return len(calls), self_host, host, self_cuda, cuda
