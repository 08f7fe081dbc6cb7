"""The memory columns of PyTorch's ``key_averages(group_by_input_shape=True)``, read without its cost.

``key_averages`` first turns every recorded call into a ``FunctionEvent`` of some forty fields; for a
300-step training cell that took 27 of the 29 s after the cell (2-core CPU). Each call is read for the few
fields the memory table needs and attributed as PyTorch does: a memory record belongs to every CPU
operator whose interval holds it (total); self is total minus the operator's children, found per
thread by nesting, async calls left out; a child of the same name that is its parent's only child is
merged into it; records no operator holds are "[memory]" rows of their own. Input shapes, the costly
field, are read only for the operators that moved memory. Anything unexpected in the results returns
None, and the caller falls back to ``key_averages``.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from gpumem.core.gc_pause import collector_paused

__all__ = ["LEFT_OUT", "MEMORY_EVENT", "OperatorMemory", "OperatorTable", "read_operators", "shapes_text", "sort_rows"]

MEMORY_EVENT = "[memory]"
OUT_OF_MEMORY_EVENT = "[OutOfMemory]"
# Utility calls PyTorch leaves out of its tables (torch.autograd.profiler_util._filter_name).
LEFT_OUT = frozenset(
    {
        MEMORY_EVENT,
        OUT_OF_MEMORY_EVENT,
        "profiler::_record_function_enter",
        "profiler::_record_function_enter_new",
        "profiler::_record_function_exit",
        "aten::is_leaf",
        "aten::output_nr",
        "aten::_version",
    }
)
_HOST_KINDS = ("CPU", "MKLDNN", "IDEEP")
_DEVICE_KINDS = ("CUDA", "PrivateUse1", "HIP", "XPU")


class OperatorMemory(NamedTuple):
    """One operator with one set of input shapes: its calls and net bytes (allocated minus freed)."""

    name: str
    input_shapes: str
    calls: int
    self_cpu_bytes: int
    cpu_bytes: int  # with the operators it called
    self_device_bytes: int
    device_bytes: int

    def largest_bytes(self) -> int:
        return max(self.self_device_bytes, self.self_cpu_bytes, self.device_bytes, self.cpu_bytes)

    def moved_memory(self) -> bool:
        """Whether any of its four figures is not zero (the rows two read-backs must agree on)."""
        return any((self.self_cpu_bytes, self.cpu_bytes, self.self_device_bytes, self.device_bytes))


class OperatorTable(NamedTuple):
    """The operators that moved memory, and every call the profiler kept (all operators, kernels too)."""

    rows: list[OperatorMemory]
    calls: int


_Record = tuple[int, int, int, int, Any]  # a memory record: time, host bytes, device bytes, position, event


class _Call:
    """One CPU call or stray memory record, as much of it as the table needs."""

    __slots__ = ("children", "cpu", "device", "end", "event", "name", "parent", "start", "stray", "sync", "thread")

    def __init__(self, event: Any, name: str, span: tuple[int, int], thread: int, *, sync: bool = True) -> None:
        self.event = event
        self.name = name
        self.start, self.end = span
        self.thread = thread
        self.sync = sync
        self.stray = False
        self.cpu = self.device = 0
        self.parent: _Call | None = None
        self.children: list[_Call] = []

    def key(self) -> tuple[tuple[str, bool, str], Any]:
        """What PyTorch groups calls by (one process, all on the CPU): name, annotation, input shapes."""
        shapes = [] if self.stray else self.event.shapes()
        annotation = False if self.stray else bool(self.event.is_user_annotation())
        return (self.name, annotation, str(shapes)), shapes


def shapes_text(shapes: Any) -> str:
    """``[[1000, 1000], []]`` -> ``1000x1000, -``; a list no argument has a shape in is ""."""
    if not isinstance(shapes, (list, tuple)) or not any(shapes):
        return ""
    return ", ".join("x".join(str(size) for size in shape) if shape else "-" for shape in shapes)


def sort_rows(rows: list[OperatorMemory]) -> list[OperatorMemory]:
    """The largest allocators on the device first, then on the host."""
    rows.sort(key=lambda row: (-row.self_device_bytes, -row.self_cpu_bytes, -row.largest_bytes(), row.name))
    return rows


def read_operators(results: Any, torch: Any) -> OperatorTable | None:
    """The memory table of a stopped profiler's ``kineto_results``; None where its shape is unexpected."""
    try:
        with collector_paused():  # hundreds of thousands of small objects, freed by their counts after
            return _Reader(torch).read(results.events())
    except Exception:
        return None


class _Records:
    """The memory records sorted by time, with running sums, so an interval's bytes cost two bisects."""

    def __init__(self, records: Sequence[_Record]) -> None:
        ordered = sorted(range(len(records)), key=lambda i: records[i][0])
        self.records = [records[i] for i in ordered]
        self.times = [record[0] for record in self.records]
        self.cpu_sums = [0, *itertools.accumulate(record[1] for record in self.records)]
        self.device_sums = [0, *itertools.accumulate(record[2] for record in self.records)]
        self.held = [0] * (len(self.records) + 1)  # +1 where an operator's interval starts, -1 past its end

    def attribute(self, call: _Call) -> None:
        first = bisect.bisect_left(self.times, call.start)
        past = bisect.bisect_right(self.times, call.end)
        if first < past:
            call.cpu = self.cpu_sums[past] - self.cpu_sums[first]
            call.device = self.device_sums[past] - self.device_sums[first]
            self.held[first] += 1
            self.held[past] -= 1

    def unheld(self) -> list[_Record]:
        """The records inside no operator's interval, in the order they were recorded."""
        depth = itertools.accumulate(self.held[:-1])
        return sorted((record for record, held in zip(self.records, depth, strict=True) if not held), key=_order)


def _order(record: _Record) -> int:
    return record[3]


def _never(_event: Any) -> bool:
    return False


def _hidden_test(events: Sequence[Any]) -> Callable[[Any], bool]:
    """PyTorch's test for calls it hides from its tables, looked up once; none in older PyTorch."""
    method = getattr(type(events[0]), "is_hidden_event", None) if len(events) else None
    return method if callable(method) else _never


class _Reader:
    def __init__(self, torch: Any) -> None:
        kinds = torch.autograd.DeviceType
        self.cpu_kind = kinds.CPU
        self.host_kinds = {getattr(kinds, name) for name in _HOST_KINDS if hasattr(kinds, name)}
        self.device_kinds = {getattr(kinds, name) for name in _DEVICE_KINDS if hasattr(kinds, name)}
        self.demangle: Callable[[str], str] = getattr(torch._C, "_demangle", str)  # noqa: SLF001 - as PyTorch names
        self.names: dict[str, str] = {}
        self.memory: list[_Record] = []
        self.out_of_memory: list[Any] = []
        self.calls: list[_Call] = []
        self.kept = 0  # the calls PyTorch's table counts: every one not left out, kernels included

    def _name(self, raw: str) -> str:
        """The name PyTorch groups under: demangled, and every ProfilerStep#N as ProfilerStep*."""
        name = self.names.get(raw)
        if name is None:
            name = self.demangle(raw) if len(raw) > 1 else raw
            name = "ProfilerStep*" if name.startswith("ProfilerStep#") else name
            self.names[raw] = name
        return name

    def _bytes(self, event: Any) -> tuple[int, int]:
        kind, size = event.device_type(), int(event.nbytes())
        return (size if kind in self.host_kinds else 0), (size if kind in self.device_kinds else 0)

    def read(self, events: Sequence[Any]) -> OperatorTable:
        links = self._scan(events)
        records = _Records(self.memory)
        for call in self.calls:
            records.attribute(call)
        links.rethread()
        self._add_strays(records)
        calls = sorted(self.calls, key=lambda call: (call.start, -call.end))
        _nest(calls)
        merged = _merge_repeats(calls)
        table = OperatorTable(_group(merged), self.kept - (len(calls) - len(merged)))
        for call in calls:
            call.parent = None  # no cycles left for the collector to find
        return table

    def _scan(self, events: Sequence[Any]) -> _Links:
        links = _Links()
        hidden = _hidden_test(events)
        add_call, kept = self.calls.append, 0
        for index, event in enumerate(events):
            raw = event.name()
            if raw in LEFT_OUT:
                if raw == MEMORY_EVENT:
                    self.memory.append((event.start_ns(), *self._bytes(event), index, event))
                elif raw == OUT_OF_MEMORY_EVENT:
                    self.out_of_memory.append(event)
                continue
            if hidden(event):
                continue
            kept += 1
            if event.device_type() != self.cpu_kind:
                continue  # a kernel or copy on the device: counted, never holding a record
            thread = event.start_thread_id()
            sync = not (event.is_async() or thread != event.end_thread_id())
            call = _Call(event, self._name(raw), (event.start_ns(), event.end_ns()), thread, sync=sync)
            add_call(call)
            links.add(call, event, sync=sync)
        self.kept += kept
        return links

    def _add_strays(self, records: _Records) -> None:
        """Records no operator holds, then out-of-memory events: rows of their own, as in PyTorch."""
        strays = [(event, start, cpu, device) for start, cpu, device, _, event in records.unheld()]
        strays += [(event, event.start_ns(), *self._bytes(event)) for event in self.out_of_memory]
        for event, start, cpu, device in strays:
            name = MEMORY_EVENT if event.name() == MEMORY_EVENT else OUT_OF_MEMORY_EVENT
            stray = _Call(event, name, (start, start), event.start_thread_id())
            stray.stray = True
            stray.cpu, stray.device = cpu, device
            self.calls.append(stray)
        self.kept += len(strays)


class _Links:
    """Runtime calls on the CPU (a kernel launch) take the thread of the operator that made them."""

    def __init__(self) -> None:
        self.frontend: list[tuple[int, _Call]] = []
        self.linked: dict[int, list[_Call]] = {}

    def add(self, call: _Call, event: Any, *, sync: bool) -> None:
        link = event.linked_correlation_id()
        if link > 0:
            self.linked.setdefault(link, []).append(call)
        elif link < 0:
            raise ValueError("a negative correlation id")
        elif sync:
            self.frontend.append((event.correlation_id(), call))

    def rethread(self) -> None:
        for correlation, call in self.frontend:
            for runtime in self.linked.get(correlation, ()):
                runtime.thread = call.thread


def _nest(calls: list[_Call]) -> None:
    """Each synchronous call's parent: the innermost call on its thread whose interval holds it."""
    by_thread: dict[int, list[_Call]] = {}
    for call in calls:
        if call.sync:
            by_thread.setdefault(call.thread, []).append(call)
    for thread_calls in by_thread.values():
        open_calls: list[_Call] = []
        for call in thread_calls:
            while open_calls and (call.start >= open_calls[-1].end or call.end > open_calls[-1].end):
                open_calls.pop()
            if open_calls:
                call.parent = open_calls[-1]
                call.parent.children.append(call)
            open_calls.append(call)


def _merge_repeats(calls: list[_Call]) -> list[_Call]:
    """A call named as its parent, and the parent's only child, is merged into it (as PyTorch does)."""
    while True:
        merged: set[int] = set()
        for position, call in enumerate(calls):
            parent = call.parent
            if parent is not None and parent.name == call.name and len(parent.children) == 1:
                parent.children = call.children
                for child in call.children:
                    child.parent = parent
                merged.add(position)
        if not merged:
            return calls
        calls = [call for position, call in enumerate(calls) if position not in merged]


def _group(calls: list[_Call]) -> list[OperatorMemory]:
    """Calls by operator and input shapes, for the operators any of whose calls moved memory."""
    moving: set[str] = set()
    for call in calls:
        if call.cpu or call.device:  # its own figures, and its parent's self (total minus children)
            moving.add(call.name)
            if call.parent is not None:
                moving.add(call.parent.name)
    sums: dict[tuple[str, bool, str], list[int]] = {}
    texts: dict[tuple[str, bool, str], str] = {}
    for call in calls:
        if call.name not in moving:
            continue
        key, shapes = call.key()
        figures = sums.get(key)
        if figures is None:
            figures = sums[key] = [0, 0, 0, 0, 0]
            texts[key] = shapes_text(shapes)
        figures[0] += 1
        if call.sync:
            figures[1] += call.cpu - sum(child.cpu for child in call.children)
            figures[3] += call.device - sum(child.device for child in call.children)
        figures[2] += call.cpu
        figures[4] += call.device
    return sort_rows([OperatorMemory(key[0], texts[key], *figures) for key, figures in sums.items()])
