"""The profile's fast read-back against PyTorch's own ``key_averages``, on real profiles of real torch.

Every workload is profiled once and read both ways: the rows of every operator that moved memory and the
number of calls must be the same. The workloads cover what the attribution has to get right: children
subtracted from a parent's self figure (a training step with autograd), a same-named only child merged
into its parent (nested ``record_function``), ``ProfilerStep#N`` grouped as one name, memory freed
outside any operator ("[memory]" rows), a block ended on another thread (async: no self figure, no
children). On the CPU PyTorch records the profiling thread's operators alone; calls
on other threads (autograd's device threads) and kernel launches linked to their operator are
compared on CUDA in ``test_profile_gpu.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from gpumem.core.diagnoses.profile import CellProfiler, operator_rows
from gpumem.core.diagnoses.profile_events import MEMORY_EVENT, OperatorMemory, read_operators

torch = pytest.importorskip("torch")


def _profiled(work: Callable[[], Any]) -> Any:
    activities = [torch.profiler.ProfilerActivity.CPU]
    recorder = torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=True)
    with recorder:
        work()
    return recorder


def _moving(rows: list[OperatorMemory]) -> list[OperatorMemory]:
    return sorted(row for row in rows if row.moved_memory())


def _both_ways(work: Callable[[], Any]) -> list[OperatorMemory]:
    recorder = _profiled(work)
    table = read_operators(recorder.profiler.kineto_results, torch)
    assert table is not None
    expected = operator_rows(recorder.key_averages(group_by_input_shape=True))
    assert _moving(table.rows) == _moving(expected)
    assert table.calls == sum(row.calls for row in expected)
    assert _moving(table.rows), "the workload moved no memory: the comparison proves nothing"
    return table.rows


def _training_steps() -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters())
    data = torch.randn(16, 64)
    for _ in range(5):
        optimizer.zero_grad()
        model(data).square().mean().backward()
        optimizer.step()


def test_a_training_loop_reads_as_key_averages() -> None:
    rows = _both_ways(_training_steps)
    linear = [row for row in rows if row.name == "aten::linear"]
    assert linear, rows
    assert all(row.self_cpu_bytes == 0 < row.cpu_bytes for row in linear), linear  # its children allocate


kept: list[Any] = []


def _nested_labels() -> None:
    for step in range(3):
        with torch.profiler.record_function(f"ProfilerStep#{step}"):
            with torch.profiler.record_function("outer"), torch.profiler.record_function("outer"):
                kept.append(torch.ones(100, 100))
            scratch = torch.zeros(1000)
        del scratch  # freed outside any operator: a "[memory]" row


def test_same_named_only_children_merge_and_steps_group() -> None:
    rows = _both_ways(_nested_labels)
    kept.clear()
    by_name = {row.name: row for row in rows}
    assert by_name["outer"].calls == 3  # the inner "outer" of each step merged into the outer one
    assert by_name["ProfilerStep*"].calls == 3
    assert by_name[MEMORY_EVENT].cpu_bytes < 0


def _blocks_ended_elsewhere() -> None:
    """A labelled block whose end waits on a future another thread completes: an async call."""
    for _ in range(3):
        future: Any = torch.futures.Future()
        with torch.profiler.record_function("async_block") as block:
            ended = block._call_end_callbacks_on_future(future)
            kept.append(torch.ones(1000))
            scratch = torch.zeros(500)
            del scratch  # freed inside the block, outside any operator: a self figure, were it synchronous
        helper = threading.Thread(target=lambda future=future: (time.sleep(0.005), future.set_result(None)))
        helper.start()
        ended.wait()
        helper.join()


def test_a_block_ended_on_another_thread_is_async() -> None:
    recorder = _profiled(_blocks_ended_elsewhere)
    ends = {
        event.end_thread_id() for event in recorder.profiler.kineto_results.events() if event.name() == "async_block"
    }
    starts = {event.start_thread_id() for event in recorder.profiler.kineto_results.events()}
    assert ends - starts, "the blocks ended on the profiling thread: nothing here is async"
    rows = _both_ways(_blocks_ended_elsewhere)
    kept.clear()
    block = next(row for row in rows if row.name == "async_block")
    assert (block.self_cpu_bytes, block.cpu_bytes) == (0, 3 * 4000)  # async: a total, never a self figure
    assert next(row for row in rows if row.name == "aten::zeros").cpu_bytes == 3 * 2000


def test_unexpected_results_are_refused_not_raised() -> None:
    class Broken:
        def events(self) -> list[Any]:
            return [object()]

    assert read_operators(Broken(), torch) is None


def test_the_report_falls_back_to_key_averages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpumem.core.diagnoses.profile.read_operators", lambda results, torch: None)
    profiler = CellProfiler()
    assert profiler.start() is None
    matrix = torch.ones(500, 500)
    report = profiler.stop(cell=None)
    del matrix
    assert report is not None
    ones = [row for row in report.rows if row.name == "aten::ones"]
    assert ones and ones[0].cpu_bytes == 500 * 500 * 4
