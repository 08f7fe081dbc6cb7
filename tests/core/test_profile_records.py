"""``--profile``'s default recorder (PyTorch's CPU-side operator records) against ``key_averages``.

The two recorders cannot run at once, so each workload runs three times: once under the Kineto
profiler to settle what was allocated before (the profiler cannot size a free of a block allocated
while no profiler ran), then under the records recorder, then under Kineto again, each run starting
from the same state. The rows of every operator that moved memory and the number of calls must be
the same. CUDA (autograd's device thread) is compared in ``test_profile_gpu.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

import pytest

from gpumem.core.diagnoses.profile import CellProfiler, operator_rows
from gpumem.core.diagnoses.profile_events import MEMORY_EVENT, OperatorMemory
from gpumem.core.diagnoses.profile_records import RecordsProfiler, available, read_records

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not available(torch), reason="this torch has no CPU-side operator recorder")

from test_profile_events import _blocks_ended_elsewhere, _nested_labels, _training_steps, kept  # noqa: E402


def _kineto(work: Callable[[], Any]) -> list[OperatorMemory]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=True) as recorder:
        work()
    return operator_rows(recorder.key_averages(group_by_input_shape=True))


def _moving(rows: list[OperatorMemory]) -> list[OperatorMemory]:
    return sorted(row for row in rows if row.moved_memory())


def _both_ways(work: Callable[[], Any]) -> tuple[list[OperatorMemory], list[OperatorMemory], int]:
    _kineto(work)
    recorder = RecordsProfiler(torch)
    recorder.start()
    try:
        work()
    finally:
        records = recorder.stop()
    table = read_records(records)
    assert table is not None
    expected = _kineto(work)
    assert _moving(table.rows), "the workload moved no memory: the comparison proves nothing"
    return table.rows, expected, table.calls


def test_a_training_loop_reads_as_key_averages() -> None:
    rows, expected, calls = _both_ways(_training_steps)
    assert _moving(rows) == _moving(expected)
    assert calls == sum(row.calls for row in expected)
    linear = [row for row in rows if row.name == "aten::linear"]
    assert linear, rows
    assert all(row.self_cpu_bytes == 0 < row.cpu_bytes for row in linear), linear


def test_same_named_only_children_merge_and_steps_group() -> None:
    rows, expected, calls = _both_ways(_nested_labels)
    kept.clear()
    assert _moving(rows) == _moving(expected)
    assert calls == sum(row.calls for row in expected)
    by_name = {row.name: row for row in rows}
    assert by_name["outer"].calls == 3
    assert by_name["ProfilerStep*"].calls == 3
    assert by_name[MEMORY_EVENT].cpu_bytes < 0


def test_a_block_ended_on_another_thread_is_async() -> None:
    rows, expected, calls = _both_ways(_blocks_ended_elsewhere)
    kept.clear()
    assert _moving(rows) == _moving(expected)
    assert calls == sum(row.calls for row in expected)
    block = next(row for row in rows if row.name == "async_block")
    assert (block.self_cpu_bytes, block.cpu_bytes) == (0, 3 * 4000)  # a total, never a self figure


def test_unexpected_records_are_refused_not_raised() -> None:
    assert read_records([[object()]]) is None


def test_the_cell_profiler_records_by_default_and_stops() -> None:
    profiler = CellProfiler()
    assert profiler.start() is None
    assert torch.autograd._profiler_enabled()
    assert not torch.autograd.profiler._is_profiler_enabled  # not Kineto's
    matrix = torch.ones(500, 500)
    report = profiler.stop(cell=None)
    del matrix
    assert not torch.autograd._profiler_enabled()
    assert report is not None
    ones = next(row for row in report.rows if row.name == "aten::ones")
    assert (ones.cpu_bytes, ones.self_cpu_bytes, ones.calls) == (500 * 500 * 4, 0, 1)  # aten::empty allocates
    assert next(row for row in report.rows if row.name == "aten::empty").self_cpu_bytes == 500 * 500 * 4


def test_a_running_records_profiler_is_not_disturbed() -> None:
    outer = CellProfiler()
    assert outer.start() is None
    try:
        reason = CellProfiler(recorder="kineto").start()
    finally:
        outer.abandon()
    assert reason is not None
    assert "already running" in reason
    assert not torch.autograd._profiler_enabled()


def test_an_unknown_recorder_is_refused() -> None:
    with pytest.raises(ValueError, match="recorder must be one of"):
        CellProfiler(recorder="nvtx")


def test_a_recorder_that_cannot_start_gives_way_to_kineto(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: RecordsProfiler) -> None:
        raise TypeError("ProfilerConfig(): incompatible constructor arguments")

    monkeypatch.setattr(RecordsProfiler, "start", refuse)
    profiler = CellProfiler()
    assert profiler.start() is None
    assert torch.autograd.profiler._is_profiler_enabled  # Kineto's
    matrix = torch.ones(500, 500)
    report = profiler.stop(cell=None)
    del matrix
    assert report is not None
    assert next(row for row in report.rows if row.name == "aten::ones").cpu_bytes == 500 * 500 * 4
    assert not torch.autograd._profiler_enabled()


class _Record:
    """A record shaped as PyTorch's (``torch._C._autograd.ProfilerEvent``: its fields are methods of its
    class), for orders a real run rarely gives; each field read is counted in ``reads``."""

    reads: ClassVar[Counter[tuple[str, str]]] = Counter()

    def __init__(
        self,
        kind: str,
        name: str = "",
        handle: int = 0,
        host: int = 0,
        *,
        device: int = 0,
        thread: int = 1,
        is_async: bool = False,
    ) -> None:
        self.fields = {"kind": kind, "name": name, "handle": handle, "cpu_memory_usage": host, "thread_id": thread,
                       "is_async": is_async, "cuda_memory_usage": device, "shapes": []}  # fmt: skip

    def _read(self, field: str) -> Any:
        self.reads[self.fields["name"], field] += 1
        return self.fields[field]

    def kind(self) -> str:
        return str(self._read("kind"))

    def name(self) -> str:
        return str(self._read("name"))

    def handle(self) -> int:
        return int(self._read("handle"))

    def cpu_memory_usage(self) -> int:
        return int(self._read("cpu_memory_usage"))

    def cuda_memory_usage(self) -> int:
        return int(self._read("cuda_memory_usage"))

    def thread_id(self) -> int:
        return int(self._read("thread_id"))

    def is_async(self) -> bool:
        return bool(self._read("is_async"))

    def shapes(self) -> list[list[int]]:
        return list(self._read("shapes"))


def _figures(records: list[_Record]) -> tuple[dict[str, tuple[int, int, int]], int]:
    table = read_records([records])
    assert table is not None
    return {row.name: (row.calls, row.self_cpu_bytes, row.cpu_bytes) for row in table.rows}, table.calls


def test_calls_are_paired_by_handle_and_a_call_ended_after_its_parent_is_left_out() -> None:
    records = [
        _Record("mark", "__start_profile"),
        _Record("push", "outer", 1),
        _Record("push", "inner", 2),
        _Record("memory_alloc", host=100),
        _Record("pop", handle=1),  # outer ends first: inner never ended inside it
        _Record("pop", handle=2),
        _Record("push", "aten::is_leaf", 3),  # left out, as PyTorch leaves it out of its tables
        _Record("memory_alloc", host=8),
        _Record("pop", handle=3),
    ]
    rows, calls = _figures(records)
    assert calls == 2  # outer, and the memory record inside no call
    assert rows == {"outer": (1, 100, 100), MEMORY_EVENT: (1, 8, 8)}


def test_an_end_recorded_before_its_begin_leaves_the_call_out() -> None:
    records = [
        _Record("pop", handle=7),  # its begin came before the records: the call is left out, in order
        _Record("push", "late", 7),
        _Record("memory_alloc", host=50),
    ]
    assert _figures(records) == ({MEMORY_EVENT: (1, 50, 50)}, 1)


def test_whether_a_call_is_asynchronous_is_read_only_where_it_changes_the_table() -> None:
    _Record.reads.clear()
    records = [
        _Record("push", "outer", 1),
        _Record("push", "idle", 2, is_async=True),  # no memory, no children: async or not, nothing changes
        _Record("pop", handle=2),
        _Record("memory_alloc", host=100),
        _Record("pop", handle=1),
    ]
    assert _figures(records) == ({"outer": (1, 100, 100)}, 2)
    assert _Record.reads["idle", "is_async"] == 0
    assert _Record.reads["outer", "is_async"] == 1


def test_an_asynchronous_call_that_moved_memory_is_no_child() -> None:
    records = [
        _Record("push", "outer", 1),
        _Record("push", "block", 2, is_async=True),
        _Record("memory_alloc", host=100),
        _Record("pop", handle=2),
        _Record("pop", handle=1),
    ]
    # the block has a total and no self figure; the outer call's self keeps the block's bytes
    assert _figures(records) == ({"outer": (1, 100, 100), "block": (1, 0, 100)}, 2)


def test_an_asynchronous_call_beside_a_same_named_child_lets_it_merge() -> None:
    records = [
        _Record("push", "outer", 1),
        _Record("push", "outer", 2),
        _Record("memory_alloc", host=10),
        _Record("pop", handle=2),
        _Record("push", "idle", 3, is_async=True),  # not a child: "outer" has one child of its own name
        _Record("pop", handle=3),
        _Record("pop", handle=1),
    ]
    assert _figures(records) == ({"outer": (1, 10, 10)}, 2)


def test_a_call_ended_on_another_thread_is_asynchronous() -> None:
    records = [
        _Record("push", "outer", 1),
        _Record("push", "block", 2),
        _Record("memory_alloc", host=100),
        _Record("pop", handle=2, thread=2),
        _Record("pop", handle=1),
    ]
    assert _figures(records) == ({"outer": (1, 100, 100), "block": (1, 0, 100)}, 2)


def test_where_most_records_hold_device_bytes_their_host_field_is_read_where_needed() -> None:
    """Most records here hold device bytes: that field is read first, the host one only where it is 0."""
    _Record.reads.clear()
    records = [_Record("push", "step", 1)]
    records += [_Record("memory_alloc", device=512) for _ in range(9)]
    records += [_Record("memory_alloc", host=64), _Record("memory_alloc", device=-512), _Record("pop", handle=1)]
    table = read_records([records])
    assert table is not None
    (row,) = table.rows
    assert (row.name, row.self_cpu_bytes, row.cpu_bytes, row.self_device_bytes, row.device_bytes) == (
        "step",
        64,
        64,
        8 * 512,
        8 * 512,
    )
    assert _Record.reads["", "cuda_memory_usage"] == 11
    assert _Record.reads["", "cpu_memory_usage"] == 1 + 11  # the host record, and each record looked at first


def test_a_thread_that_recorded_memory_and_no_call_has_memory_rows_alone() -> None:
    records = [_Record("mark", "__start_profile"), _Record("memory_alloc", host=10), _Record("memory_alloc", host=-4)]
    assert _figures(records) == ({MEMORY_EVENT: (2, 6, 6)}, 2)
    assert read_records([]) == read_records([[]]) == ([], 0)


def test_a_call_without_a_handle_is_refused() -> None:
    assert read_records([[_Record("push", "outer"), _Record("pop")]]) is None
