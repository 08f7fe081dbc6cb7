"""A poisoned CUDA context: recognised once from the cell's error (or a failing gpumem call), recorded per
device, said once under that cell, in %gpumem status and the panel's header; later reports say the CUDA
figures are frozen, free says CUDA could not be emptied, and the allocator is not read nor called again
while NVML and host memory still are.

The fake allocator plays the device (CPU torch cannot make a device-side assert); the error is the one
torch raises. test_faults_gpu.py makes a real one in a real kernel.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from _harness import run_cell_capture
from gpumem.core.cells import CellOptions, CellTracker
from gpumem.core.cells.report import CellReport, CellSummary
from gpumem.core.cleanup import free
from gpumem.core.monitoring.monitor import Monitor, set_default_monitor
from gpumem.core.readers.cuda_fault import (
    FROZEN_PREFIX,
    clear_faults,
    cuda_faults,
    is_sticky_cuda_error,
    record_fault,
    sticky_cuda_error,
)
from gpumem.panel.header import build_header
from gpumem.testing import MIB, FakeSource

ASSERT_TEXT = (
    "CUDA error: device-side assert triggered\nSearch for `cudaErrorAssert' in "
    "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might "
    "be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
)


def device_assert() -> BaseException:
    """The error torch raises after a device-side assert."""
    torch = pytest.importorskip("torch")
    error: BaseException = torch.AcceleratorError(ASSERT_TEXT)
    return error


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    clear_faults()
    yield
    clear_faults()


class CountingSource(FakeSource):
    """The fake allocator, counting the calls that would reach CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        super().empty_cache()

    def reset_peaks(self, devices: Any) -> None:
        self.calls.append(f"reset_peaks {list(devices)}")
        super().reset_peaks(devices)


def test_which_errors_poison_the_context() -> None:
    assert sticky_cuda_error(device_assert()) == "device-side assert triggered"
    assert is_sticky_cuda_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    wrapped = ValueError("while loading")
    wrapped.__cause__ = RuntimeError("CUDA error: unspecified launch failure")
    assert is_sticky_cuda_error(wrapped)
    assert not is_sticky_cuda_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_sticky_cuda_error(RuntimeError("index 5 is out of bounds for dimension 0 with size 2"))
    assert not is_sticky_cuda_error(ValueError("device-side assert triggered"))  # a user's own message
    assert not is_sticky_cuda_error(None)


def test_recorded_once_per_device() -> None:
    first = record_fault(device_assert(), 7, device=0)
    assert first is not None and first.cell == 7 and first.where == "since cell [7]"
    assert first.error.endswith("Error: CUDA error: device-side assert triggered")
    assert record_fault(device_assert(), 8, device=0) is None  # already known: not said again
    assert record_fault(RuntimeError("shape mismatch"), 9, device=1) is None
    assert list(cuda_faults()) == [0]


def test_the_cell_says_it_once_and_later_cells_say_frozen() -> None:
    source = CountingSource()
    tracker = CellTracker(Monitor(source), start_sampler=False)
    kept = source.allocate(256 * MIB)
    cell = tracker.begin("v[torch.tensor([5], device='cuda')]", options=CellOptions(mode="magic"), execution_count=4)
    source.allocate(8 * MIB)
    record = tracker.end(cell, error=device_assert())
    warning = record.warnings[0]
    assert warning.kind == "cuda-error"
    assert warning.message.startswith(
        "CUDA on cuda:0 is in an error state after this cell (torch.AcceleratorError: CUDA error: device-side "
        "assert triggered): every later CUDA call in this process fails, so gpumem's CUDA figures are frozen at "
        "the last good reading: allocated 264.0 MiB, reserved 264.0 MiB; NVML and host memory are still read. "
        "Only restarting the kernel clears it"
    )
    assert record.devices[0].allocated_delta_bytes == 8 * MIB  # the cell's own figures, read as it ended
    assert warning.message in repr(CellReport(record)) and warning.message[:60] in repr(CellSummary(record))

    calls = len(source.calls)
    source.free(kept)  # the counters would still move: gpumem no longer reads them
    later = tracker.begin("print(1)", options=CellOptions(mode="magic"), execution_count=5)
    record = tracker.end(later)
    assert record.devices == () and [w.kind for w in record.warnings] == []
    assert record.cuda_note is not None and record.cuda_note.startswith(
        f"{FROZEN_PREFIX}: CUDA is in an error state on cuda:0 since cell [4] (the last good reading: allocated "
        "264.0 MiB, reserved 264.0 MiB); only a kernel restart clears it"
    )
    assert "cuda:0   allocated" not in repr(CellReport(record)) and record.cuda_note in repr(CellReport(record))
    assert "CUDA figures frozen: CUDA is in an error state on cuda:0 since cell [4]" in repr(CellSummary(record))
    snapshot = source.snapshot()
    assert snapshot.allocator == () and snapshot.devices and snapshot.host is not None  # NVML and host still read
    assert source.calls[calls:] == []  # no peak reset (nor anything else) on the faulted device
    assert source.status()["torch"].startswith("unavailable: cuda:0 in an error state since cell [4]")
    tracker.close()


def test_free_says_cuda_could_not_be_emptied() -> None:
    source = CountingSource()
    source.allocate(MIB)
    record_fault(device_assert(), 3, source.snapshot().allocator, device=0)
    result = free(source=source, shell=None)
    text = result.describe()
    assert "empty_cache" not in source.calls
    assert "CUDA could not be emptied: cuda:0 in an error state since cell [3]" in text
    assert "only a kernel restart clears it" in text


def test_a_failing_empty_cache_is_recognised_and_not_called_again() -> None:
    class Poisoned(CountingSource):
        def empty_cache(self) -> None:
            self.calls.append("empty_cache")
            raise device_assert()

    source = Poisoned()
    source.allocate(MIB)
    first = free(source=source, shell=None)
    assert "CUDA could not be emptied: cuda:0 in an error state since gpumem saw it" in first.describe()
    free(source=source, shell=None)
    assert source.calls.count("empty_cache") == 1


def test_the_sampler_records_a_sticky_error_from_a_read_and_stops_reading() -> None:
    class FailsOnce(FakeSource):
        def __init__(self) -> None:
            super().__init__()
            self.failed = False

        def snapshot(self, *, process_memory: bool = False) -> Any:
            if not self.failed:
                self.failed = True
                raise device_assert()
            return super().snapshot(process_memory=process_memory)

    monitor = Monitor(FailsOnce(), rate_hz=50)
    monitor.start()
    try:
        deadline = time.monotonic() + 5
        while not cuda_faults() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        monitor.stop()
    assert list(cuda_faults()) == [0]


def test_the_panel_header_says_so() -> None:
    source = FakeSource()
    source.allocate(MIB)
    record_fault(device_assert(), 2, source.snapshot().allocator, device=0)
    header = build_header(source.snapshot(), {}, {}, None, source.status())
    (note,) = header.notes
    assert note.startswith("CUDA error: cuda:0 in an error state since cell [2] (")
    assert note.endswith("only a kernel restart clears it. Device used (NVML) and host memory are still read.")
    assert header.host is not None and header.devices and header.devices[0].used_bytes is not None


@pytest.fixture
def auto_shell(ip: Any) -> Iterator[tuple[Any, CountingSource]]:
    source = CountingSource()
    set_default_monitor(Monitor(source, rate_hz=50))
    ip.user_ns.update(src=source, MIB=MIB, boom=device_assert())
    assert ip.run_cell("%load_ext gpumem").success
    assert ip.run_cell("%gpumem auto on").success
    try:
        yield ip, source
    finally:
        ip.run_cell("%unload_ext gpumem")
        set_default_monitor(None)


def test_in_the_shell_once_under_the_cell_then_status_free_and_reports(auto_shell: tuple[Any, Any]) -> None:
    ip, source = auto_shell
    assert ip.run_cell("h = src.allocate(300 * MIB)").success
    result, cap = run_cell_capture(ip, "src.allocate(4 * MIB); raise boom")
    assert not result.success
    said = [output.data["text/plain"] for output in cap.outputs if "error state" in output.data["text/plain"]]
    assert len(said) == 1 and "frozen at the last good reading: allocated 304.0 MiB" in said[0]
    calls = len(source.calls)
    for _ in range(3):
        result, cap = run_cell_capture(ip, "import time; time.sleep(0.1); src.allocate(64 * MIB)")
        assert result.success and "error state" not in cap.stdout + str([o.data for o in cap.outputs])
    assert source.calls[calls:] == []
    _, cap = run_cell_capture(ip, "%gpumem status")
    assert "  torch    unavailable: cuda:0 in an error state since cell [1]" in cap.stdout
    assert "  nvml     ok" in cap.stdout and "host RAM RSS" in cap.stdout
    assert "  cuda:0   PyTorch's figures frozen since cell [1], device used " in cap.stdout
    _, cap = run_cell_capture(ip, "%gpumem free")
    assert "CUDA could not be emptied: cuda:0 in an error state since cell [1]" in cap.stdout + str(
        [o.data for o in cap.outputs]
    )
    _, cap = run_cell_capture(ip, "%%gpumem --trace --profile\nx = 1")
    for option in ("--trace", "--profile"):
        (line,) = [text for text in cap.stdout.splitlines() if text.startswith(f"gpumem: {option}: ")]
        assert line.startswith(f"gpumem: {option}: cuda:0 in an error state since cell [1] (torch.AcceleratorError")
        assert line.endswith(f"only a kernel restart clears it; the cell runs without a {option[2:]}.")
    report = cap.outputs[0].data["text/plain"]
    assert "CUDA figures frozen: CUDA is in an error state on cuda:0 since cell [1]" in report
    assert "cuda:0   allocated" not in report  # not ±0 B: unknown


def test_an_unmeasured_cell_is_explained_too(ip: Any) -> None:
    set_default_monitor(Monitor(FakeSource()))
    ip.user_ns["boom"] = device_assert()
    try:
        assert ip.run_cell("%load_ext gpumem").success
        assert ip.run_cell("%gpumem auto off").success
        _, cap = run_cell_capture(ip, "raise boom")
        assert cap.stdout.count("error state after this cell") == 1
        _, cap = run_cell_capture(ip, "raise boom")
        assert "error state" not in cap.stdout
    finally:
        ip.run_cell("%unload_ext gpumem")
        set_default_monitor(None)


def test_a_peak_reset_that_fails_so_is_recognised() -> None:
    """An error the user's own code caught (try/except) still shows when gpumem's next call fails with it."""

    class Poisoned(CountingSource):
        def reset_peaks(self, devices: Any) -> None:
            self.calls.append("reset_peaks")
            raise device_assert()

    source = Poisoned()
    source.transient(64 * MIB)  # the peak stands above current use: the next cell resets it
    tracker = CellTracker(Monitor(source), start_sampler=False)
    cell = tracker.begin("x = 1", options=CellOptions(mode="magic"))
    record = tracker.end(cell)
    assert list(cuda_faults()) == [0] and cuda_faults()[0].where == "since gpumem saw it"
    assert record.devices == () and record.cuda_note is not None and record.cuda_note.startswith(FROZEN_PREFIX)
    (warning,) = record.warnings  # said here, the first cell that saw it
    assert warning.message.startswith(
        "CUDA on cuda:0 is in an error state (a call gpumem made failed with it) (torch.AcceleratorError: CUDA "
        "error: device-side assert triggered): every later CUDA call in this process fails"
    )
    cell = tracker.begin("x = 2", options=CellOptions(mode="magic"))
    assert tracker.end(cell).warnings == ()  # not again
    assert source.calls == ["reset_peaks"]
    tracker.close()


def test_the_summary_says_its_counters_are_the_last_ones() -> None:
    from gpumem.core.diagnoses.summary import build_summary

    record_fault(device_assert(), 3, device=0)
    (note,) = build_summary({"allocated_bytes.all.current": MIB}, 0, None).notes()
    assert note.startswith("cuda:0 in an error state since cell [3] (torch.AcceleratorError: CUDA error: device-side")
    assert note.endswith("only a kernel restart clears it: these are PyTorch's last counts, not memory it can use.")
    assert "error state" not in str(build_summary({"allocated_bytes.all.current": MIB}, 1, None).notes())
