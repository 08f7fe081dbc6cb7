"""Every statement about pools, segments, rounding and fragmentation holds for the allocator in use, or is not
made: the backend read from torch or the environment, the summary worded for cudaMallocAsync, fragmentation
silent there, --trace's one line, and %gpumem status naming the allocator and its settings.

CPU torch has no CUDA allocator to ask, so the backend comes from the environment here (as before torch is
imported); the GPU tests (test_faults_gpu.py) set it in a fresh kernel, before CUDA starts.
"""

from __future__ import annotations

from typing import Any

import pytest

from _harness import run_cell_capture
from gpumem.core.cells import CellOptions, CellTracker
from gpumem.core.diagnoses.fragmentation import ReserveReader, read_segments, worth_a_look
from gpumem.core.diagnoses.summary import AllocatorSummary, build_summary
from gpumem.core.monitoring.monitor import Monitor
from gpumem.core.readers import allocator_backend as backend_module
from gpumem.core.readers.allocator_backend import (
    ASYNC,
    NATIVE,
    AllocatorBackend,
    allocator_backend,
    allocator_line,
    native_allocator,
    not_native_reason,
    parse_alloc_conf,
)
from gpumem.core.trace import TraceRecorder
from gpumem.testing import GIB, MIB, FakeSource

ASYNC_BACKEND = AllocatorBackend(ASYNC, "PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync", from_torch=True)
NATIVE_BACKEND = AllocatorBackend(NATIVE, None, None, from_torch=True)
# memory_stats under cudaMallocAsync with 1 GiB allocated, as seen on the H200: pools and segments read 0.
ASYNC_STATS = {
    "allocated_bytes.all.current": GIB,
    "allocated_bytes.all.peak": GIB,
    "allocated_bytes.large_pool.current": 0,
    "allocated_bytes.small_pool.current": 0,
    "reserved_bytes.all.current": GIB + 32 * MIB,
    "reserved_bytes.all.peak": GIB + 32 * MIB,
    "reserved_bytes.large_pool.current": 0,
    "active_bytes.all.current": 0,
    "inactive_split_bytes.all.current": 0,
    "segment.all.current": 0,
    "segment.large_pool.current": 0,
    "num_alloc_retries": 0,
    "num_ooms": 0,
    "num_device_alloc": 0,
    "num_device_free": 0,
}


@pytest.fixture(autouse=True)
def _no_cached_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test reads the backend afresh; CPU torch has no allocator to ask, as in a build without CUDA."""
    monkeypatch.setattr(backend_module, "_cache", backend_module._Cache())
    torch = pytest.importorskip("torch")
    if hasattr(torch._C, "_cuda_getAllocatorBackend"):
        monkeypatch.delattr(torch._C, "_cuda_getAllocatorBackend")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)


@pytest.fixture
def async_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")


def test_the_setting_is_parsed_as_pytorch_reads_it() -> None:
    assert parse_alloc_conf("backend:cudaMallocAsync, expandable_segments:True") == {
        "backend": "cudaMallocAsync",
        "expandable_segments": "True",
    }
    assert allocator_backend({}) == AllocatorBackend(NATIVE, None, None, from_torch=False)
    found = allocator_backend({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,backend:cudaMallocAsync"})
    assert found.name == ASYNC and not found.native and found.variable == "PYTORCH_CUDA_ALLOC_CONF"
    both = {"PYTORCH_ALLOC_CONF": "backend:native", "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    assert allocator_backend(both).native  # the newer name wins, as in PyTorch
    assert allocator_backend({"PYTORCH_CUDA_ALLOC_CONF": "backend:CUDAMALLOCASYNC"}).name == ASYNC


def test_torch_is_asked_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    calls: list[int] = []

    def ask() -> str:
        calls.append(1)
        return ASYNC

    monkeypatch.setattr(torch._C, "_cuda_getAllocatorBackend", ask, raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    assert allocator_backend() == ASYNC_BACKEND
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:native")  # too late: torch chose at load time
    assert not native_allocator()
    assert calls == [1]
    assert allocator_line() == (
        "CUDA's stream-ordered allocator, cudaMallocAsync; settings: PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync"
    )


def test_the_summary_under_cuda_malloc_async_shows_only_what_means_something() -> None:
    summary = AllocatorSummary(0, ASYNC_STATS, None, ASYNC_BACKEND)
    assert [figure.key for figure in summary.figures] == ["allocated_bytes.all", "reserved_bytes.all", "free_reserve"]
    text, page = repr(summary), summary._repr_html_()
    assert text.splitlines()[0] == "gpumem summary of cuda:0 (CUDA's stream-ordered allocator, cudaMallocAsync)"
    assert "  allocated      1.0 GiB  1.0 GiB  in tensors now (torch.cuda.memory_allocated)" in text
    rows = "\n".join(text.splitlines()[1:-1])  # the table, without its title and note
    for claim in ("large pool", "small pool", "segment", "512 B", "rounded", "largest free block", "empty_cache"):
        assert claim not in rows, claim
    assert summary.notes() == [
        (
            "CUDA's pool allocates here (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync): PyTorch's pools, "
            "segments, 512 B rounding, fragmentation and event counters do not apply, so only allocated and "
            "reserved are shown."
        )
    ]
    assert "CUDA&#x27;s stream-ordered allocator" in page and "large pool" not in page


def test_the_native_summary_keeps_its_pools_and_words_expandable_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    stats = {**ASYNC_STATS, "allocated_bytes.large_pool.current": GIB, "segment.all.current": 3}
    native = build_summary(stats, 0, None)
    assert native.title == "gpumem summary of cuda:0 (PyTorch's caching allocator)"
    assert native.figure("allocated_bytes.large_pool").meaning.endswith(
        "or the request rounded up to 2 MiB above 10 MiB"
    )
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    expandable = build_summary(stats, 0, None)
    assert expandable.figure("allocated_bytes.large_pool").meaning == (
        "requests over 1 MiB; expandable segments that grow and shrink in place"
    )


def _fragmented(source: FakeSource) -> None:
    for handle in [source.allocate(GIB) for _ in range(12)]:
        source.free(handle)
    for _ in range(12):
        source.allocate(600 * MIB)


def test_fragmentation_is_silent_under_cuda_malloc_async(monkeypatch: pytest.MonkeyPatch) -> None:
    for setting, expected in (("backend:native", ["fragmentation"]), ("backend:cudaMallocAsync", [])):
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", setting)
        source = FakeSource(segments=True)
        tracker = CellTracker(Monitor(source), start_sampler=False)
        cell = tracker.begin("parts = 12 x 600 MiB", options=CellOptions())
        _fragmented(source)
        record = tracker.end(cell)
        assert [warning.kind for warning in record.warnings] == expected, setting
        assert bool(tracker.standing_conditions()) == bool(expected)
        reading = source.snapshot().allocator[0]
        assert worth_a_look(None, reading) == bool(expected)
        assert (read_segments(source) is None) == (not expected)
        assert bool(ReserveReader().read(source, [reading])) == bool(expected)
        tracker.close()


def test_trace_says_in_one_line_that_allocation_sites_need_the_native_allocator(
    monkeypatch: pytest.MonkeyPatch, async_env: None
) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # CPU torch: the device check passes
    reason = TraceRecorder().start()
    assert reason == (
        "allocation sites need PyTorch's native caching allocator, and this process uses CUDA's stream-ordered "
        "allocator, cudaMallocAsync (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync): restart the kernel with "
        "PYTORCH_CUDA_ALLOC_CONF unset or set to backend:native"
    )
    assert not_native_reason("allocation sites") == reason
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:native")
    assert not_native_reason("allocation sites") is None


def test_trace_and_status_in_the_shell(ip: Any, monkeypatch: pytest.MonkeyPatch, async_env: None) -> None:
    from gpumem.core.monitoring.monitor import set_default_monitor

    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    set_default_monitor(Monitor(FakeSource()))
    ip.user_ns["torch"] = torch
    try:
        assert ip.run_cell("%load_ext gpumem").success
        result, cap = run_cell_capture(ip, "%%gpumem --trace\nx = torch.ones(4)")
        assert result.success and "Traceback" not in cap.stdout + cap.stderr
        (line,) = [text for text in cap.stdout.splitlines() if "--trace" in text]
        assert line.startswith("gpumem: --trace: allocation sites need PyTorch's native caching allocator")
        assert line.endswith("set to backend:native; the cell runs without a trace.")
        assert "RuntimeError" not in cap.stdout
        _, cap = run_cell_capture(ip, "%gpumem status")
        assert (
            "  alloc    CUDA's stream-ordered allocator, cudaMallocAsync (read from the environment); settings: "
            "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync"
        ) in cap.stdout.splitlines()
    finally:
        ip.run_cell("%unload_ext gpumem")
        set_default_monitor(None)
