"""``--profile``'s default recorder (PyTorch's CPU-side operator records) against ``key_averages``.

The two recorders cannot run at once, so each workload runs three times: once under the Kineto
profiler to settle what was allocated before (the profiler cannot size a free of a block allocated
while no profiler ran), then under the records recorder, then under Kineto again, each run starting
from the same state. The rows of every operator that moved memory and the number of calls must be
the same. CUDA (autograd's device thread) is compared in ``test_profile_gpu.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
    """A record shaped as PyTorch's (``torch._C._autograd.ProfilerEvent``), for orders a real run rarely gives."""

    def __init__(self, kind: str, name: str = "", handle: int = 0, host: int = 0, thread: int = 1) -> None:
        self._fields = {"kind": kind, "name": name, "handle": handle, "cpu_memory_usage": host, "thread_id": thread}

    def __getattr__(self, field: str) -> Callable[[], Any]:
        if field in self._fields:
            return lambda: self._fields[field]
        return {"cuda_memory_usage": lambda: 0, "is_async": lambda: False, "shapes": list}[field]


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
    table = read_records([records])
    assert table is not None
    assert table.calls == 2  # outer, and the memory record inside no call
    assert {row.name: (row.calls, row.self_cpu_bytes, row.cpu_bytes) for row in table.rows} == {
        "outer": (1, 100, 100),
        MEMORY_EVENT: (1, 8, 8),
    }


def test_a_call_without_a_handle_is_refused() -> None:
    assert read_records([[_Record("push", "outer"), _Record("pop")]]) is None
