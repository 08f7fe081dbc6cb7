"""The live panel in a real JupyterLab, driven through Debian's chromium.

What a person would check: the panel renders, its curve rises in the SVG when a cell allocates a
large host array, Free reclaims it and says so, the curve keeps moving and Free works while a long
cell is still running, and nothing is sent once the panel's output is cleared.

And the case that matters when memory is short: the FIRST click on Free, in a fresh kernel, while a
cell runs (training), is answered at once: inline, after a page reload, and in the sidebar. (Before
the fix it was answered only when the cell ended: the kernel routed it to the busy main shell.)
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# The fixture that makes the servers load gpumem's front-end extension (the reload and sidebar cases need it).
from test_sidebar_browser import labextension  # noqa: F401

from _harness import (
    JupyterServer,
    KernelFrames,
    artifacts_path,
    cell_outputs_text,
    open_notebook,
    run_cell,
    save_screenshot,
    wait_for_cell_done,
    wait_for_kernel_idle,
    wait_for_output,
)
from _harness.lab_page import readme_screenshot

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

pytestmark = pytest.mark.browser

PANEL = ".gpumem-panel"
SIDEBAR_PANEL = "#gpumem-sidebar .gpumem-panel"
# What training looks like to the kernel: a cell that keeps the main thread busy.
LONG_CELL = "import time\nfor i in range(15): time.sleep(1)"
CLICK_INTO_CELL_S = 3.0
ANSWER_WITHIN_S = 5.0
HOST_GREEN = "rgb(22, 163, 74)"
GIB = 1 << 30

_LINES_JS = """(selector) => {
    const panel = document.querySelector(selector);
    if (!panel) return [];
    return [...panel.querySelectorAll('path.line')].map(p => {
        const box = p.getBoundingClientRect();
        return {d: p.getAttribute('d') || '', stroke: getComputedStyle(p).stroke,
                visible: box.width > 0 && box.height >= 0 && getComputedStyle(p).display !== 'none'};
    });
}"""

_PLOT_HEIGHT_JS = """(selector) => {
    const panel = document.querySelector(selector);
    const rect = panel && panel.querySelector('rect.plotarea_background, .plotarea_background');
    if (rect) return rect.getBoundingClientRect().height;
    const svg = panel && panel.querySelector('svg');
    return svg ? svg.getBoundingClientRect().height : 0;
}"""


_EDGES_JS = """([selector, stroke]) => {
    const panel = document.querySelector(selector);
    const plot = panel && panel.querySelector('rect.plotarea_background, .plotarea_background');
    const line = panel && [...panel.querySelectorAll('path.line')].find(p => getComputedStyle(p).stroke === stroke);
    if (!plot || !line) return null;
    const a = plot.getBoundingClientRect(), b = line.getBoundingClientRect();
    return {plotLeft: a.left, plotRight: a.right, lineLeft: b.left, lineRight: b.right};
}"""


_SVG_TEXT_JS = """(selector) => {
    const panel = document.querySelector(selector);
    return panel ? [...panel.querySelectorAll('svg text')].map(t => t.textContent).join(' ') : '';
}"""


def _points(d: str) -> list[tuple[float, float]]:
    numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", d)]
    return list(zip(numbers[0::2], numbers[1::2], strict=False))


def _host_line(page: Page) -> list[tuple[float, float]]:
    """Points (SVG pixels, y down) of the host RSS curve, or [] while it is not drawn."""
    for line in page.evaluate(_LINES_JS, PANEL):
        if line["stroke"] == HOST_GREEN and line["d"]:
            return _points(line["d"])
    return []


def _rise_px(points: list[tuple[float, float]]) -> float:
    """How far the newest point sits above the oldest one (pixels; SVG y grows downwards)."""
    return points[0][1] - points[-1][1] if len(points) >= 2 else 0.0


def _wait_for(predicate: Any, timeout_s: float, what: str, page: Page) -> Any:
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    save_screenshot(page, f"panel_wait_{re.sub(r'[^a-z]+', '_', what.lower())}")
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {value!r})")


def _message(page: Page) -> str:
    return str(page.locator(f"{PANEL} .gm-msg").first.inner_text())


def _prompt_running(cell: Locator) -> bool:
    return "*" in str(cell.locator(".jp-InputPrompt").first.inner_text())


def test_panel_in_jupyterlab(jupyter_server: JupyterServer, browser_page: Page) -> None:
    page = browser_page
    traffic = KernelFrames(page)
    jupyter_server.make_notebook("panel.ipynb", [""])
    open_notebook(page, jupyter_server, "panel.ipynb")
    run_cell(page, "%load_ext gpumem")
    panel_cell = run_cell(page, "%gpumem monitor --window 1min")
    page.locator(PANEL).first.wait_for(state="visible")
    _wait_for(lambda: len(_host_line(page)) >= 4, 30, "the host RSS curve", page)
    header = page.locator(f"{PANEL} .gm-header").first
    assert "No CUDA device is in use" in header.inner_text()
    assert "process RSS" in header.inner_text()

    # The kernel knows a view is shown (the front end reports it); the panel sends only then.
    views = run_cell(page, "import gpumem.panel.writer as gw\nprint('views', gw.open_panels()[0]._view_count)")
    wait_for_output(views, re.compile(r"views [1-9]"))
    time.sleep(2.0)  # let a few pushes happen before measuring the resting curve
    before = _host_line(page)
    plot_height = float(page.evaluate(_PLOT_HEIGHT_JS, PANEL))
    assert plot_height > 100, "the plot area did not get a height"
    assert abs(_rise_px(before)) < 0.2 * plot_height, f"curve not flat before allocating: {before[:3]}…{before[-3:]}"
    # The x scale ends now: the newest sample, a moment old, is drawn at the right edge, and the curve
    # (younger than the 1-minute window, which spans at least half a minute) lies inside the plot.
    edges = page.evaluate(_EDGES_JS, [PANEL, HOST_GREEN])
    assert edges is not None, "no plot area or host curve to measure"
    width = edges["plotRight"] - edges["plotLeft"]
    assert width > 200, edges
    assert abs(edges["plotRight"] - edges["lineRight"]) <= 0.03 * width, edges
    assert edges["plotLeft"] - 1 <= edges["lineLeft"] < edges["lineRight"] - 0.1 * width, edges

    # 1 GiB of host memory, held only by a reference cycle: alive until a collection runs. Automatic
    # collection is switched off so that the cycle waits for Free, as an old cycle does in practice.
    run_cell(
        page,
        "import gc, numpy as np\ngc.disable()\nclass Box: pass\n"
        "box = Box(); box.me = box; box.data = np.ones(1 << 27)\ndel box",
    )
    risen = _wait_for(
        lambda: (p := _host_line(page)) and _rise_px(p) > 0.4 * plot_height and p,
        30,
        "the curve to rise after allocating 1 GiB",
        page,
    )
    assert "GiB" in header.inner_text()
    # A measured cell puts a marker labelled with its execution count on the plot.
    measured = run_cell(page, "%%gpumem\nsmall = np.zeros(1000)")
    count = re.search(r"\[\s*(\d+)\s*\]", str(measured.locator(".jp-InputPrompt").first.inner_text()))
    assert count is not None
    _wait_for(lambda: f"[{count.group(1)}]" in page.evaluate(_SVG_TEXT_JS, PANEL), 20, "the cell marker", page)
    page.locator(PANEL).first.scroll_into_view_if_needed()
    save_screenshot(page, "panel_jupyterlab_allocated")

    page.locator(f"{PANEL} button", has_text="Free").first.click()
    message = _wait_for(lambda: (m := _message(page)).startswith("Freed") and m, 30, "Free's message", page)
    match = re.search(r"host RSS (-[\d.]+) (GiB|MiB)", message)
    assert match is not None, message
    freed = float(match.group(1)) * (GIB if match.group(2) == "GiB" else 1 << 20)
    assert freed <= -0.8 * GIB, f"Free did not reclaim the 1 GiB cycle: {message}"
    assert re.match(r"Freed [\d.]+ (GiB|MiB) of host memory", message), message
    _wait_for(lambda: _rise_px(_host_line(page)) < 0.5 * _rise_px(risen), 30, "the curve to fall after Free", page)
    page.locator(PANEL).first.screenshot(path=str(artifacts_path() / "panel_jupyterlab.png"))
    save_screenshot(page, "panel_jupyterlab_freed")

    _free_during_a_long_cell(page, message)
    _traffic_while_shown_and_after_clearing(page, traffic, panel_cell)


def _free_during_a_long_cell(page: Page, message: str) -> None:
    """A long cell: the curve keeps moving while it runs, and Free runs concurrently without harm."""
    loop = run_cell(
        page,
        "import time\nkeep = []\nfor step in range(60):\n"
        "    keep.append(np.ones(1 << 21))\n    time.sleep(0.1)\nprint('loop done', len(keep))",
        wait=False,
    )
    _wait_for(lambda: _prompt_running(loop), 20, "the long cell to start", page)
    first = _host_line(page)
    moved = _wait_for(lambda: _prompt_running(loop) and (p := _host_line(page)) != first and p, 15,
                      "the curve to move during the cell", page)  # fmt: skip
    assert moved and _prompt_running(loop)
    page.locator(f"{PANEL} button", has_text="Free").first.click()
    _wait_for(lambda: "Freeing" in _message(page) or (_message(page).startswith("Freed") and _message(page) != message),
              15, "Free to run during the cell", page)  # fmt: skip
    during = _wait_for(lambda: (m := _message(page)).startswith("Freed") and m != message and m, 30,
                       "Free's message during the cell", page)  # fmt: skip
    still_running = _prompt_running(loop)
    wait_for_cell_done(loop, timeout=60)
    assert "loop done 60" in cell_outputs_text(loop)
    assert still_running, f"the long cell ended before Free answered ({during}); the test proves nothing"


def _traffic_while_shown_and_after_clearing(page: Page, traffic: KernelFrames, panel_cell: Locator) -> None:
    """Traffic while shown, then none once the panel's output is cleared (no view left)."""
    page.wait_for_timeout(500)  # Playwright delivers websocket events only while it is called
    shown_start = time.monotonic()
    page.wait_for_timeout(6000)
    shown_bytes = traffic.bytes_between(shown_start, time.monotonic(), update=True)
    panel_cell.locator(".jp-InputPrompt").first.click()
    page.keyboard.press("Escape")
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:clear-cell-output')")
    _wait_for(lambda: page.locator(PANEL).count() == 0, 15, "the panel output to clear", page)
    # The views the panel counts (the pages still there), gw imported by an earlier cell.
    views = run_cell(page, "print('views', gw.open_panels()[0]._views.shown())")
    wait_for_output(views, "views 0")
    page.wait_for_timeout(500)
    hidden_start = time.monotonic()
    page.wait_for_timeout(6000)
    hidden_bytes = traffic.bytes_between(hidden_start, time.monotonic(), update=True)
    (artifacts_path() / "panel_browser_traffic.json").write_text(
        json.dumps(
            {
                "widget_update_bytes_per_s_shown": round(shown_bytes / 6.0),
                "widget_update_bytes_per_s_hidden": round(hidden_bytes / 6.0),
                "window": "1min",
            },
            indent=1,
        )
    )
    assert shown_bytes > 0, "no widget updates were seen while the panel was shown"
    assert hidden_bytes == 0, f"{hidden_bytes} bytes of widget updates were sent with no view shown"


def test_panel_in_notebook7(notebook_server: JupyterServer, browser_page: Page) -> None:
    page = browser_page
    notebook_server.make_notebook("panel_nb7.ipynb", [""])
    open_notebook(page, notebook_server, "panel_nb7.ipynb")
    run_cell(page, "import gpumem\ngpumem.Panel(window='1min', host=True)")
    page.locator(PANEL).first.wait_for(state="visible")
    _wait_for(lambda: len(_host_line(page)) >= 4, 30, "the host RSS curve in Notebook 7", page)
    assert "process RSS" in page.locator(f"{PANEL} .gm-header").first.inner_text()
    page.locator(f"{PANEL} button", has_text="Free").first.click()
    _wait_for(lambda: _message(page).startswith("Freed"), 30, "Free's message in Notebook 7", page)
    page.locator(PANEL).first.screenshot(path=str(artifacts_path() / "panel_notebook7.png"))


# ------------------------------------------------------------------------------------------------
# The first Free click while a cell runs, in a fresh kernel (a new notebook per test)
# ------------------------------------------------------------------------------------------------


def _first_free_click_during_a_cell(page: Page, panel: str, case: str) -> float:
    """Run :data:`LONG_CELL`, click the panel's Free 3 s into it; seconds until the panel answers.

    The cell is interrupted once the answer is seen (what matters is when the answer came)."""
    loop = run_cell(page, LONG_CELL, wait=False)
    _wait_for(lambda: _prompt_running(loop), 20, "the long cell to start", page)
    time.sleep(CLICK_INTO_CELL_S)
    message = page.locator(f"{panel} .gm-msg").first
    before = message.inner_text()
    clicked = time.monotonic()
    page.locator(f"{panel} button", has_text="Free").first.click()
    answer_s = None
    while answer_s is None and time.monotonic() - clicked < 20:
        text = message.inner_text()
        if text != before and ("Freeing" in text or text.startswith("Freed")):
            answer_s = time.monotonic() - clicked
        else:
            page.wait_for_timeout(50)
    running = _prompt_running(loop)
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:interrupt-kernel')")
    wait_for_cell_done(loop, timeout=30)
    _record_answer(case, answer_s)
    assert answer_s is not None, f"{case}: Free did not answer within 20 s of the click"
    assert answer_s < ANSWER_WITHIN_S, f"{case}: Free answered {answer_s:.1f} s after the click"
    assert running, f"{case}: the cell ended before Free answered ({answer_s:.1f} s); the test proves nothing"
    return answer_s


def _record_answer(case: str, answer_s: float | None) -> None:
    """test-artifacts/panel_first_click.json: seconds from the click to the answer, per case."""
    path = artifacts_path() / "panel_first_click.json"
    try:
        answers = json.loads(path.read_text())
    except (OSError, ValueError):
        answers = {}
    answers[case] = None if answer_s is None else round(answer_s, 2)
    path.write_text(json.dumps(answers, indent=1, sort_keys=True))


def test_first_free_click_during_a_cell(jupyter_server: JupyterServer, browser_page: Page) -> None:
    page = browser_page
    jupyter_server.make_notebook("first_click.ipynb", [""])
    open_notebook(page, jupyter_server, "first_click.ipynb")
    run_cell(page, "%load_ext gpumem")
    run_cell(page, "%gpumem monitor")
    page.locator(PANEL).first.wait_for(state="visible")
    _first_free_click_during_a_cell(page, PANEL, "inline")


@pytest.mark.usefixtures("labextension")
def test_first_free_click_after_a_page_reload(jupyter_server: JupyterServer, browser_page: Page) -> None:
    """Reload while the kernel lives: the panel re-renders, counts only the new page's view, answers
    the first click during a cell at once, and sends nothing once its output is cleared."""
    page = browser_page
    traffic = KernelFrames(page)
    jupyter_server.make_notebook("reload_click.ipynb", [""])
    open_notebook(page, jupyter_server, "reload_click.ipynb")
    run_cell(page, "%load_ext gpumem")
    panel_cell = run_cell(page, "%gpumem monitor --window 1min")
    page.locator(PANEL).first.wait_for(state="visible")
    views = run_cell(page, "import gpumem.panel.writer as gw\nprint('views', gw.open_panels()[0]._views.shown())")
    wait_for_output(views, "views 1")
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    page.locator(".lm-TabBar-tab.jp-mod-dirty", has_text="reload_click.ipynb").wait_for(state="detached")
    page.reload(wait_until="domcontentloaded")
    wait_for_kernel_idle(page)
    page.locator(PANEL).first.wait_for(state="visible")
    # ipywidgets' own count is 2 now (the old page never took its view back); the panel counts 1.
    views = run_cell(page, "print('views', gw.open_panels()[0]._views.shown())")
    wait_for_output(views, "views 1")
    _first_free_click_during_a_cell(page, PANEL, "after a page reload")
    _traffic_while_shown_and_after_clearing(page, traffic, panel_cell)


@pytest.mark.usefixtures("labextension")
def test_first_free_click_in_the_sidebar(jupyter_server: JupyterServer, browser_page: Page) -> None:
    page = browser_page
    jupyter_server.make_notebook("sidebar_click.ipynb", [""])
    open_notebook(page, jupyter_server, "sidebar_click.ipynb")
    run_cell(page, "%load_ext gpumem")
    run_cell(page, "%gpumem sidebar")
    page.locator(SIDEBAR_PANEL).first.wait_for(state="visible")
    _first_free_click_during_a_cell(page, SIDEBAR_PANEL, "sidebar")


# ------------------------------------------------------------------------------------------------
# A wide notebook: no sideways scroll, marker labels apart, the plot controls; the README's pictures
# ------------------------------------------------------------------------------------------------

# Sideways overflow of the panel and of the output area holding it, and marker labels that overlap.
FITS_JS = """(selector) => {
    const panel = document.querySelector(selector);
    const output = panel.closest('.jp-OutputArea-output') || panel.parentElement;
    // bqplot's Label mark draws each text as <text class="label element"> in a .object_grp group.
    const boxes = [...panel.querySelectorAll('.object_grp text.label')].filter(t => t.textContent.trim())
        .map(t => { const r = t.getBoundingClientRect();
                    return {text: t.textContent, left: r.left, right: r.right, top: r.top, bottom: r.bottom}; });
    const overlaps = [];
    boxes.forEach((a, i) => boxes.slice(i + 1).forEach(b => {
        const apart = a.right <= b.left || b.right <= a.left || a.bottom <= b.top || b.bottom <= a.top;
        if (!apart) overlaps.push([a.text, b.text]);
    }));
    return {panel: panel.scrollWidth - panel.clientWidth, output: output.scrollWidth - output.clientWidth,
            labels: boxes.map(b => b.text), overlaps};
}"""

_Y_TICKS_JS = """(selector) => {
    const panel = document.querySelector(selector);
    const axis = [...panel.querySelectorAll('g.axis')].find(a => a.querySelector('text.axislabel') &&
        /iB/.test(a.querySelector('text.axislabel').textContent));
    if (!axis) return {unit: '', ticks: []};
    return {unit: axis.querySelector('text.axislabel').textContent.trim(),
            ticks: [...axis.querySelectorAll('.tick text')].map(t => parseFloat(t.textContent))};
}"""
WIDE_VIEWPORT = {"width": 1600, "height": 1000}
QUICK_CELLS = 30


def run_quick_cells(page: Page, count: int) -> None:
    """``count`` measured cells in quick succession (automatic mode marks each on the plot)."""
    for _ in range(count):
        run_cell(page, "x = 1")


def assert_fits(page: Page, selector: str, what: str) -> dict[str, Any]:
    page.locator(selector).first.scroll_into_view_if_needed()
    fits: dict[str, Any] = page.evaluate(FITS_JS, selector)
    assert fits["panel"] <= 0, f"{what}: the panel scrolls sideways by {fits['panel']} px"
    assert fits["output"] <= 0, f"{what}: its output area scrolls sideways by {fits['output']} px"
    assert fits["labels"], f"{what}: no cell-marker label is drawn"
    assert not fits["overlaps"], f"{what}: marker labels overlap: {fits['overlaps']}"
    return fits


def test_wide_notebook_panel_fits_and_readme_pictures(jupyter_server: JupyterServer, browser_page: Page) -> None:
    page = browser_page
    page.set_viewport_size(WIDE_VIEWPORT)
    jupyter_server.make_notebook("wide.ipynb", [""])
    open_notebook(page, jupyter_server, "wide.ipynb")
    run_cell(page, "%load_ext gpumem")
    run_cell(page, "import numpy as np, torch")
    run_cell(page, "%gpumem monitor --window 1min")
    page.locator(PANEL).first.wait_for(state="visible")
    _wait_for(lambda: len(_host_line(page)) >= 4, 30, "the host RSS curve", page)
    run_cell(page, "%gpumem auto on")
    run_quick_cells(page, QUICK_CELLS)
    _wait_for(lambda: "[3" in page.evaluate(_SVG_TEXT_JS, PANEL), 20, "the newest cell markers", page)
    page.wait_for_timeout(1500)  # one more push after the last cell
    fits = assert_fits(page, PANEL, "inline at 1600 px")
    assert len(fits["labels"]) >= 3, fits
    # The README's panel and cell-report pictures come from the recorded GPU session (the test below).
    save_screenshot(page, "panel_inline_live")

    report = run_cell(page, "%%gpumem\nweights = torch.ones(64, 1 << 20)\nscratch = torch.zeros(32, 1 << 20)")
    wait_for_output(report, "weights")
    who = run_cell(page, "%gpumem who -d cpu")
    wait_for_output(who, "weights")
    save_screenshot(page, "who_live")  # the README's who.png is the recorded GPU session's (the test below)
    _full_scale_and_host_rss(page)


def _full_scale_and_host_rss(page: Page) -> None:
    """Without a GPU: full scale puts the axis at the machine's RAM; the host curve is what is plotted."""
    probe = run_cell(page, "import psutil\nprint('total', psutil.virtual_memory().total)")
    total = int(re.search(r"total (\d+)", wait_for_output(probe, "total")).group(1))  # type: ignore[union-attr]

    def axis_top() -> float:
        axis = page.evaluate(_Y_TICKS_JS, PANEL)
        unit_bytes = {"GiB": GIB, "MiB": 1 << 20}.get(axis["unit"], 0)
        return max(axis["ticks"]) * unit_bytes if axis["ticks"] else 0.0

    assert axis_top() < total / 4, "the axis already spans the machine's RAM: the check proves nothing"
    page.locator(f"{PANEL} .widget-checkbox", has_text="full scale").first.locator("input").check()

    # bqplot relabels the axis at once but drops the old tick texts on a later animation frame, so a page
    # under load can for a moment show MiB figures under "GiB": what counts is the axis it settles on.
    tops: list[float] = []

    def truthful_top() -> bool:
        tops.append(axis_top())
        return total <= tops[-1] <= 1.3 * total

    try:
        _wait_for(truthful_top, 20, "the axis to settle at the machine's RAM", page)
    except AssertionError:
        raise AssertionError(f"full scale put the axis at {tops[-1] / GIB:.1f} GiB for {total / GIB:.1f} GiB") from None
    page.wait_for_timeout(1000)
    top = axis_top()
    assert total <= top <= 1.3 * total, f"full scale put the axis at {top / GIB:.1f} GiB for {total / GIB:.1f} GiB"
    host = page.locator(f"{PANEL} .widget-checkbox", has_text="host RSS").first.locator("input")
    assert host.is_checked() and host.is_disabled(), "without a GPU the host box must say the curve is what is shown"
    assert _host_line(page), "the host RSS curve is not drawn"


# The README's pictures of a GPU at work: a session recorded on an H200 (benchmarks/record_session.py runs
# notebooks/gpu_session.ipynb there), kept in the repository and shown by %gpumem load without a GPU.
RECORDED_SESSION = Path(__file__).resolve().parents[2] / "docs" / "sessions" / "h200-training.json"
RECORDED_NOTEBOOK = RECORDED_SESSION.with_name("h200-training.executed.ipynb")
LOADED_PANEL = ".gpumem-loaded"
# The single-device colours of panel/curves.py: allocated, reserved, device used (all processes).
CUDA_STROKES = {"allocated": "rgb(37, 99, 235)", "reserved": "rgb(127, 176, 245)", "device used": "rgb(107, 114, 128)"}


def _transient_change(data: Any) -> Any:
    """The recorded cell, and its device change, whose exact peak rose furthest above both its start and its end."""
    changes = [(record, c) for record in data.cells for c in record.devices if c.peak_exact]
    return max(
        changes,
        key=lambda rc: rc[1].peak_allocated_bytes - max(rc[1].allocated_before_bytes, rc[1].allocated_after_bytes),
    )


def _line_extent(points: list[tuple[float, float]]) -> float:
    ys = [y for _x, y in points]
    return max(ys) - min(ys) if ys else 0.0


def test_readme_pictures_from_the_recorded_gpu_session(jupyter_server: JupyterServer, browser_page: Page) -> None:
    """%gpumem load of the committed GPU session draws cuda:0's allocated, reserved and device-used curves
    (not host RSS), moving, with the recorded cell marks; the README's pictures of the panel and of a cell's
    report are taken from it, and the one of %gpumem who from the notebook that recorded it."""
    from gpumem.core.sessions.session_file import read_session
    from gpumem.core.units import format_delta
    from gpumem.panel.curves import MAX_CELL_MARKS, _mark_label

    assert RECORDED_SESSION.exists(), (
        f"{RECORDED_SESSION} is missing: record it on a GPU machine with benchmarks/record_session.py (its docstring)"
    )
    data = read_session(RECORDED_SESSION)
    assert {"cuda:0/allocated", "cuda:0/reserved", "cuda:0/used"} <= set(data.timeline.values), (
        f"{RECORDED_SESSION.name} is not a GPU session: {sorted(data.timeline.values)}"
    )
    page = browser_page
    page.set_viewport_size(WIDE_VIEWPORT)
    jupyter_server.copy_in(RECORDED_SESSION)
    jupyter_server.make_notebook("recorded.ipynb", [""])
    open_notebook(page, jupyter_server, "recorded.ipynb")
    run_cell(page, "%load_ext gpumem")
    cell = run_cell(page, f"%gpumem load {RECORDED_SESSION.name}")
    page.locator(LOADED_PANEL).first.wait_for(state="visible")

    _assert_cuda_curves(page, LOADED_PANEL)
    panel = page.locator(LOADED_PANEL).first
    header, legend = panel.locator(".gm-title").first.inner_text(), panel.locator(".gm-legend").inner_text()
    assert header.startswith("cuda:0"), header
    for label in ("allocated", "reserved", "device used (all processes)"):
        assert label in legend, legend
    recorded = {_mark_label(mark.label) for mark in data.marks[-MAX_CELL_MARKS:]}
    fits = assert_fits(page, LOADED_PANEL, "the recorded session at 1600 px")
    assert len(fits["labels"]) >= 3, fits
    shown = {label.strip() for label in fits["labels"]}
    assert shown <= recorded, f"marks not in the recording: {shown - recorded}"
    readme_screenshot(cell.locator(".jp-OutputArea-output").first, "panel_inline")
    save_screenshot(page, "recorded_session_loaded")  # the whole output, for review

    record, change = _transient_change(data)
    report = cell.locator(f".gpumem-cell-report[data-cell='{record.execution_count}']")
    report.locator("summary").click()
    report.locator(".gpumem-report").first.wait_for(state="visible")
    text = report.inner_text()
    assert "peak above start" in text, text
    assert format_delta(change.peak_above_start_bytes) in text, text  # the exact peak, not a sampled bound
    readme_screenshot(report, "cell_report")
    _recorded_who_picture(jupyter_server, page)


def _recorded_who_picture(server: JupyterServer, page: Page) -> None:
    """who.png: the recorded notebook's own %gpumem who cell, as it ran on the GPU (signed, so its HTML
    is shown as the kernel sent it), naming the leak: the list whose autograd graphs keep 4.4 GiB."""
    import nbformat
    from nbformat.sign import NotebookNotary

    notebook = nbformat.read(RECORDED_NOTEBOOK, as_version=4)
    NotebookNotary(data_dir=str(server.env.data_dir)).sign(notebook)  # the server's own trust database
    nbformat.write(notebook, server.root_dir / RECORDED_NOTEBOOK.name)
    open_notebook(page, server, RECORDED_NOTEBOOK.name)
    cell = page.locator(".jp-CodeCell", has=page.locator(".jp-InputArea", has_text="%gpumem who")).first
    cell.scroll_into_view_if_needed()
    text = wait_for_output(cell, "Tensor memory held by names (cuda)")
    assert "predictions" in text and "saved by its autograd graphs" in text, text
    assert cell.locator(".jp-RenderedHTMLCommon table").count() >= 2, "the report's HTML was not rendered"
    readme_screenshot(cell, "who")


def _assert_cuda_curves(page: Page, selector: str) -> None:
    """cuda:0's allocated, reserved and device-used curves in the panel at ``selector``, none flat; no host RSS."""

    def cuda_lines() -> dict[str, list[tuple[float, float]]]:
        lines = {line["stroke"]: _points(line["d"]) for line in page.evaluate(_LINES_JS, selector) if line["d"]}
        return {name: lines.get(stroke, []) for name, stroke in CUDA_STROKES.items()}

    lines = _wait_for(lambda: all(cuda_lines().values()) and cuda_lines(), 30, "the recorded CUDA curves", page)
    assert not any(line["stroke"] == HOST_GREEN for line in page.evaluate(_LINES_JS, selector)), "host RSS drawn"
    for name, points in lines.items():
        assert len(points) > 10, f"{name}: {len(points)} points"
        assert _line_extent(points) > 30, f"the {name} curve is flat: {_line_extent(points):.1f} px tall"
