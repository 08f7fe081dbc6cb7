"""``%%gpumem --profile`` and ``%gpumem summary`` on a real CUDA GPU. Bytes are exact: every size here
is a multiple of 2 MiB, so the allocator's block is the size asked for, and the profiler reports
block sizes; the summary's figures are compared with ``torch.cuda.memory_stats`` read right after."""

from __future__ import annotations

from typing import Any

import pytest

from _harness import run_cell_capture
from gpumem.core.diagnoses.profile import CellProfiler, operator_rows
from gpumem.core.diagnoses.profile_events import read_operators
from gpumem.core.diagnoses.profile_records import RecordsProfiler, read_records
from gpumem.core.diagnoses.summary import summaries
from gpumem.core.readers.sources import SystemSource
from gpumem.core.units import format_bytes

pytestmark = pytest.mark.gpu

MIB = 1 << 20


def _profile_text(cap: Any) -> str:
    texts = [output.data.get("text/plain", "") for output in cap.outputs]
    found = [text for text in texts if text.startswith("gpumem profile of")]
    assert len(found) == 1, texts
    return found[0]


def test_profile_lists_the_operator_that_allocated_most_on_cuda(gpu: Any) -> None:
    first = "base = torch.empty(64 * MIB, dtype=torch.uint8, device='cuda:0')"
    assert run_cell_capture(gpu, first)[0].success  # cell [1]
    cell = "%%gpumem --profile\nsmall = torch.empty(16 * MIB, dtype=torch.uint8, device='cuda:0')\nbig = base.float()"
    result, cap = run_cell_capture(gpu, cell)  # cell [2]
    assert result.success, cap.stderr
    text = _profile_text(cap)
    lines = text.splitlines()
    assert lines[0] == "gpumem profile of cell [2]: operators by memory, CPU and CUDA"
    assert lines[1].split()[:3] == ["operator", "input", "shapes"]
    top = lines[2].split()
    assert top[0] == "aten::empty_strided", text  # where aten::_to_copy allocates its 256 MiB float32 result
    assert " ".join(top).endswith("256.0 MiB 256.0 MiB"), text  # self and total CUDA
    to_row = next(line for line in lines if line.strip().startswith("aten::to "))
    assert to_row.rstrip().endswith("256.0 MiB"), text  # its total: the copy it made
    assert "host memory changed by" in text


def test_profiler_rows_are_exact_on_cuda(gpu: Any) -> None:
    torch = gpu.user_ns["torch"]
    profiler = CellProfiler()
    assert profiler.start() is None
    kept = torch.empty(128 * MIB, dtype=torch.uint8, device="cuda:0")
    report = profiler.stop(cell=None)
    assert report is not None
    assert report.cuda
    top = report.rows[0]
    assert (top.name, top.self_device_bytes, top.device_bytes, top.calls) == ("aten::empty", 128 * MIB, 128 * MIB, 1)
    assert top.self_cpu_bytes == 0
    del kept


def test_summary_figures_are_memory_stats(gpu: Any) -> None:
    torch = gpu.user_ns["torch"]
    assert gpu.run_cell("x = torch.empty(64 * MIB, dtype=torch.uint8, device='cuda:0')").success
    (summary,) = summaries(SystemSource(), (0,))
    stats = torch.cuda.memory_stats(0)
    for key in ("allocated_bytes.all", "reserved_bytes.large_pool", "active_bytes.small_pool", "segment.all"):
        figure = summary.figure(key)
        assert (figure.current, figure.peak) == (stats[f"{key}.current"], stats[f"{key}.peak"]), key
    for key in ("num_alloc_retries", "num_ooms", "num_device_alloc"):
        if key in stats:
            assert summary.figure(key).current == stats[key], key
    assert summary.figure("free_reserve").current == (
        stats["reserved_bytes.all.current"] - stats["allocated_bytes.all.current"]
    )

    assert gpu.run_cell("del x").success  # its 64 MiB segment is now wholly free
    result, cap = run_cell_capture(gpu, "%gpumem summary -d 0")
    assert result.success, cap.stderr
    text = cap.outputs[0].data["text/plain"]
    stats = torch.cuda.memory_stats(0)
    allocated = format_bytes(stats["allocated_bytes.all.current"])
    assert any(line.split()[:3] == ["allocated", *allocated.split()] for line in text.splitlines()), text
    (after,) = summaries(SystemSource(), (0,))
    assert after.figure("largest_free_block").current == 64 * MIB
    assert after.figure("releasable").current >= 64 * MIB  # the 64 MiB segment, and any other empty one


def test_summary_refuses_a_device_that_does_not_exist(gpu: Any) -> None:
    torch = gpu.user_ns["torch"]
    missing = torch.cuda.device_count()
    result, cap = run_cell_capture(gpu, f"%gpumem summary -d {missing}")
    assert type(result.error_in_exec).__name__ == "UsageError"
    assert f"--device cuda:{missing}: no such device" in cap.stderr + cap.stdout


def test_fast_read_back_equals_key_averages_on_cuda(gpu: Any) -> None:
    """A CUDA training loop read both ways: the same rows and calls. Backward runs on autograd's device
    thread and kernel launches link to their operators, so both are exercised (and checked to be)."""
    torch = gpu.user_ns["torch"]
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    data = torch.randn(64, 256, device="cuda")
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=True) as recorder:
        for _ in range(5):
            optimizer.zero_grad()
            model(data).square().mean().backward()
            optimizer.step()
        torch.cuda.synchronize()
    results = recorder.profiler.kineto_results
    events = results.events()
    assert len({event.start_thread_id() for event in events}) > 1, "one thread: the nesting per thread is untested"
    assert any(event.linked_correlation_id() > 0 for event in events), "no linked runtime calls"
    table = read_operators(results, torch)
    assert table is not None
    expected = operator_rows(recorder.key_averages(group_by_input_shape=True))
    moving = sorted(row for row in expected if row.moved_memory())
    assert sorted(row for row in table.rows if row.moved_memory()) == moving
    assert any(row.device_bytes for row in moving)
    assert table.calls == sum(row.calls for row in expected)


def test_records_recorder_equals_key_averages_on_cuda(gpu: Any) -> None:
    """``--profile``'s default recorder against Kineto's ``key_averages`` on a CUDA training loop: the
    same rows and calls. Backward runs on autograd's device thread, so more than one thread records."""
    torch = gpu.user_ns["torch"]
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    data = torch.randn(64, 256, device="cuda")

    def steps() -> None:
        for _ in range(5):
            optimizer.zero_grad()
            model(data).square().mean().backward()
            optimizer.step()
        torch.cuda.synchronize()

    def kineto() -> list[Any]:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=True) as recorder:
            steps()
        return operator_rows(recorder.key_averages(group_by_input_shape=True))

    kineto()  # each measured run starts from the same state: the blocks before it allocated while recording
    recorder = RecordsProfiler(torch)
    recorder.start()
    try:
        steps()
    finally:
        records = recorder.stop()
    assert len([thread for thread in records if thread]) > 1, "one thread: backward's device thread is untested"
    table = read_records(records)
    assert table is not None
    expected = kineto()
    moving = sorted(row for row in expected if row.moved_memory())
    assert sorted(row for row in table.rows if row.moved_memory()) == moving
    assert any(row.device_bytes for row in moving)
