"""What one push skips is skipped only while its inputs are the same: each cached part of a push (the
curve choice, the legend, the axes, the marks, the frozen peaks) follows every change of what it depends on."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import numpy as np
import pytest

from gpumem.core.monitoring.monitor import Monitor
from gpumem.core.sampling.timeline import Timeline
from gpumem.panel.curves import build_curve_frame, with_span_mark
from gpumem.panel.monitor_feed import PeaksSinceOpen
from gpumem.panel.options import make_options
from gpumem.panel.widget import Panel, close_all
from gpumem.testing import GIB, MIB, FakeSource


@pytest.fixture(autouse=True)
def _clean_panels() -> Iterator[None]:
    yield
    close_all()


@pytest.fixture
def fake() -> Iterator[tuple[FakeSource, Monitor]]:
    source = FakeSource(devices=2, total_bytes=80 * GIB)
    monitor = Monitor(source)
    yield source, monitor
    monitor.stop()


def _text(html_text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html_text)).strip()


def _labels(timeline: Timeline, **options: object) -> list[str]:
    frame = build_curve_frame(timeline, make_options(**options), 100.0, 0.0, {0: 80 * GIB, 1: 80 * GIB})  # type: ignore[arg-type]
    return [curve.label for curve in frame.curves]


def test_the_curves_follow_a_new_device_the_host_box_and_the_device_choice() -> None:
    timeline = Timeline()
    timeline.append(90.0, {"cuda:0/allocated": 1.0 * GIB, "cuda:0/reserved": 2.0 * GIB, "host/rss": 1.0 * GIB})
    assert _labels(timeline) == ["allocated", "reserved"]
    assert _labels(timeline, host=True) == ["allocated", "reserved", "host RSS"]
    assert _labels(timeline) == ["allocated", "reserved"]  # unticked again: the host curve goes
    timeline.append(91.0, {"cuda:1/allocated": 3.0 * GIB, "cuda:1/reserved": 4.0 * GIB})  # a device appears
    assert _labels(timeline) == ["cuda:0 allocated", "cuda:0 reserved", "cuda:1 allocated", "cuda:1 reserved"]
    assert _labels(timeline, device=1) == ["allocated", "reserved"]
    frame = build_curve_frame(timeline, make_options(device=1), 100.0, 0.0, {0: 80 * GIB, 1: 40 * GIB})
    assert [curve.channel for curve in frame.curves] == ["cuda:1/allocated", "cuda:1/reserved"]
    assert frame.capacity_off_scale == (40.0 * GIB,)  # the capacity of the device shown, not of cuda:0


def test_the_span_mark_goes_between_the_marks_around_it() -> None:
    timeline = Timeline()
    for second in range(10, 100):
        timeline.append(float(second), {"cuda:0/allocated": float(second) * MIB})
    timeline.add_mark(30.0, "3")
    timeline.add_mark(70.0, "7")
    frame = build_curve_frame(timeline, make_options(window=600.0), 100.0, 0.0, {})
    marked = with_span_mark(frame, 50.0, "panel opened", 0.0)
    assert marked.mark_x_ms.tolist() == [30_000.0, 50_000.0, 70_000.0]
    assert marked.mark_x_ms.dtype == np.float64
    assert marked.mark_labels == ("[3]", "panel opened", "[7]")
    newest = with_span_mark(frame, 80.0, "peak reset", 0.0)
    assert newest.mark_x_ms.tolist() == [30_000.0, 70_000.0, 80_000.0]
    assert newest.mark_labels == ("[3]", "[7]", "peak reset")


def _drawn_panel(source: FakeSource, monitor: Monitor) -> Panel:
    """A panel that has drawn two samples of 1 GiB allocated on cuda:0."""
    source.allocate(GIB, 0)
    panel = Panel(monitor, autostart=False)
    monitor.sampler.sample_once()
    monitor.sampler.sample_once()
    assert panel.refresh()
    return panel


def test_the_legend_follows_marks_capacity_curves_and_full_scale(fake: tuple[FakeSource, Monitor]) -> None:
    source, monitor = fake
    panel = _drawn_panel(source, monitor)
    legend = _text(panel._legend.value)
    assert "cuda:0" in legend
    assert "cuda:1" in legend
    assert "(above the plot)" in legend
    assert "cell start / Free" not in legend  # no mark yet
    monitor.timeline.add_mark(monitor.timeline.latest()[0], "3")  # type: ignore[index]
    monitor.sampler.sample_once()
    assert panel.refresh()
    assert "cell start / Free" in _text(panel._legend.value)
    panel._full_scale.value = True  # the capacity now fits: drawn, listed as a line
    monitor.sampler.sample_once()
    assert panel.refresh()
    legend = _text(panel._legend.value)
    assert "(above the plot)" not in legend
    assert "capacity" in legend
    panel._host.value = True
    monitor.sampler.sample_once()
    assert panel.refresh()
    assert "host RSS" in _text(panel._legend.value)
    panel._host.value = False
    monitor.sampler.sample_once()
    assert panel.refresh()
    assert "host RSS" not in _text(panel._legend.value)


def test_the_x_ends_go_from_the_scale_to_the_line_once_there_is_one(fake: tuple[FakeSource, Monitor]) -> None:
    source, monitor = fake
    panel = Panel(monitor, autostart=False)
    source.allocate(100 * MIB, 0)
    monitor.sampler.sample_once()
    assert panel.refresh()
    assert panel._last_frame is not None
    assert panel._last_frame.points_per_line == 1  # no line yet: the window's ends are set on the scale
    assert panel._x_scale.min is not None
    assert panel._x_scale.max is not None
    monitor.sampler.sample_once()
    assert panel.refresh()
    assert panel._last_frame.points_per_line > 1
    assert (panel._x_scale.min, panel._x_scale.max) == (None, None)  # the line carries the ends


def test_the_axes_follow_the_window_and_the_unit(fake: tuple[FakeSource, Monitor]) -> None:
    source, monitor = fake
    source.allocate(100 * MIB, 0)
    values = {"cuda:0/allocated": 100.0 * MIB, "cuda:0/reserved": 100.0 * MIB}
    now = time.monotonic()
    for second in range(1800, 0, -10):  # half an hour recorded: a 1 h window spans more than 15 minutes
        monitor.timeline.append(now - second, values)
    panel = Panel(monitor, autostart=False)
    monitor.sampler.sample_once()
    assert panel.refresh()
    assert panel._y_axis.label == "MiB"
    assert panel._x_axis.tick_format == "%H:%M:%S"
    panel._window.value = "1 h"
    assert panel.refresh()
    assert panel._x_axis.tick_format == "%H:%M"
    panel._window.value = "1 min"
    assert panel.refresh()
    assert panel._x_axis.tick_format == "%H:%M:%S"
    source.allocate(20 * GIB, 0)
    monitor.sampler.sample_once()
    assert panel.refresh()
    assert panel._y_axis.label == "GiB"
    top = panel._y_scale.max
    assert top >= 20.0
    assert float(np.asarray(panel._y_axis.tick_values)[-1]) == top


def test_the_marks_are_sent_again_when_one_is_added(fake: tuple[FakeSource, Monitor]) -> None:
    source, monitor = fake
    panel = _drawn_panel(source, monitor)
    before = list(panel._cell_labels.text)
    monitor.timeline.add_mark(monitor.timeline.latest()[0], "12")  # type: ignore[index]
    monitor.sampler.sample_once()
    assert panel.refresh()
    assert list(panel._cell_labels.text) == [*before, "[12]"]


def test_frozen_peaks_are_left_alone_by_later_samples(fake: tuple[FakeSource, Monitor]) -> None:
    source, monitor = fake
    peaks = PeaksSinceOpen()
    source.allocate(GIB, 0)
    peaks.note(monitor.snapshot())
    devices, host = peaks.frozen()
    first = devices[0].value
    source.allocate(4 * GIB, 0)
    peaks.note(monitor.snapshot())
    assert devices[0].value == first
    assert peaks.frozen()[0][0].value == pytest.approx(first + 4 * GIB, rel=0.01)
    assert host is not peaks.frozen()[1]
