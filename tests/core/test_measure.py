"""gpumem.measure: the per-cell report for a block of a script."""

from __future__ import annotations

import gc
import json

import pytest

import gpumem
from _harness import fresh_pages
from gpumem.core.cells.record import CellRecord
from gpumem.core.cells.report import CellReport, record_to_dict
from gpumem.core.monitoring.monitor import Monitor, default_monitor, set_default_monitor
from gpumem.core.monitoring.spans import SpanRecord
from gpumem.core.readers.readings import Snapshot
from gpumem.core.readers.sources import HostSource
from gpumem.core.scripts.memory_report import report_rows
from gpumem.core.scripts.script_recorder import metrics_of
from gpumem.core.sessions.session_file import record_from_dict
from gpumem.testing import GIB, MIB, FakeSource

# The device figures only a measured stretch asks NVML for (its full report splits "device used" with them).
NVML_SPLIT = dict.fromkeys(("process_used_after_bytes", "driver_reserved_after_bytes", "others_used_after_bytes"))


@pytest.fixture
def fake() -> FakeSource:
    source = FakeSource()
    previous = set_default_monitor(Monitor(source))
    yield source
    set_default_monitor(previous)


def test_a_block_is_measured_like_a_cell(fake: FakeSource) -> None:
    kept = fake.allocate(GIB)
    with gpumem.measure("epoch 1") as m:
        fake.allocate(256 * MIB)
        fake.transient(2 * GIB)
    record = m.record
    assert record is not None
    change = record.devices[0]
    assert change.allocated_delta_bytes == 256 * MIB
    assert change.peak_above_start_bytes == 2 * GIB + 256 * MIB
    assert record.status == "ok"
    assert "epoch 1" in repr(m.report)
    assert gpumem.measured()[-1] is record
    fake.free(kept)


def test_an_exception_is_recorded_and_still_raised(fake: FakeSource) -> None:
    with pytest.raises(ZeroDivisionError), gpumem.measure("bad block") as m:
        1 / 0  # noqa: B018
    assert m.record is not None and m.record.status == "error"


def test_sampling_runs_only_inside_the_block(fake: FakeSource) -> None:
    with gpumem.measure("block"):
        assert default_monitor().running
    assert not default_monitor().running


def test_bad_labels_are_refused() -> None:
    with pytest.raises(ValueError, match="label"):
        gpumem.measure("")
    with pytest.raises(RuntimeError, match="not finished"):
        _ = gpumem.measure("x").report


def test_nested_blocks_each_get_one_true_record(fake: FakeSource) -> None:
    before = len(gpumem.measured())
    with gpumem.measure("outer") as outer:
        fake.transient(4 * GIB)
        with gpumem.measure("inner") as inner:
            assert default_monitor().running
            kept = fake.allocate(GIB)
        assert default_monitor().running  # the inner block's end leaves the outer one sampled
    records = gpumem.measured()[before:]
    assert [(r.first_line, r.status) for r in records] == [("inner", "ok"), ("outer", "ok")]
    assert outer.record is records[1] and inner.record is records[0]
    outer_change, inner_change = outer.record.devices[0], inner.record.devices[0]
    # The inner block did not reset the counters, so the outer peak is still exact; the inner one says
    # it kept them.
    assert outer_change.peak_exact and outer_change.peak_above_start_bytes == 4 * GIB
    assert inner.record.keep_peaks and inner_change.allocated_delta_bytes == GIB
    assert not default_monitor().running
    fake.free(kept)


def test_blocks_on_several_threads_do_not_end_each_other(fake: FakeSource) -> None:
    import threading

    before = len(gpumem.measured())
    started = threading.Barrier(3)

    def work(index: int) -> None:
        with gpumem.measure(f"thread {index}"):
            started.wait(timeout=10)

    threads = [threading.Thread(target=work, args=(index,)) for index in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    records = gpumem.measured()[before:]
    assert sorted(r.first_line for r in records) == ["thread 0", "thread 1", "thread 2"]
    assert {r.status for r in records} == {"ok"}


def test_a_block_cannot_be_entered_twice(fake: FakeSource) -> None:
    block = gpumem.measure("twice")
    assert "not started" in repr(block)
    with pytest.raises(RuntimeError, match="already being measured"), block, block:
        pass
    assert block.record is not None and block.record.status == "error"


def test_bad_devices_and_namespaces_name_the_parameter() -> None:
    with pytest.raises(TypeError, match=r"measure\(devices=\.\.\.\)"):
        gpumem.measure("x", devices=["a"])
    with pytest.raises(ValueError, match=r"measure\(devices=\.\.\.\)"):
        gpumem.measure("x", devices=[-1])
    with pytest.raises(TypeError, match=r"measure\(namespace=\.\.\.\)"):
        gpumem.measure("x", namespace=5)  # type: ignore[arg-type]
    assert gpumem.measure("x", devices=1).options.devices == (1,)


def test_the_reset_counter_is_one_wrapper_whatever_the_trackers(
    fake: FakeSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The extension's tracker and measure()'s alternate in a notebook; the wrapper must not stack."""
    import sys
    import types

    from gpumem.core.cells import CellTracker

    calls: list[int] = []
    torch_c = types.SimpleNamespace(_cuda_resetPeakMemoryStats=calls.append)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(_C=torch_c))
    original = torch_c._cuda_resetPeakMemoryStats
    cells = CellTracker(default_monitor(), start_sampler=False)
    for _ in range(50):
        cell = cells.begin("cell")  # automatic mode measures a cell ...
        with gpumem.measure("block"):  # ... that measures a block
            pass
        cells.end(cell)
    cell = cells.begin("cell")
    with gpumem.measure("block"):
        wrapper = torch_c._cuda_resetPeakMemoryStats
        assert wrapper is not original
        assert any(slot.cell_contents is original for slot in wrapper.__closure__ or ())  # wraps torch's own
        wrapper(0)
        assert calls == [0]
    assert torch_c._cuda_resetPeakMemoryStats is wrapper  # the cell still runs
    cells.end(cell)
    assert torch_c._cuda_resetPeakMemoryStats is original  # nothing is measured: torch's own function again
    cells.close()


def test_a_measured_block_and_a_tracked_scope_are_one_kind_of_stretch(fake: FakeSource) -> None:
    monitor = default_monitor()
    kept = fake.allocate(GIB)
    fake.transient(3 * GIB)  # a raised counter, which each of them resets when it starts
    changes = []
    for measuring in ("measure", "track"):
        block = gpumem.measure(measuring) if measuring == "measure" else monitor.track(measuring)
        with block:
            grown = fake.allocate(256 * MIB)
            fake.transient(2 * GIB)
        assert block.record is not None
        changes.append(block.record.devices[0])
        fake.free(grown)
        fake.transient(3 * GIB)
    measured, tracked = changes
    assert type(measured) is type(tracked)
    # The same figures, by the same code; only a measured block asks NVML for this process's share (and
    # the driver's and the other processes') too.
    assert measured.process_used_after_bytes is not None and tracked.process_used_after_bytes is None
    assert measured.driver_reserved_after_bytes is not None and tracked.driver_reserved_after_bytes is None
    assert measured.others_used_after_bytes is not None and tracked.others_used_after_bytes is None
    assert measured._replace(**NVML_SPLIT) == tracked
    assert measured.peak_exact and measured.peak_above_start_bytes == 2 * GIB + 256 * MIB
    assert tracked.allocated_bytes == tracked.allocated_after_bytes == GIB + 256 * MIB  # a scope's "now"
    monitor.stop()
    fake.free(kept)


class _HostOfThisProcess(FakeSource):
    """Fake CUDA devices, and this process's real resident memory (the host figures of both records)."""

    def __init__(self) -> None:
        super().__init__()
        self.host_reader = HostSource()

    def snapshot(self, *, process_memory: bool = False) -> Snapshot:
        return super().snapshot(process_memory=process_memory)._replace(host=self.host_reader.read())


def test_a_measured_block_and_a_tracked_scope_leave_one_type_of_record() -> None:
    gc.collect()  # earlier tests' garbage, which a collection inside a block would free and take from its RSS
    source = _HostOfThisProcess()
    previous = set_default_monitor(Monitor(source))
    records = []
    try:
        for block in (gpumem.measure("block"), default_monitor().track("block")):
            with block:
                grown = source.allocate(256 * MIB)
                source.transient(GIB)
                pages = fresh_pages(64 * MIB)
            records.append(block.record)
            source.free(grown)
            source.empty_cache()  # both start from the same device figures
            pages.close()
    finally:
        set_default_monitor(previous)
    measured, tracked = records
    assert type(measured) is type(tracked) is SpanRecord is CellRecord
    assert (measured.label, measured.first_line, measured.status, measured.error) == ("block", "block", "ok", None)
    assert (tracked.label, tracked.first_line, tracked.status, tracked.error) == ("block", "block", "ok", None)
    assert (measured.kind, tracked.kind, tracked.path) == ("cell", "scope", ("block",))
    # The same device figures; only a measured block also asks NVML for this process's share (its full report
    # splits "device used" with it).
    assert [change._replace(**NVML_SPLIT) for change in measured.devices] == list(tracked.devices)
    assert tracked.devices[0].peak_exact and tracked.devices[0].peak_above_start_bytes == GIB + 256 * MIB
    for record in records:
        assert record.host is not None and record.host.rss_delta_bytes >= 48 * MIB, record.host
        assert record.host.peak_above_start_bytes >= record.host.rss_delta_bytes
        assert record.monotonic_s is not None and record.wall_time_s >= record.started_wall_s
    # One record, one set of renderers: each path's record goes through the other's.
    assert "block" in repr(CellReport(tracked)) and "+256.0 MiB" in repr(CellReport(tracked))
    # Each block shows its report the same way; a scope is named by its kind, not by a cell number it lacks.
    assert repr(block.report) == repr(CellReport(tracked))
    assert repr(block.report).startswith("gpumem scope block "), repr(block.report)
    assert "#0" not in repr(block.report) and "#0" not in CellReport(tracked)._repr_html_()
    assert [record_from_dict(json.loads(json.dumps(record_to_dict(record)))) for record in records] == records
    assert metrics_of(measured).keys() == metrics_of(tracked).keys()
    assert [row["peak_allocated_bytes"] for row in report_rows(records)] == [GIB + 256 * MIB] * 2
