"""The header's peaks and the curves under them tell the same story: the curves mark where the peaks start
(the panel opened, Reset peak), and reserved - allocated is called what it is, not fragmentation."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import pytest

from gpumem.core.cells.record import CellOptions
from gpumem.core.cells.tracker import CellTracker
from gpumem.core.monitoring.monitor import Monitor
from gpumem.core.monitoring.peaks import RunningPeak, kept_counter_exact
from gpumem.core.units import Amount
from gpumem.panel.header import build_header, render_header
from gpumem.panel.widget import Panel, close_all
from gpumem.testing import GIB, FakeSource


@pytest.fixture(autouse=True)
def _clean_panels() -> Iterator[None]:
    yield
    close_all()


def _text(html_text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html_text)).strip()


def test_the_curves_mark_where_peak_since_open_starts() -> None:
    source = FakeSource()
    monitor = Monitor(source)
    source.allocate(2 * GIB)
    source.transient(6 * GIB)  # 8 GiB before the panel opened: on the curve, not in the card
    big = source.allocate(6 * GIB)
    monitor.sampler.sample_once()
    source.free(big)
    monitor.sampler.sample_once()
    panel = Panel(monitor, autostart=False)
    monitor.sampler.sample_once()
    assert panel.refresh()
    header = _text(panel._header.value)
    assert "peak since open ≥ 2.0 GiB from the \u201cpanel opened\u201d mark" in header
    assert list(panel._cell_labels.text) == ["panel opened"]
    frame = panel._last_frame
    assert frame is not None and frame.mark_labels == ("panel opened",)
    (mark_ms,) = frame.mark_x_ms.tolist()
    assert frame.x_ms[1] <= mark_ms <= frame.x_ms[2]  # between the last sample before and the first after
    assert float(np.nanmax(np.asarray(panel._curves.y)[0])) == pytest.approx(8.0)  # the curve keeps the 8 GiB

    panel._reset_button.click()
    monitor.sampler.sample_once()
    assert panel.refresh()
    assert "peak since reset ≥ 2.0 GiB from the \u201cpeak reset\u201d mark" in _text(panel._header.value)
    assert list(panel._cell_labels.text) == ["peak reset"]
    monitor.stop()


def test_a_fresh_timeline_has_no_mark_to_explain() -> None:
    source = FakeSource()
    monitor = Monitor(source)
    panel = Panel(monitor, autostart=False)
    source.allocate(GIB)
    monitor.sampler.sample_once()
    assert panel.refresh()
    assert len(panel._cell_labels.text) == 0 or not panel._cell_lines.visible
    monitor.stop()


def test_reserved_minus_allocated_is_cached_not_fragmentation() -> None:
    source = FakeSource(devices=2)
    handles = [source.allocate(4 * GIB, device) for device in (0, 0, 1)]
    source.free(handles[0])
    snapshot = source.snapshot()
    infos = {0: source.device_info(0), 1: source.device_info(1)}
    for device in (0, None):
        model = build_header(snapshot, infos, {}, None, source.status(), device)
        text, _alert = render_header(model, Amount(fraction=0.9))
        assert "fragmentation" not in _text(text)  # the tooltip says when it is
        assert "cached, unallocated" in text
        assert "4.0 GiB" in _text(text)


# ------------------------------------------------------------------------------------------------
# The peak since open and the curve under it (the rule is core's: RunningPeak / kept_counter_exact)
# ------------------------------------------------------------------------------------------------


def test_running_peak_follows_cores_rule_for_a_kept_counter() -> None:
    peak = RunningPeak()
    peak.update(2 * GIB, 8 * GIB)  # the counter predates the start: it says nothing of the time since
    peak.update(3 * GIB, 8 * GIB)
    assert (peak.value, peak.exact, peak.why_not_exact) == (3 * GIB, False, "kept")
    peak.update(3 * GIB, 9 * GIB)  # it rose: its maximum was reached since the start
    assert (peak.value, peak.sampled, peak.exact) == (9 * GIB, 3 * GIB, True)
    peak.update(1 * GIB, 4 * GIB)  # it fell: someone reset it (a measured cell does at its start)
    assert (peak.value, peak.exact, peak.why_not_exact) == (9 * GIB, False, "reset")
    peak.update(1 * GIB, 12 * GIB)  # a peak after the reset is still a peak since the start: a lower bound
    assert (peak.value, peak.exact) == (12 * GIB, False)
    # The same inputs through the cells' rule give the same verdict.
    assert kept_counter_exact(8 * GIB, 9 * GIB, consistent=True, reset_seen=False) == (True, "")
    assert kept_counter_exact(8 * GIB, 8 * GIB, consistent=True, reset_seen=False) == (False, "kept")
    assert kept_counter_exact(8 * GIB, 4 * GIB, consistent=True, reset_seen=False) == (False, "reset")


def test_a_peak_between_samples_is_explained_under_the_card_and_on_hover() -> None:
    source = FakeSource()
    monitor = Monitor(source)
    source.allocate(GIB)
    monitor.sampler.sample_once()
    panel = Panel(monitor, autostart=False)
    source.transient(2 * GIB)  # 3 GiB for an instant no sample sees: the counter does
    monitor.sampler.sample_once()
    assert panel.refresh()
    frame = panel._last_frame
    assert frame is not None
    curve_top = float(np.nanmax(frame.y[0])) * frame.unit_bytes
    header = _text(panel._header.value)
    assert "peak since open 3.0 GiB" in header, header  # exact: the counter rose since the panel opened
    assert curve_top == pytest.approx(GIB)
    assert "curve: 1.0 GiB, the peak fell between samples" in header, "the card says why the curve is lower"
    card = re.search(r'title="([^"]*)"><div class="gm-label">peak since open', panel._header.value)
    assert card is not None and "Exact" in card.group(1) and "between two samples" in card.group(1)


def test_a_lower_bound_says_why_on_hover() -> None:
    source = FakeSource()
    monitor = Monitor(source)
    source.transient(6 * GIB)  # the counter stands at 6 GiB from before the panel
    source.allocate(GIB)
    panel = Panel(monitor, autostart=False)
    monitor.sampler.sample_once()
    assert panel.refresh()
    header = panel._header.value
    assert "peak since open ≥ 1.0 GiB" in _text(header)
    card = re.search(r'title="([^"]*)"><div class="gm-label">peak since open', header)
    assert card is not None and "lower bound" in card.group(1) and "has not risen" in card.group(1)
    assert "between samples" not in _text(header), "no gap to explain: the curve reaches the bound"


def test_inline_and_docked_panels_each_report_their_own_span_by_the_same_rule() -> None:
    source = FakeSource()
    monitor = Monitor(source)
    source.allocate(GIB)
    monitor.sampler.sample_once()
    inline = Panel(monitor, autostart=False)
    big = source.allocate(2 * GIB)  # 3 GiB while only the inline panel is open
    monitor.sampler.sample_once()
    source.free(big)
    monitor.sampler.sample_once()
    docked = Panel(monitor, autostart=False, compact=True)
    monitor.sampler.sample_once()
    assert inline.refresh() and docked.refresh()
    inline_text, docked_text = _text(inline._header.value), _text(docked._header.value)
    assert "peak since open 3.0 GiB" in inline_text, inline_text
    # The docked panel opened after the 3 GiB: its own span's peak, a bound (the counter stood above it),
    # with the mark that says where its span starts on a curve that still shows the 3 GiB.
    assert "peak since open ≥ 1.0 GiB from the \u201cpanel opened\u201d mark" in docked_text, docked_text
    assert "panel opened" in list(docked._cell_labels.text)
    frame = docked._last_frame
    assert frame is not None and float(np.nanmax(frame.y[0])) == pytest.approx(3.0)
    # Opened at the same instant, both say the same.
    twin = Panel(monitor, autostart=False, compact=True)
    again = Panel(monitor, autostart=False)
    source.transient(3 * GIB)  # 4 GiB between samples, above the counter's 3 GiB: exact for both
    monitor.sampler.sample_once()
    assert twin.refresh() and again.refresh()
    peak_of = lambda p: re.search(r"peak since open (≥ )?[\d.]+ GiB", _text(p._header.value)).group(0)  # noqa: E731
    assert peak_of(twin) == peak_of(again) == "peak since open 4.0 GiB"


def test_an_open_panel_neither_resets_the_counters_nor_keeps_a_cell_from_resetting_them() -> None:
    source = FakeSource()
    monitor = Monitor(source)
    source.allocate(GIB)
    source.transient(3 * GIB)  # the counter stands at 4 GiB when the panel opens
    monitor.sampler.sample_once()
    panel = Panel(monitor, autostart=False)
    monitor.sampler.sample_once()
    assert source.snapshot().allocator[0].peak_allocated_bytes == 4 * GIB  # the panel reset nothing
    tracker = CellTracker(monitor, start_sampler=False)
    try:
        cell = tracker.begin("x = big()", options=CellOptions(mode="magic"))
        source.transient(2 * GIB)  # 3 GiB, between samples
        record = tracker.end(cell)
    finally:
        tracker.close()
    # The panel is not a running measurement: the cell reset the raised counter and its peak is exact.
    assert not record.keep_peaks
    (change,) = record.devices
    assert change.peak_exact and change.peak_allocated_bytes == 3 * GIB
    monitor.sampler.sample_once()
    assert panel.refresh()
    # The panel saw the counter fall (the cell's reset): what it read since is still a peak since it opened,
    # but a lower bound from then on.
    assert "peak since open ≥ 3.0 GiB from the \u201cpanel opened\u201d mark" in _text(panel._header.value)
    monitor.stop()
