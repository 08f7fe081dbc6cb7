"""Thresholds (once per crossing, re-armed lower down) and the metrics writers (CSV, JSON lines, TensorBoard)."""

from __future__ import annotations

import csv
import json
import math
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumem.core.monitoring.monitor import Monitor
from gpumem.core.sampling.thresholds import GpuMemoryWarning, ThresholdEvent
from gpumem.core.scripts.metric_writers import CsvWriter, JsonlWriter, TensorBoardWriter
from gpumem.testing import GIB, MIB, FakeSource

TOTAL = 10 * GIB
CONTEXT = 512 * MIB


@pytest.fixture
def fake() -> FakeSource:
    return FakeSource(total_bytes=TOTAL, context_bytes=CONTEXT)


@pytest.fixture
def mon(fake: FakeSource) -> Iterator[Monitor]:
    monitor = Monitor(fake)
    yield monitor
    monitor.stop()


def fill_to(fake: FakeSource, fraction: float, handles: list[int]) -> None:
    """Allocate (or free) until NVML's used = reserved + context is ``fraction`` of the device."""
    for handle in handles:
        fake.free(handle)
    handles.clear()
    fake.empty_cache()
    target = int(TOTAL * fraction) - CONTEXT
    handles.append(fake.allocate(target // (2 * MIB) * (2 * MIB)))


def test_a_threshold_fires_once_per_crossing_off_the_sampler_thread(mon: Monitor, fake: FakeSource) -> None:
    events: list[ThresholdEvent] = []
    threads: list[str] = []

    def callback(event: ThresholdEvent) -> None:
        events.append(event)
        threads.append(threading.current_thread().name)

    mon.on_threshold(0.5, callback, rearm=0.4)
    held: list[int] = []
    for fraction in (0.3, 0.55, 0.6, 0.45, 0.7, 0.35, 0.52):
        fill_to(fake, fraction, held)
        mon.sampler.sample_once()
    mon.thresholds.drain()
    # 0.55 crosses; 0.6 and 0.7 stay above without re-arming (0.45 is not below 0.4); 0.35 re-arms; 0.52 fires.
    assert [round(event.fraction, 2) for event in events] == [0.55, 0.52]
    assert all(event.threshold == 0.5 and event.device == 0 for event in events)
    assert events[0].used_bytes == (int(TOTAL * 0.55) - CONTEXT) // (2 * MIB) * (2 * MIB) + CONTEXT
    assert events[0].total_bytes == TOTAL
    assert events[0].measure.startswith("device use (NVML")
    assert threads == ["gpumem-thresholds", "gpumem-thresholds"]


def test_the_default_is_one_warning_per_crossing_at_90_percent(mon: Monitor, fake: FakeSource) -> None:
    held: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for fraction in (0.5, 0.92, 0.95, 0.5, 0.93):
            fill_to(fake, fraction, held)
            mon.sampler.sample_once()
        mon.thresholds.drain()
    ours = [w for w in caught if issubclass(w.category, GpuMemoryWarning)]
    assert len(ours) == 2
    text = str(ours[0].message)
    assert "cuda:0 is 92% full" in text and "past the 90% threshold" in text and "gpumem.free()" in text


def test_a_user_threshold_replaces_the_default_warning(mon: Monitor, fake: FakeSource) -> None:
    fired = threading.Event()
    mon.on_threshold(0.95, lambda _event: fired.set())
    held: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fill_to(fake, 0.92, held)
        mon.sampler.sample_once()
        mon.thresholds.drain()
    assert not [w for w in caught if issubclass(w.category, GpuMemoryWarning)]
    assert not fired.is_set()


def test_a_slow_callback_does_not_hold_up_the_sampler(mon: Monitor, fake: FakeSource) -> None:
    release = threading.Event()
    mon.on_threshold(0.5, lambda _event: release.wait(5))
    held: list[int] = []
    fill_to(fake, 0.6, held)
    mon.sampler.sample_once()
    fill_to(fake, 0.1, held)
    mon.sampler.sample_once()  # returns although the callback is still waiting
    assert mon.sampler.cost().samples == 2
    release.set()
    mon.thresholds.drain()


def test_a_failing_callback_is_recorded_not_raised(mon: Monitor, fake: FakeSource) -> None:
    def broken(_event: ThresholdEvent) -> None:
        raise RuntimeError("checkpoint disk missing")

    mon.on_threshold(0.5, broken)
    held: list[int] = []
    fill_to(fake, 0.6, held)
    mon.sampler.sample_once()
    mon.thresholds.drain()
    assert mon.sampler.last_error is None
    assert "checkpoint disk missing" in mon.thresholds.errors[0]


def test_without_nvml_the_threshold_reads_reserved_against_capacity(fake: FakeSource) -> None:
    source = FakeSource(total_bytes=TOTAL, nvml=False)
    mon = Monitor(source, warn_at=None)
    try:
        events: list[ThresholdEvent] = []
        mon.on_threshold(0.5, events.append)
        source.allocate(6 * GIB)
        mon.sampler.sample_once()
        mon.thresholds.drain()
        assert len(events) == 1
        assert events[0].used_bytes == 6 * GIB and events[0].measure == "PyTorch reserved (this process)"
    finally:
        mon.stop()


def test_jsonl_appends_one_object_per_line_and_drops_a_bad_value_alone(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "memory.jsonl"
    writer = JsonlWriter(path)
    writer.write(1, {"gpumem/cuda0/allocated_bytes": 10, "bad": math.nan})
    JsonlWriter(path).write(2, {"gpumem/cuda0/allocated_bytes": 20})  # a second writer appends
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(row["step"], row["gpumem/cuda0/allocated_bytes"]) for row in rows] == [(1, 10), (2, 20)]
    assert "bad" not in rows[0]


def test_csv_widens_its_header_when_a_device_appears(tmp_path: Path) -> None:
    path = tmp_path / "memory.csv"
    writer = CsvWriter(path)
    writer.write(1, {"gpumem/host/rss_bytes": 100})
    writer.write(2, {"gpumem/host/rss_bytes": 110, "gpumem/cuda0/allocated_bytes": 5})
    CsvWriter(path).write(3, {"gpumem/host/rss_bytes": 120, "gpumem/cuda0/allocated_bytes": 6})
    with path.open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert [row["step"] for row in rows] == ["1", "2", "3"]
    assert [row["gpumem/cuda0/allocated_bytes"] for row in rows] == ["", "5", "6"]
    assert not list(tmp_path.glob(".*tmp"))  # the rewrite went through a temporary file and a rename


def test_monitor_steps_write_csv_and_jsonl(mon: Monitor, fake: FakeSource, tmp_path: Path) -> None:
    mon.add_writer(CsvWriter(tmp_path / "m.csv"))
    mon.add_writer(JsonlWriter(tmp_path / "m.jsonl"))
    step = mon.every(2)
    kept = fake.allocate(GIB)
    for _ in range(4):
        fake.transient(MIB)
        step()
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [2, 4]
    assert rows[1]["gpumem/cuda0/peak_allocated_bytes"] == GIB + MIB
    assert (tmp_path / "m.csv").read_text().count("\n") == 3
    fake.free(kept)


def test_tensorboard_without_tensorboard_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError) as caught:
        TensorBoardWriter("runs")
    assert "pip install tensorboard" in str(caught.value) and "\n" not in str(caught.value)


def test_tensorboard_writer_logs_scalars(tmp_path: Path) -> None:
    pytest.importorskip("torch.utils.tensorboard")
    accumulator_module = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    writer = TensorBoardWriter(tmp_path)
    writer.write(10, {"gpumem/cuda0/allocated_bytes": 1024.0})
    writer.write(20, {"gpumem/cuda0/allocated_bytes": 2048.0})
    writer.close()
    accumulator = accumulator_module.EventAccumulator(str(tmp_path))
    accumulator.Reload()
    events = accumulator.Scalars("gpumem/cuda0/allocated_bytes")
    assert [(event.step, event.value) for event in events] == [(10, 1024.0), (20, 2048.0)]
