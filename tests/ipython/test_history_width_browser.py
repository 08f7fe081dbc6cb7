"""The history table fits a notebook's output area at 1600 px: the "first line" column wraps instead of
pushing the table sideways or being cut (real IPython shell and history, rendered in Debian's chromium)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from _harness import run_cell_capture
from gpumem.core.cells.history import HistoryTable
from gpumem.core.monitoring.monitor import Monitor, set_default_monitor
from gpumem.ipython import extension as _extension
from gpumem.testing import MIB, FakeSource

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = pytest.mark.browser

WIDE_PAGE_PX = 1600
# JupyterLab's output area in a 1600 px window with the file browser and gpumem's sidebar open: the
# window less the two tab bars (33 px each), both side panels (250 and 280 px) and the prompt column.
OUTPUT_AREA_PX = 900
LONG_LINE = "w = src.allocate(MIB); note = " + repr("a first line as long as the history keeps it, 80")


@pytest.fixture
def history_html(ip: Any) -> Iterator[str]:
    set_default_monitor(Monitor(FakeSource(devices=4)))  # eight device columns beside the first line
    try:
        assert ip.run_cell("%load_ext gpumem").success
        ip.user_ns.update(src=_extension.get_state().monitor.source, MIB=MIB)  # type: ignore[union-attr]
        for _ in range(3):
            result, _cap = run_cell_capture(ip, "%%gpumem -q\n" + LONG_LINE)
            assert result.success
        state = _extension.get_state()
        assert state is not None
        yield HistoryTable(state.tracker.history)._repr_html_()
    finally:
        ip.run_cell("%unload_ext gpumem")
        set_default_monitor(None)


def test_the_history_table_never_scrolls_sideways_at_1600_px(history_html: str, browser_page: Page) -> None:
    assert len(LONG_LINE) == 80  # the longest first line the history keeps whole
    assert LONG_LINE.replace("'", "&#x27;") in history_html
    browser_page.set_viewport_size({"width": WIDE_PAGE_PX, "height": 900})
    area = f"<div id='area' style='width:{OUTPUT_AREA_PX}px;overflow-x:auto'>{history_html}</div>"
    browser_page.set_content(f"<html><body style='margin:8px'>{area}</body></html>")
    page = browser_page.evaluate(
        """() => {
            const area = document.getElementById('area');
            const cell = document.querySelector('tbody td.src');
            const range = document.createRange();
            range.selectNodeContents(cell);
            return {scroll: area.scrollWidth, width: area.clientWidth,
                    clipped: cell.scrollWidth > cell.clientWidth,
                    lines: new Set([...range.getClientRects()].map(r => r.top)).size,
                    text: cell.textContent};
        }"""
    )
    assert page["scroll"] <= page["width"], page
    assert not page["clipped"], page
    assert page["lines"] >= 2, page  # wrapped onto several lines, every character shown
    assert page["text"] == LONG_LINE
