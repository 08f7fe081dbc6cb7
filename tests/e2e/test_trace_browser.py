"""The ``%%gpumem --trace`` HTML in Debian's chromium with the network off: the timeline SVG draws,
hovering it shows the bytes and site under the pointer, a site row expands to its stack."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpumem.core.trace import CellSnapshot, build_report

pytestmark = pytest.mark.browser

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "trace_snapshot.json"
CELLS = {"/tmp/ipykernel_42/2817.py": 2, "/tmp/ipykernel_42/1001.py": 3, "/tmp/ipykernel_42/1002.py": 4}


def test_trace_page_offline(browser: Any, tmp_path: Path) -> None:
    snapshot = json.loads(FIXTURE.read_text())
    page_html = build_report(CellSnapshot(snapshot, {0: 2}, False, [], 100), cell_numbers=CELLS, cell=4)._repr_html_()
    path = tmp_path / "trace.html"
    path.write_text(f"<!doctype html><html><body>{page_html}</body></html>")
    context = browser.new_context(offline=True, viewport={"width": 1000, "height": 800})
    requests: list[str] = []

    def refuse(route: Any) -> None:
        requests.append(route.request.url)
        route.abort()

    context.route("http*://**/*", refuse)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        page.goto(path.as_uri())
        svg = page.locator("svg[id^=gpumem-trace-]")
        assert svg.count() == 1
        box = svg.bounding_box()
        assert box is not None
        assert box["width"] > 500
        assert page.locator("svg polygon.band").count() == 5  # before the cell + four sites
        assert "peak 29.0 MiB" in (svg.text_content() or "")

        # Hover: the tooltip lists the bytes at the moment under the pointer (just past the peak's line).
        peak = page.locator("svg line.peak").bounding_box()
        assert peak is not None
        page.mouse.move(peak["x"] + 1, box["y"] + box["height"] / 2)
        tip = page.locator("div[id$=-tip]")
        tip.wait_for(state="visible")
        text = tip.inner_text()
        assert "29.0 MiB" in text
        assert "cell [4] line 3 in <module>: 16.0 MiB" in text
        assert "before the cell: 4.0 MiB" in text
        page.mouse.move(box["x"] + box["width"] + 50, box["y"] - 50)
        tip.wait_for(state="hidden")

        # A site expands to its stack, library frames folded.
        summary = page.locator("details summary", has_text="cell [4] line 3 in <module>").first
        stack = summary.locator("xpath=..").locator("pre")
        assert not stack.is_visible()
        summary.click()
        assert stack.is_visible()
        frames = stack.inner_text()
        assert "torch/nn/functional.py:1676 in linear (+1 library frames)" in frames
        assert "cell [4] line 3 in <module>" in frames
        assert errors == []
        assert requests == []
    finally:
        context.close()
