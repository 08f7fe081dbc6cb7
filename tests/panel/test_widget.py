"""The live panel in-process: what it shows (from a deterministic source), Free, threads, views, traffic.

The widgets are real ipywidgets/bqplot objects; their comms record what would go to the browser
(``CommRecorder``), serialized as the kernel would. The browser itself is in test_panel_browser.py.
"""

from __future__ import annotations

import itertools
import math
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from IPython.core.error import UsageError

from _harness import wait_until
from _harness.traffic import CommRecorder
from gpumem.core.monitoring.monitor import Monitor
from gpumem.core.monitoring.peaks import RunningPeak
from gpumem.core.readers.devices import parse_devices
from gpumem.core.sampling.timeline import Timeline
from gpumem.ipython import panel_magics as widget
from gpumem.panel import widget as widget_module
from gpumem.panel.curves import (
    build_curve_frame,
    curve_interval_s,
    header_interval_s,
    nice_axis,
    read_resolution_s,
    sample_rate_hz,
)
from gpumem.panel.options import DEFAULT_POINTS_PER_LINE, PanelOptions, parse_refresh, parse_threshold, parse_window
from gpumem.panel.widget import Panel, close_all
from gpumem.panel.writer import shared_writer
from gpumem.testing import GIB, MIB, FakeSource

BROWSER_BUDGET_BYTES_PER_S = 50_000


def _gpumem_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("gpumem-") and t.is_alive())


@pytest.fixture(autouse=True)
def _clean_panels() -> Iterator[None]:
    yield
    close_all()
    workers = ("gpumem-panel-writer", "gpumem-free", "gpumem-holders-walk", "gpumem-reclaim")
    assert not [name for name in _gpumem_threads() if name in workers]


@pytest.fixture
def recorder() -> Iterator[CommRecorder]:
    with CommRecorder() as rec:
        yield rec


@pytest.fixture
def fake() -> Iterator[tuple[FakeSource, Monitor]]:
    source = FakeSource(devices=1, total_bytes=80 * GIB, context_bytes=500 * MIB)
    monitor = Monitor(source)
    yield source, monitor
    monitor.stop()


def _panel(monitor: Monitor, **kwargs: Any) -> Panel:
    kwargs.setdefault("autostart", False)
    return Panel(monitor, **kwargs)


def _drawn(panel: Panel) -> np.ndarray:
    """The curves' values as sent, without the two valueless points (the window's ends) the panel puts first."""
    y = np.atleast_2d(np.asarray(panel._curves.y))  # bqplot keeps one line's values as a 1-D array
    assert np.isnan(y[:, [0, 1]]).all()
    # bqplot anchors each line's label at its last point: one without a value logs a browser error.
    assert np.isfinite(y[:, -1]).all()
    return y[:, 2:]


def _text(html_text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html_text)).replace("&#x27;", "'").strip()


# ------------------------------------------------------------------------------------------------
# Options
# ------------------------------------------------------------------------------------------------


def test_option_parsing_accepts_the_documented_forms() -> None:
    assert parse_window("1min") == 60
    assert parse_window("10 min") == 600
    assert parse_window("1h") == 3600
    assert parse_window("90s") == 90
    assert parse_window(120) == 120
    assert parse_window("all") is None
    assert parse_threshold("90%").fraction == pytest.approx(0.9)
    assert parse_threshold(0.75).fraction == pytest.approx(0.75)
    assert parse_threshold("80").fraction == pytest.approx(0.8)  # the old spelling, read as it was
    assert parse_threshold("70GiB").nbytes == 70 * GIB
    assert parse_refresh("4") == 4.0
    assert parse_device("cuda:1") == 1
    assert parse_device("2") == 2
    assert parse_device("all") is None


def parse_device(value: object) -> int | None:
    """The panel's device: one CUDA device or all."""
    return parse_devices(value, default="all").one_cuda()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("func", "value", "words"),
    [
        (parse_window, "soon", "window must be a duration"),
        (parse_window, "1s", "at least 5 seconds"),
        (parse_threshold, "150%", "between 0 and 100%"),
        (parse_threshold, "high", "a size such as 512MiB or a share of the device's capacity such as 80%"),
        (parse_refresh, "100", "between 0.2 and 10"),
        (parse_refresh, "fast", "number of updates per second"),
        (parse_device, "gpu", "use cuda, cuda:N or N, a list such as 0,1, cpu or all"),
        (parse_device, -1, "0 or more"),
    ],
)
def test_bad_options_get_one_clear_line(func: Any, value: Any, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)) as info:
        func(value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("--window soon", "window must be a duration"),
        ("--threshold 150%", "between 0 and 100%"),
        ("--refresh 100", "refresh must be between"),
        ("--device gpu", "unknown device 'gpu'"),
        ("--bogus", "unrecognized arguments"),
    ],
)
def test_magic_monitor_rejects_bad_input_with_usage_error(ip: Any, line: str, words: str) -> None:
    with pytest.raises(UsageError, match=words):
        widget.magic_monitor(ip, line)
    assert widget.open_panels() == []


def test_magic_monitor_without_a_kernel_says_why(ip: Any, capsys: pytest.CaptureFixture[str]) -> None:
    widget.magic_monitor(ip, "--window 1min")
    assert "needs a notebook front end" in capsys.readouterr().out
    assert widget.open_panels() == []


def test_nice_axis_covers_the_data_with_round_ticks() -> None:
    for top in (0.0004, 0.3, 1.19, 7.5, 81.6, 141.0, 1500.0):
        y_max, ticks = nice_axis(top)
        assert y_max >= top and ticks[0] == 0 and ticks[-1] == y_max
        assert 3 <= len(ticks) <= 7
        steps = {round(b - a, 9) for a, b in itertools.pairwise(ticks)}
        assert len(steps) == 1


# ------------------------------------------------------------------------------------------------
# Peaks since open
# ------------------------------------------------------------------------------------------------


def test_peak_tracker_trusts_the_counter_only_for_the_time_since_start() -> None:
    tracker = RunningPeak()
    tracker.update(1 * GIB, counter=10 * GIB)  # the counter remembers an older 10 GiB peak
    tracker.update(2 * GIB, counter=10 * GIB)
    assert tracker.value == 2 * GIB and not tracker.exact  # sampled: a lower bound
    tracker.update(3 * GIB, counter=12 * GIB)  # a new high after the start: exact
    assert tracker.value == 12 * GIB and tracker.exact
    tracker.update(1 * GIB, counter=1 * GIB)  # someone reset PyTorch's counters
    tracker.update(1 * GIB, counter=5 * GIB)
    assert tracker.value == 12 * GIB and not tracker.exact
    tracker.reset()
    tracker.update(1 * GIB, counter=5 * GIB)
    assert tracker.value == 1 * GIB


# ------------------------------------------------------------------------------------------------
# What the panel shows, from a deterministic source
# ------------------------------------------------------------------------------------------------


def test_panel_shows_allocated_reserved_used_and_capacity(fake: tuple[FakeSource, Monitor]) -> None:
    source, monitor = fake
    panel = _panel(monitor)
    handles = [source.allocate(4 * GIB) for _ in range(3)]
    monitor.sampler.sample_once()
    source.free(handles.pop())  # reserved stays at 12 GiB: 4 GiB of fragmentation
    monitor.sampler.sample_once()
    assert panel.refresh()
    header = _text(panel._header.value)
    assert "cuda:0 · Fake GPU · 80.0 GiB" in header
    assert "allocated 8.0 GiB" in header
    assert "reserved 12.0 GiB" in header
    assert "device used 12.5 GiB of 80.0 GiB" in header  # reserved + the 500 MiB context, from "NVML"
    assert "of capacity 15.6 %" in header
    assert "peak since open 12.0 GiB" in header  # exact: PyTorch's counter rose after the panel opened
    assert "cached, unallocated 4.0 GiB" in header
    assert "gm-c-alert" not in panel._header.value
    curves = panel._curves
    assert list(curves.labels) == ["allocated", "reserved", "device used (all processes)"]
    y = _drawn(panel)
    assert y.shape == (3, 2)
    assert y[:, -1].tolist() == pytest.approx([8.0, 12.0, 12 + 500 / 1024])
    assert y[:, 0].tolist() == pytest.approx([12.0, 12.0, 12 + 500 / 1024])
    assert np.asarray(curves.x).dtype.kind == "M"  # dates: one shared x for every line
    assert panel._y_axis.label == "GiB"
    assert panel._y_scale.max >= 12.5
    assert float(panel._y_axis.tick_values[0]) == 0
    assert "capacity 80.0 GiB (above the plot)" in _text(panel._legend.value)


def test_header_turns_red_at_the_threshold(fake: tuple[FakeSource, Monitor]) -> None:
    source, monitor = fake
    low = _panel(monitor)
    custom = _panel(monitor, threshold="50%")
    source.allocate(45 * GIB)
    monitor.sampler.sample_once()
    assert low.refresh() and custom.refresh()
    assert "gm-c-alert" not in low._header.value and "gm-alert" not in low._header.value
    assert "gm-c-alert" in custom._header.value and "gm-bar gm-alert" in custom._header.value
    assert "over the 50 % threshold" in _text(custom._header.value)
    source.allocate(28 * GIB)  # 73 GiB + context: above 90 % of 80 GiB
    monitor.sampler.sample_once()
    assert low.refresh()
    assert "gm-c-alert" in low._header.value
    assert "over the 90 % threshold" in _text(low._header.value)
    assert low._capacity.visible  # close to capacity: the capacity line is drawn
    assert list(np.asarray(low._capacity.y).ravel()) == pytest.approx([80.0, 80.0])


def test_peak_since_open_catches_a_transient_the_sampler_missed(fake: tuple[FakeSource, Monitor]) -> None:
    source, monitor = fake
    source.allocate(2 * GIB)
    panel = _panel(monitor)
    monitor.sampler.sample_once()
    source.transient(6 * GIB)  # allocated and freed between two samples
    monitor.sampler.sample_once()
    assert panel.refresh()
    assert "peak since open 8.0 GiB" in _text(panel._header.value)
    panel._reset_button.click()
    monitor.sampler.sample_once()
    assert panel.refresh()
    assert "peak since reset ≥ 2.0 GiB" in _text(panel._header.value)


def test_without_cuda_the_panel_shows_host_memory_and_says_so() -> None:
    source = FakeSource(cuda_initialized=False, nvml=False, host_rss_bytes=3 * GIB, host_total_bytes=16 * GIB)
    monitor = Monitor(source)
    panel = _panel(monitor)
    monitor.sampler.sample_once()
    source.set_host_rss(5 * GIB)
    monitor.sampler.sample_once()
    assert panel.refresh()
    header = _text(panel._header.value)
    assert "Host memory" in header
    assert "process RSS 5.0 GiB" in header
    assert "No CUDA device is in use: CUDA is not initialized (fake)." in header
    assert list(panel._curves.labels) == ["host RSS"]
    assert _drawn(panel).ravel().tolist() == pytest.approx([3.0, 5.0])


def test_before_cuda_is_initialized_whole_device_use_is_shown_and_explained() -> None:
    source = FakeSource(cuda_initialized=False, nvml=True)
    monitor = Monitor(source)
    panel = _panel(monitor)
    monitor.sampler.sample_once()
    assert panel.refresh()
    header = _text(panel._header.value)
    assert "PyTorch's figures appear once CUDA is in use" in header
    assert "allocated n/a" in header and "reserved n/a" in header
    assert "device used 0 B of 80.0 GiB" in header


def test_the_curves_carry_the_window_ends_and_the_x_scale_fits_them(fake: tuple[FakeSource, Monitor]) -> None:
    _source, monitor = fake
    with CommRecorder() as recorder:
        panel = _panel(monitor)
        updates_after = []
        for _ in range(4):
            monitor.sampler.sample_once()
            assert panel.refresh()
            updates_after.append(
                sum(1 for m in recorder.snapshot() if m.comm_id == panel._x_scale.model_id and m.method == "update")
            )
    frame = panel._last_frame
    assert frame is not None
    x_ms = np.asarray(panel._curves.x).astype("datetime64[ms]").astype(np.float64)
    # The window's two ends, around the samples as read: the scale spans exactly the frame's window.
    assert x_ms[0] == pytest.approx(frame.x_min_ms, abs=1.0)
    assert x_ms[1] == pytest.approx(frame.x_max_ms, abs=1.0)
    assert x_ms[2:] == pytest.approx(frame.x_ms, abs=1.0)
    assert (panel._x_scale.min, panel._x_scale.max) == (None, None)
    # Once a line is drawn, pushes send no x-scale message: the lines' own update carries the ends.
    assert updates_after[1] >= 1
    assert updates_after[1] == updates_after[2] == updates_after[3]


def test_with_no_line_drawn_the_x_scale_gets_the_window_ends(fake: tuple[FakeSource, Monitor]) -> None:
    _source, monitor = fake
    panel = _panel(monitor)
    monitor.sampler.sample_once()  # one sample: no line yet
    assert panel.refresh()
    frame = panel._last_frame
    assert frame is not None and frame.points_per_line == 1
    assert panel._x_scale.min is not None and panel._x_scale.max is not None
    assert panel._x_scale.min < panel._x_scale.max
    monitor.sampler.sample_once()
    assert panel.refresh()
    assert (panel._x_scale.min, panel._x_scale.max) == (None, None)


def test_cell_marks_are_drawn_with_their_labels(fake: tuple[FakeSource, Monitor]) -> None:
    source, monitor = fake
    panel = _panel(monitor)
    for count in (7, 8):
        monitor.mark(str(count))
        source.allocate(GIB)
        monitor.sampler.sample_once()
    assert panel.refresh()
    # The marks are a moment apart: one line for both, labelled with their range (two would be a barcode).
    assert list(panel._cell_labels.text) == ["[7\u20138]"]
    assert np.atleast_2d(np.asarray(panel._cell_lines.x)).shape == (1, 2)  # bqplot keeps one line 1-D
    assert panel._cell_lines.visible
    assert "cell start / Free" in _text(panel._legend.value)


def test_several_devices_choice_and_per_device_lines() -> None:
    source = FakeSource(devices=3, total_bytes=40 * GIB)
    monitor = Monitor(source)
    source.allocate(1 * GIB, 0)
    source.allocate(2 * GIB, 1)
    source.allocate(3 * GIB, 2)
    panel = _panel(monitor)
    monitor.sampler.sample_once()
    monitor.sampler.sample_once()
    assert panel.refresh()
    assert panel._device.layout.display == "flex"
    assert [value for _label, value in panel._device.options] == [-1, 0, 1, 2]
    assert len(panel._curves.labels) == 6  # allocated and reserved per device
    assert "3 CUDA devices" in _text(panel._header.value)
    panel._device.value = 1  # what the front end does when the user picks cuda:1
    monitor.sampler.sample_once()
    assert panel.refresh()
    assert list(panel._curves.labels) == ["allocated", "reserved", "device used (all processes)"]
    assert _drawn(panel)[:, -1].tolist()[0] == pytest.approx(2.0)
    assert "cuda:1 · Fake GPU" in _text(panel._header.value)


def test_window_host_and_full_scale_controls(fake: tuple[FakeSource, Monitor]) -> None:
    source, monitor = fake
    panel = _panel(monitor)
    source.allocate(2 * GIB)
    monitor.sampler.sample_once()
    monitor.sampler.sample_once()
    panel._window.value = "1 min"
    panel._host.value = True
    panel._full_scale.value = True
    assert panel.refresh()
    assert panel.options.window_s == 60 and panel.options.show_host and panel.options.full_scale
    assert "host RSS" in list(panel._curves.labels)
    assert panel._y_scale.max >= 80  # up to the capacity
    assert panel._capacity.visible


def test_lines_stay_within_2k_points_and_keep_every_peak() -> None:
    timeline = Timeline()
    now = time.monotonic()
    count = 9_000
    for i in range(count):
        value = 50 * GIB if i == 4321 else (1 + (i % 7)) * GIB
        timeline.append(now - (count - i) * 0.1, {"cuda:0/allocated": value, "cuda:0/reserved": 60 * GIB})
    for points in (1000, 2000):
        frame = build_curve_frame(timeline, PanelOptions(window_s=None, points_per_line=points), now, 0.0, {})
        assert frame.points_per_line <= points
        assert float(frame.y[0].max()) == pytest.approx(50.0)  # the one-sample spike survives decimation
        assert float(frame.y[0].min()) == pytest.approx(1.0)
    frame = build_curve_frame(timeline, PanelOptions(window_s=600), now, 0.0, {})
    newest = now - 0.1  # the last sample: the second it falls in is the newest bucket
    assert frame.points_per_line == 2 * (math.floor(newest) - math.floor(now - 600) + 1)  # 1 s buckets, as read
    assert frame.points_per_line <= DEFAULT_POINTS_PER_LINE
    assert float(frame.y[0].max()) == pytest.approx(50.0)


def test_curves_are_read_from_the_monitors_timeline() -> None:
    """The timeline is the one store of samples: each push reads its window, so new samples show at once."""
    timeline = Timeline()
    now = time.monotonic()
    rows = [
        (now - 700 + i * 0.1, {"cuda:0/allocated": float((i * 37) % 101) * MIB, "cuda:0/reserved": float(i) * MIB})
        for i in range(7000)
    ]
    rows[5555] = (rows[5555][0], {"cuda:0/allocated": 5000.0 * MIB, "cuda:0/reserved": 5555.0 * MIB})  # one spike
    for time_s, values in rows:
        timeline.append(time_s, values)
    end = rows[-1][0]
    for window_s in (30.0, 600.0):
        frame = build_curve_frame(timeline, PanelOptions(window_s=window_s), end, 0.0, {})
        series = timeline.window(end - window_s, end, 1_250, resolution_s=read_resolution_s(window_s))
        assert frame.points_per_line == len(series.times) <= DEFAULT_POINTS_PER_LINE == 1_250
        assert (frame.x_ms / 1000.0).tolist() == pytest.approx(series.times)
        for row, curve in zip(frame.y, frame.curves, strict=True):
            assert (row * frame.unit_bytes).tolist() == pytest.approx(series.values[curve.channel], rel=1e-6)
        assert np.all(np.diff(frame.x_ms) >= 0)
        # A 1 s bucket that straddles the window's start counts whole (drawn at the start).
        since = math.floor(end - window_s) if read_resolution_s(window_s) >= 1 else end - window_s
        raw = [v for t, v in rows if t >= since]
        for line, channel in enumerate(("cuda:0/allocated", "cuda:0/reserved")):
            values = [v[channel] for v in raw]
            assert float(frame.y[line].max()) * frame.unit_bytes == pytest.approx(max(values), rel=1e-6)
            assert float(frame.y[line].min()) * frame.unit_bytes == pytest.approx(min(values), rel=1e-6)
    assert float(build_curve_frame(timeline, PanelOptions(window_s=600), end, 0.0, {}).y[0].max()) == pytest.approx(
        5000 / 1024, rel=1e-6
    )  # the one-sample spike survives decimation
    timeline.append(end + 0.1, {"cuda:0/allocated": 7.0 * GIB, "cuda:0/reserved": 8.0 * GIB})
    frame = build_curve_frame(timeline, PanelOptions(window_s=60), end + 0.1, 0.0, {})
    assert frame.x_ms[-1] == pytest.approx((end + 0.1) * 1000.0)
    assert frame.y[:, -1].tolist() == pytest.approx([7.0, 8.0])


# ------------------------------------------------------------------------------------------------
# Free
# ------------------------------------------------------------------------------------------------


def test_free_returns_cached_memory_and_reports_it(fake: tuple[FakeSource, Monitor]) -> None:
    source, monitor = fake
    panel = _panel(monitor)
    handles = [source.allocate(2 * GIB) for _ in range(3)]
    for handle in handles[:2]:
        source.free(handle)
    monitor.sampler.sample_once()
    outcome = panel.free()
    assert outcome is not None and outcome.result is not None
    (device,) = outcome.result.devices
    assert (device.reserved_before_bytes, device.reserved_after_bytes) == (6 * GIB, 2 * GIB)
    assert panel.refresh()
    message = _text(panel._message.value)
    assert message.startswith("Freed 4.0 GiB of GPU memory")
    assert "cuda:0 allocated 2.0 GiB → 2.0 GiB (±0 B), reserved 6.0 GiB → 2.0 GiB (-4.0 GiB)" in message
    assert "gm-ok" in panel._message.value
    assert not panel._free_button.disabled and panel._free_button.description == "Free"


def test_free_button_runs_on_a_worker_while_the_main_thread_computes(fake: tuple[FakeSource, Monitor]) -> None:
    torch = pytest.importorskip("torch")
    source, monitor = fake
    panel = _panel(monitor)
    held = source.allocate(GIB)
    source.free(held)
    clicked = threading.Event()
    free_threads: list[str] = []
    original = panel._free_worker

    def worker(deep: bool) -> None:
        free_threads.append(threading.current_thread().name)
        original(deep)

    panel._free_worker = worker  # type: ignore[method-assign]

    def click_from_the_comm_thread() -> None:
        panel._free_button.click()
        clicked.set()

    # A "training loop" on the main thread (real CPU tensors) while the click comes from elsewhere.
    losses = []
    clicker = threading.Thread(target=click_from_the_comm_thread, name="comm-thread")
    weights = torch.randn(256, 256, requires_grad=True)
    for step in range(200):
        if step == 20:
            clicker.start()
        loss = (weights @ torch.randn(256, 256)).pow(2).mean()
        loss.backward()
        losses.append(loss.detach())
    clicker.join()
    assert clicked.is_set()
    wait_until(lambda: panel._last_free is not None)
    assert free_threads == ["gpumem-free"]
    assert panel.refresh()
    assert _text(panel._message.value).startswith("Freed 1.0 GiB of GPU memory")
    assert len(losses) == 200


def test_deep_option_reaches_cleanup_and_failures_are_shown(
    fake: tuple[FakeSource, Monitor], monkeypatch: pytest.MonkeyPatch
) -> None:
    _source, monitor = fake
    panel = _panel(monitor)
    panel._deep.value = True
    panel._free_button.click()
    wait_until(lambda: panel._last_free is not None)
    outcome = panel._last_free
    assert outcome is not None and outcome.result is not None and outcome.result.deep

    def broken(**_: Any) -> Any:
        raise RuntimeError("allocator is gone")

    monkeypatch.setattr("gpumem.panel.freeing.free_memory", broken)
    failed = panel.free()
    assert failed is not None and failed.result is None
    assert panel.refresh()
    assert _text(panel._message.value) == "Free failed: RuntimeError: allocator is gone"
    assert "gm-err" in panel._message.value
    assert not panel._free_button.disabled


# ------------------------------------------------------------------------------------------------
# Views, threads, lifecycle
# ------------------------------------------------------------------------------------------------


def test_sends_nothing_without_a_view_and_pushes_when_one_appears(
    recorder: CommRecorder, fake: tuple[FakeSource, Monitor]
) -> None:
    source, monitor = fake
    panel = _panel(monitor)
    source.allocate(GIB)
    for _ in range(5):
        monitor.sampler.sample_once()
    quiet_from = time.monotonic()
    time.sleep(1.5)  # the writer keeps running; with no view it must stay silent
    assert recorder.updates(quiet_from) == []
    assert not panel.visible
    panel.set_state({"_view_count": 1})  # what the kernel does when the front end reports a view
    assert panel.visible
    wait_until(lambda: any("y" in m.keys for m in recorder.updates(quiet_from)))
    xy = [m for m in recorder.updates(quiet_from) if "y" in m.keys]
    assert all("x" in m.keys for m in xy)  # x and y travel in one message
    assert {m.thread for m in recorder.updates(quiet_from) if m.method == "update"} <= {"gpumem-panel-writer"}
    panel.set_state({"_view_count": 0})
    time.sleep(0.3)
    silent_from = time.monotonic()
    time.sleep(1.5)
    assert recorder.updates(silent_from) == []


def test_every_widget_of_the_panel_is_routed_and_views_count_per_page(fake: tuple[FakeSource, Monitor]) -> None:
    from gpumem.panel.routing import widget_comms

    _source, monitor = fake
    panel = _panel(monitor)
    comms = {id(comm) for comm in widget_comms(panel)}
    parts = [panel, panel._free_button, panel._deep, panel._pause_button, panel._window, panel._header,
             panel._curves, panel._x_scale, panel._y_axis, panel._free_button.layout, panel._window.style]  # fmt: skip
    assert all(id(part.comm) in comms for part in parts)
    assert panel._route is None  # no kernel here: nothing to route to, nothing changed
    # Views per page: a page that went away stops counting (here none is known gone).
    panel._views.changed("page-1", 0, 1)
    panel._views.changed("page-2", 1, 2)
    panel._views.changed("page-2", 2, 1)
    assert panel._views.shown() == 1 and panel.visible


def test_panels_share_one_sampler_and_close_releases_everything(fake: tuple[FakeSource, Monitor]) -> None:
    _source, monitor = fake
    first = Panel(monitor)
    second = Panel(monitor)
    assert not monitor.running  # created, not shown yet
    first._repr_mimebundle_()
    second.set_state({"_view_count": 1})
    assert monitor.running
    assert _gpumem_threads().count("gpumem-sampler") == 1
    assert "gpumem-panel-writer" in _gpumem_threads()
    first.close()
    assert monitor.running and "gpumem-panel-writer" in _gpumem_threads()
    widgets_of_second = [second._curves, second._x_scale, second._free_button, second._header]
    second.close()
    assert not monitor.running
    assert _gpumem_threads() == []
    assert all(w.comm is None for w in [second, *widgets_of_second])
    assert widget.open_panels() == []
    assert second.refresh() is False


def test_a_sampler_someone_else_started_keeps_running(fake: tuple[FakeSource, Monitor]) -> None:
    _source, monitor = fake
    monitor.start()
    panel = Panel(monitor)
    panel._repr_mimebundle_()
    panel.close()
    assert monitor.running


def test_close_all_closes_every_panel(fake: tuple[FakeSource, Monitor]) -> None:
    _source, monitor = fake
    panels = [_panel(monitor) for _ in range(3)]
    assert len(widget.open_panels()) == 3
    widget.close_all()
    assert widget.open_panels() == []
    assert all(p.closed and p.comm is None for p in panels)
    assert "gpumem-panel-writer" not in _gpumem_threads()


def test_pause_freezes_and_resume_catches_up(fake: tuple[FakeSource, Monitor]) -> None:
    _source, monitor = fake
    panel = _panel(monitor)
    panel._pause_button.click()
    wait_until(lambda: panel._pause_button.description == "Resume")
    assert "Paused" in _text(panel._message.value)
    panel._pause_button.click()
    wait_until(lambda: panel._pause_button.description == "Pause")


# ------------------------------------------------------------------------------------------------
# Traffic (structural bound; the wall-clock figure is in benchmarks/bench_panel.py)
# ------------------------------------------------------------------------------------------------


def _fill(monitor: Monitor, seconds: float, rate_hz: float = 10.0) -> None:
    """A full window of samples, as the sampler would have recorded them."""
    now = time.monotonic()
    count = int(seconds * rate_hz)
    source = monitor.source
    for i in range(count):
        snapshot = source.snapshot()
        values = {}
        for reading in snapshot.allocator:
            wobble = (i * 7919 % 1000) * MIB
            values[f"cuda:{reading.device}/allocated"] = float(reading.allocated_bytes + wobble)
            values[f"cuda:{reading.device}/reserved"] = float(reading.reserved_bytes + 2 * wobble)
        for device in snapshot.devices:
            values[f"cuda:{device.device}/used"] = float(device.used_bytes)
        values["host/rss"] = float(GIB + i * MIB)
        monitor.timeline.append(now - (count - i) / rate_hz, values)


@pytest.mark.parametrize(
    ("devices", "window", "host"),
    [(1, "10min", False), (1, "1min", True), (8, "10min", False), (8, "all", True)],
)
def test_traffic_stays_within_budget_by_construction(
    recorder: CommRecorder, devices: int, window: str, host: bool
) -> None:
    source = FakeSource(devices=devices, total_bytes=80 * GIB)
    monitor = Monitor(source)
    for device in range(devices):
        source.allocate(10 * GIB, device)
    _fill(monitor, 600 if window == "10min" else 60 if window == "1min" else 3600)
    monitor.sampler.sample_once()
    panel = _panel(monitor, window=window, host=host)
    assert panel.refresh()
    for _ in range(3):
        monitor.sampler.sample_once()
        start = time.monotonic()
        assert panel.refresh()
        sent = recorder.nbytes(start)
        stats = panel.stats()
        assert stats.points_per_line <= 2000
        assert stats.last_interval_s >= 1 / 10  # at most a few pushes per second
        # What one push sends, spread over the time the writer waits before the next push.
        assert sent / stats.last_interval_s <= BROWSER_BUDGET_BYTES_PER_S, (sent, stats)
        assert stats.last_payload_bytes >= 0.6 * sent  # the panel's own estimate is close to the wire size
    options = PanelOptions()
    assert curve_interval_s(options, 0) >= 1 / options.refresh_hz
    assert math.isclose(curve_interval_s(options, 72_000), 2.0)


def test_windows_are_read_from_buckets_of_at_most_two_pixels() -> None:
    """A 1 s bucket is two points: 10 minutes read 1 s buckets, 1 minute raw samples, "all" what is kept."""
    assert [read_resolution_s(s) for s in (60.0, 600.0, 3600.0, None)] == pytest.approx([0.12, 1.2, 7.2, 0.0])
    timeline = Timeline()
    now = 10_000.5
    for i in range(6_000):  # 10 minutes at 10 Hz
        timeline.append(now - 600 + i * 0.1, {"cuda:0/allocated": float(i % 9) * GIB, "cuda:0/reserved": 9.0 * GIB})
    frame = build_curve_frame(timeline, PanelOptions(), now, 0.0, {})
    assert frame.points_per_line == 1_202  # 601 buckets of 1 s, sent as read
    assert frame.payload_bytes == 1_202 * (8 + 2 * 4) + 6 * 900
    assert frame.payload_bytes / 36_000 < 1.0  # the byte budget would allow more than one push a second,
    assert curve_interval_s(PanelOptions(), frame.payload_bytes) == 1.0  # but the window asks for 1 sample a second
    assert math.isclose(
        curve_interval_s(PanelOptions(budget_bytes_per_s=12_000), frame.payload_bytes), frame.payload_bytes / 12_000
    )
    minute = build_curve_frame(timeline, PanelOptions(window_s=60.0), now, 0.0, {})
    assert minute.points_per_line == 600  # raw samples
    assert (minute.x_ms / 1000).tolist() == pytest.approx([now - 600 + i * 0.1 for i in range(5_400, 6_000)])


def test_the_panel_asks_for_600_samples_a_window(fake: tuple[FakeSource, Monitor]) -> None:
    """1 Hz for the default 10 minutes (the monitor's own rate) and for 1 hour, 10 Hz for 1 minute, back
    when it closes."""
    _source, monitor = fake
    panel = Panel(monitor)
    panel._repr_mimebundle_()
    assert monitor.running and monitor.sampler.rate_hz == 1
    narrow = Panel(monitor, window="1m")
    narrow._repr_mimebundle_()
    assert monitor.sampler.rate_hz == 10
    narrow._window.value = "1 h"  # the user picks a longer window: the writer thread applies it
    wait_until(lambda: monitor.sampler.rate_hz == 1)
    narrow._window.value = "1 min"
    wait_until(lambda: monitor.sampler.rate_hz == 10)
    narrow.close()
    assert monitor.sampler.rate_hz == 1
    panel.close()
    assert not monitor.running


def test_pushes_come_no_faster_than_the_panels_samples() -> None:
    """The header and curves of the 10-minute window once a second (one new sample each), the 1-minute
    window's at the 2-a-second cap, the hour's header once a second and its curves as it scrolls a pixel."""
    ten = PanelOptions()
    assert sample_rate_hz(ten) == 1.0 and header_interval_s(ten) == 1.0 and curve_interval_s(ten, 0) == 1.0
    minute = PanelOptions(window_s=60.0)
    assert sample_rate_hz(minute) == 10.0 and header_interval_s(minute) == 0.5
    assert curve_interval_s(minute, 0) == 0.5
    hour = PanelOptions(window_s=3600.0)
    assert sample_rate_hz(hour) == 1.0 and header_interval_s(hour) == 1.0
    assert curve_interval_s(hour, 0) == pytest.approx(3.6)
    everything = PanelOptions(window_s=None)
    assert sample_rate_hz(everything) == 1.0 and curve_interval_s(everything, 0) == 5.0
    fast = PanelOptions(window_s=60.0, refresh_hz=10.0)  # --refresh 10: as fast as the 1-minute window's samples
    assert header_interval_s(fast) == pytest.approx(0.1)
    assert header_interval_s(PanelOptions(refresh_hz=10.0)) == 1.0  # 10 minutes: no faster than its samples


def test_the_readers_status_is_asked_again_only_when_cuda_comes_into_use_or_it_grew_old(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = FakeSource(cuda_initialized=False, nvml=True)
    monitor = Monitor(source)
    asked = []
    original = monitor.status
    monkeypatch.setattr(monitor, "status", lambda: asked.append(1) or original())
    panel = _panel(monitor)
    panel.set_state({"_view_count": 1})  # shown: its passes push
    shared_writer.remove(panel._service)  # this test runs the writer's passes itself
    for _ in range(4):
        monitor.sampler.sample_once()
        panel._schedule.invalidate()
        panel._service()
    assert len(asked) == 1  # nothing changed: the first answer stands
    assert "CUDA is not initialized (fake)" in _text(panel._header.value)
    source.allocate(GIB)  # the user's code puts a tensor on the GPU: CUDA is in use from now on
    monitor.sampler.sample_once()
    panel._schedule.invalidate()
    panel._service()
    assert len(asked) == 2
    assert "CUDA is not initialized" not in _text(panel._header.value)
    assert "allocated 1.0 GiB" in _text(panel._header.value)
    clock = time.monotonic() + widget_module.STATUS_MAX_AGE_S + 1
    monkeypatch.setattr(widget_module.time, "monotonic", lambda: clock)
    panel._schedule.invalidate()
    panel._service()
    assert len(asked) == 3  # grown old: asked again
    panel._service(force=True)
    assert len(asked) == 4  # a refresh asked for reads everything afresh
    monitor.stop()


def test_a_push_follows_the_sample_it_shows(fake: tuple[FakeSource, Monitor]) -> None:
    """At the default 1 Hz each push shows a sample taken just before it, not one up to a second old,
    and never the same sample twice."""
    _source, monitor = fake
    panel = Panel(monitor)
    pushes: list[tuple[float, float]] = []  # (when pushed, when the sample it shows was taken)
    original = panel._push_curves

    def recording(now: float) -> float:
        latest = panel._readings.latest()
        assert latest is not None
        pushes.append((now, latest.monotonic_s))
        return original(now)

    panel._push_curves = recording  # type: ignore[method-assign]
    monitor.acquire("another user")  # the sampler already runs at 1 Hz, out of step with the panel's opening
    time.sleep(0.5)
    panel.set_state({"_view_count": 1})  # shown: the pushes fall into step with the samples
    wait_until(lambda: len(pushes) >= 6, timeout_s=15.0)
    panel.close()
    monitor.release("another user")
    steady = pushes[1:]  # the first push shows the figures read at opening
    ages = [pushed - sampled for pushed, sampled in steady]
    assert max(ages) < 0.2, ages
    assert len({sampled for _pushed, sampled in steady}) == len(steady)
    assert all(0.8 < b[0] - a[0] < 1.3 for a, b in itertools.pairwise(steady)), steady
