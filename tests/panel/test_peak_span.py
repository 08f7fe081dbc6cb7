"""The header's peaks and the curves under them tell the same story: the curves mark where the peaks start
(the panel opened, Reset peak), and reserved - allocated is called what it is, not fragmentation."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import pytest

from gpumem.core.monitor import Monitor
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
        text, _alert = render_header(build_header(snapshot, infos, {}, None, source.status(), device), 0.9)
        assert "fragmentation" not in _text(text)  # the tooltip says when it is
        assert "cached, unallocated" in text
        assert "4.0 GiB" in _text(text)
