"""Figures named for what they are: the OOM cap as the cap, history's ``cell`` one meaning, host memory
under its own heading, the sampler's typical read rather than a mean that start-up inflates."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import pytest

from gpumem.core.cells import CellOptions, CellTracker
from gpumem.core.cells.history import history_dataframe, history_rows, record_to_dict, write_csv, write_json
from gpumem.core.cells.report import CellReport
from gpumem.core.diagnoses import oom
from gpumem.core.monitoring.monitor import Monitor
from gpumem.core.sampling.sampler import RECENT_READS, Sampler
from gpumem.core.sampling.timeline import Timeline
from gpumem.testing import GIB, MIB, FakeSource

CAPPED = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
    "127.20 GiB is free. Including non-PyTorch memory, this process has 13.10 GiB memory in use. 13.98 GiB "
    "allowed; Of the allocated memory 12.50 GiB is allocated by PyTorch, and 100.00 MiB is reserved by PyTorch "
    "but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
ALLOWED = int(0.1 * 139.8 * GIB)


def test_a_capped_process_is_told_the_cap_apart_from_the_device() -> None:
    # PyTorch's observer reports the cap in place of the device's total when a fraction is set.
    observation = oom.OomObservation(0, 2 * GIB, ALLOWED, int(127.2 * GIB), time.monotonic())
    report = oom.explain(RuntimeError(CAPPED), observation=observation)
    assert report.figures.device_total_bytes == int(139.8 * GIB)  # the device's, from the message
    assert report.figures.allowed_bytes == ALLOWED  # exact, from the observer
    text = oom.render_text(report)
    assert "free on the device 127.2 GiB of 139.8 GiB" in text
    assert "allowed 14.0 GiB, in use 12.6 GiB (reserved by PyTorch), left 1.4 GiB" in text
    assert "This process's cap of 14.0 GiB (12.6 GiB in use) refused the request: the device has 127.2 GiB free" in text
    assert "set_per_process_memory_fraction" in oom.render_html(report)


def test_the_cap_from_the_message_alone() -> None:
    report = oom.explain(RuntimeError(CAPPED))
    assert report.figures.allowed_bytes == int(13.98 * GIB)
    assert report.figures.device_total_bytes == int(139.8 * GIB)
    assert "allowed 14.0 GiB" in oom.render_text(report)


def test_a_request_larger_than_the_cap() -> None:
    message = CAPPED.replace("Tried to allocate 2.00 GiB", "Tried to allocate 20.00 GiB")
    report = oom.explain(RuntimeError(message))
    assert report.advice[0].startswith("The request alone (20.0 GiB) is larger than this process's cap (14.0 GiB)")


def test_without_a_cap_nothing_is_said_of_one() -> None:
    message = CAPPED.replace("13.98 GiB allowed; ", "")
    observation = oom.OomObservation(0, 2 * GIB, int(139.8 * GIB), int(127.2 * GIB), time.monotonic())
    report = oom.explain(RuntimeError(message), observation=observation)
    assert report.figures.allowed_bytes is None
    assert "cap" not in oom.render_text(report)


def _tracker(source: FakeSource) -> CellTracker:
    return CellTracker(Monitor(source), start_sampler=False)


def test_cell_is_the_execution_count_everywhere_and_serial_is_named_so(tmp_path: Path) -> None:
    tracker = _tracker(FakeSource())
    for count in (7, 9):
        tracker.end(tracker.begin("x = 1", execution_count=count))
    tracker.end(tracker.begin("y = 2", execution_count=None))
    rows = history_rows(tracker.history)
    assert [(row["cell"], row["serial"]) for row in rows] == [(7, 1), (9, 2), (None, 3)]
    assert "execution_count" not in rows[0]
    write_csv(tracker.history, tmp_path / "h.csv")
    read = list(csv.DictReader((tmp_path / "h.csv").open()))
    assert [(row["cell"], row["serial"]) for row in read] == [("7", "1"), ("9", "2"), ("", "3")]
    write_json(tracker.history, tmp_path / "h.json")
    data = json.loads((tmp_path / "h.json").read_text())
    assert [(item["cell"], item["serial"]) for item in data["cells"]] == [(7, 1), (9, 2), (None, 3)]
    assert record_to_dict(tracker.history[0])["cell"] == 7
    pytest.importorskip("pandas")
    frame = history_dataframe(tracker.history)
    assert frame["cell"].tolist()[:2] == [7, 9] and frame["serial"].tolist() == [1, 2, 3]


def test_without_cuda_host_memory_is_under_a_host_heading() -> None:
    source = FakeSource(cuda_initialized=False, nvml=False)
    tracker = _tracker(source)
    cell = tracker.begin("x = 1", execution_count=1, options=CellOptions(attribute=False))
    source.set_host_rss(source.host_rss_bytes + 64 * MIB)
    record = tracker.end(cell)
    html = CellReport(record)._repr_html_()
    assert "<th>allocated</th>" not in html and "<th>reserved</th>" not in html and "device used" not in html
    assert "<th>host RSS</th><th>peak above start</th>" in html
    assert "+64.0 MiB" in html
    text = repr(CellReport(record))
    assert "allocated" not in text and "device used" not in text
    assert "host     RSS" in text and "+64.0 MiB" in text


def test_with_cuda_the_device_table_and_the_host_table_are_apart() -> None:
    source = FakeSource()
    tracker = _tracker(source)
    cell = tracker.begin("h = 1", execution_count=1, options=CellOptions(attribute=False))
    source.allocate(GIB)
    html = CellReport(tracker.end(cell))._repr_html_()
    device_table, host_table = html.split("<table>")[1:3]
    assert "<th>allocated</th>" in device_table and "host" not in device_table
    assert "<th>host RSS</th>" in host_table and "allocated" not in host_table


def test_the_sampler_reports_its_typical_read_not_a_mean_start_up_inflates() -> None:
    class SlowFirst(FakeSource):
        reads = 0

        def snapshot(self, *, process_memory: bool = False):  # type: ignore[no-untyped-def]
            self.reads += 1
            if self.reads == 1:
                time.sleep(0.05)  # NVML starting, say
            return super().snapshot(process_memory=process_memory)

    sampler = Sampler(SlowFirst(), Timeline())
    for _ in range(20):
        sampler.sample_once()
    cost = sampler.cost()
    assert cost.samples == cost.recent_reads == 20
    assert cost.recent_max_s >= 0.05 > cost.recent_median_s * 10  # the median ignores the one slow start
    assert cost.mean_s > cost.recent_median_s
    for _ in range(RECENT_READS):
        sampler.sample_once()
    cost = sampler.cost()
    assert cost.recent_reads == RECENT_READS and cost.samples == RECENT_READS + 20
    assert cost.recent_max_s < 0.05 <= cost.max_s  # the slow start has left the recent reads


def test_zero_bytes_unallocated_is_parsed() -> None:
    # torch writes sizes up to 1 KiB as "N bytes": the reserve with nothing unallocated is "0 bytes".
    message = CAPPED.replace("100.00 MiB is reserved", "0 bytes is reserved")
    figures = oom.parse_oom_message(message)
    assert figures.reserved_unallocated_bytes == 0 and figures.allocated_bytes == int(12.5 * GIB)
