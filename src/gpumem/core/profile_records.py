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

from gpumem.core.collector import collector_paused
from gpumem.core.profile_events import LEFT_OUT, MEMORY_EVENT, OperatorMemory, OperatorTable, shapes_text, sort_rows

__all__ = ["RecordsProfiler", "available", "read_records"]

_NO_PARENT = -1
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
        self.threads: list[int] = []  # the thread it began on
        self.sync: list[bool] = []  # ended on the thread it began on, and not asynchronous by itself
        self.strays: list[tuple[int, int]] = []  # memory records inside no call: rows of their own

    def scan(self, records: Sequence[Any]) -> None:
        """One thread's records in order: begins, ends and memory, with running sums."""
        cpu = device = 0
        stack: list[int] = []  # the open calls, innermost last
        handles: dict[int, int] = {}
        names, cpu_at, device_at = self.names, self.cpu, self.device
        for record in records:
            kind = record.kind()
            if kind == "memory_alloc":
                host, cuda = record.cpu_memory_usage(), record.cuda_memory_usage()
                if not stack:
                    self.strays.append((host, cuda))
                cpu += host
                device += cuda
            elif kind == "push":
                name = record.name()
                if name in LEFT_OUT:
                    continue
                index = len(names)
                names.append("ProfilerStep*" if name.startswith(_STEP) else name)
                self.pushes.append(record)
                self.parents.append(stack[-1] if stack else _NO_PARENT)
                cpu_at.append(cpu)
                device_at.append(device)
                self.ended.append(False)
                self.sync.append(not record.is_async())
                self.threads.append(record.thread_id())
                handles[record.handle()] = index
                stack.append(index)
            elif kind == "pop":
                index = handles.pop(record.handle(), _NO_PARENT)
                if index == _NO_PARENT:
                    continue  # a left-out call's end, or a call begun on another thread
                while stack and stack[-1] != index:
                    stack.pop()  # calls that never end here: left out, as PyTorch's own table does
                stack.pop()
                cpu_at[index] = cpu - cpu_at[index]
                device_at[index] = device - device_at[index]
                self.ended[index] = True
                if record.thread_id() != self.threads[index]:
                    self.sync[index] = False

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
        kept = [index for index in range(len(self.names)) if self.ended[index]]
        parents = {index: self._parent(index) for index in kept}
        children: dict[int, list[int]] = {}
        for index in kept:
            if parents[index] != _NO_PARENT:
                children.setdefault(parents[index], []).append(index)
        merged = _merge_repeats(kept, parents, children, self.names)
        rows = self._group([index for index in kept if index not in merged], parents, children)
        return OperatorTable(rows, len(kept) - len(merged) + len(self.strays))

    def _group(self, kept: list[int], parents: dict[int, int], children: dict[int, list[int]]) -> list[OperatorMemory]:
        names, cpu, device = self.names, self.cpu, self.device
        moving: set[str] = set()
        for index in kept:
            if cpu[index] or device[index]:
                moving.add(names[index])
                if parents[index] != _NO_PARENT:
                    moving.add(names[parents[index]])
        sums: dict[tuple[str, str], list[int]] = {}
        texts: dict[tuple[str, str], str] = {}
        for index in kept:
            name = names[index]
            if name not in moving:
                continue
            shapes = self.pushes[index].shapes()
            key = (name, str(shapes))
            figures = sums.get(key)
            if figures is None:
                figures = sums[key] = [0, 0, 0, 0, 0]
                texts[key] = shapes_text(shapes)
            figures[0] += 1
            if self.sync[index]:  # an asynchronous call has a total, never a self figure
                below = children.get(index, ())
                figures[1] += cpu[index] - sum(cpu[child] for child in below)
                figures[3] += device[index] - sum(device[child] for child in below)
            figures[2] += cpu[index]
            figures[4] += device[index]
        if self.strays:
            key = (MEMORY_EVENT, "[]")
            texts[key] = ""
            host, cuda = sum(one[0] for one in self.strays), sum(one[1] for one in self.strays)
            sums[key] = [len(self.strays), host, host, cuda, cuda]
        return sort_rows([OperatorMemory(key[0], texts[key], *figures) for key, figures in sums.items()])


def _merge_repeats(
    kept: list[int], parents: dict[int, int], children: dict[int, list[int]], names: list[str]
) -> set[int]:
    """A call named as its parent, and the parent's only child, is merged into it (as PyTorch does),
    children first, so that a chain of them merges into its outermost call."""
    merged: set[int] = set()
    for index in reversed(kept):  # a call's children begin after it: every child is settled first
        below = children.get(index)
        while below is not None and len(below) == 1 and names[below[0]] == names[index]:
            child = below[0]
            merged.add(child)
            below = children.pop(child, None)
            if below is None:
                children.pop(index, None)
            else:
                children[index] = below
                for grandchild in below:
                    parents[grandchild] = index
    return merged
