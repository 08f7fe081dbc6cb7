"""The panel's holders view in a real JupyterLab 4 and Notebook 7, driven through chromium.

From a fresh kernel with a tensor pinned only by IPython's output cache, the panel names it and offers
a button labelled with the bytes releasing it returns; one click (or Tab and Enter) frees it, and the result
says it was as promised. Then an action clicked while a cell runs is answered within a second, and
the view fits a 1600 px notebook and a narrow one without sideways scroll. After an out-of-memory
error the panel shows its explanation next to the action that frees what the error's frames keep.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

import pytest

# The fixture that makes the servers load gpumem's front-end extension (the sidebar needs it), and the drag
# of the sidebar's split handle a user would do.
from test_sidebar_browser import _resize_right_sidebar, labextension  # noqa: F401

from _harness import (
    JupyterServer,
    artifacts_path,
    open_notebook,
    run_cell,
    save_screenshot,
    wait_for_cell_done,
    wait_for_output,
)

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = pytest.mark.browser

PANEL = ".gpumem-panel"
BUTTONS = f"{PANEL} .gm-reclaim button"
RESULT = f"{PANEL} .gm-holders-pane .gm-result"
SETUP = (
    "import torch\n"
    "model = torch.nn.Linear(1000, 1000)\n"
    "model(torch.ones(2, 1000)).sum().backward()\n"
    "torch.ones(1_000_000)"
)
# An out-of-memory error as PyTorch words it (this machine has no GPU), raised where its frame keeps a tensor
# that nothing else holds: the explanation and the action that drops the frames are the real ones.
OOM_CELL = (
    "def step():\n"
    "    activations = torch.ones(1_000_000)\n"
    "    raise torch.OutOfMemoryError(\n"
    "        'CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which '\n"
    "        '1.50 GiB is free. Including non-PyTorch memory, this process has 77.60 GiB memory in use. Of the '\n"
    "        'allocated memory 76.00 GiB is allocated by PyTorch, and 1.10 GiB is reserved by PyTorch but '\n"
    "        'unallocated.')\n"
    "step()"
)
LONG_CELL = "import time\nfor i in range(12): time.sleep(1)"
ANSWER_WITHIN_S = 1.0

# Sideways overflow of the holders pane, of the panel and of the output area holding it; text cut off.
FITS_JS = """(selector) => {
    const panel = document.querySelector(selector);
    const pane = panel.querySelector('.gm-holders-pane');
    const cells = panel.querySelector('.gm-cells-pane');
    const output = panel.closest('.jp-OutputArea-output') || panel.parentElement;
    const edge = pane.getBoundingClientRect().right + 1;
    const cut = [...pane.querySelectorAll('button'), ...cells.querySelectorAll('*')]
        .filter(b => b.offsetParent !== null && b.tagName !== 'SELECT' && b.tagName !== 'OPTION' &&
                     (b.scrollWidth > b.clientWidth + 1 || b.getBoundingClientRect().right > edge))
        .map(b => `${b.tagName} ${b.textContent.slice(0, 40)}`);
    return {pane: Math.max(pane.scrollWidth - pane.clientWidth, cells.scrollWidth - cells.clientWidth),
            panel: panel.scrollWidth - panel.clientWidth,
            output: output.scrollWidth - output.clientWidth, cut};
}"""


def _wait_for(predicate: Any, timeout_s: float, what: str, page: Page) -> Any:
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        page.wait_for_timeout(50)
    save_screenshot(page, f"holders_wait_{re.sub(r'[^a-z]+', '_', what.lower())}")
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {value!r})")


def _labels(page: Page) -> list[str]:
    buttons = page.locator(BUTTONS)
    return [buttons.nth(i).inner_text().strip() for i in range(buttons.count()) if buttons.nth(i).is_visible()]


def _result(page: Page) -> str:
    return str(page.locator(RESULT).first.inner_text())


def _release_out_without_typing(page: Page, *, by_keyboard: bool = False) -> None:
    """The Out button's label before, one click (or Tab and Enter), the measured result after; the tensor is gone."""
    label = _wait_for(lambda: next((t for t in _labels(page) if t.startswith("Release Out[")), None), 30,
                      "the Release Out button", page)  # fmt: skip
    assert re.fullmatch(r"Release Out\[\d+\]: 3\.8 MiB", label), label
    assert "3.8 MiB" in page.locator(f"{PANEL} .gm-holders-view").first.inner_text()
    if by_keyboard:
        _press_by_keyboard(page, "Release Out[")
    else:
        page.locator(BUTTONS, has_text="Release Out[").first.click()
    text = _wait_for(lambda: "as promised" in (t := _result(page)) and t, 15, "the release's result", page)
    assert re.search(r"Release Out\[\d+\]: 1 storage freed", text), text
    _wait_for(lambda: not any(t.startswith("Release Out[") for t in _labels(page)), 15, "the button to go", page)


def _press_by_keyboard(page: Page, label_start: str) -> None:
    """Tab from the holders view's Refresh button to the button whose label starts so, then Enter."""
    page.locator(f"{PANEL} .gm-holders-pane button", has_text="Refresh").first.focus()
    for _ in range(12):
        page.keyboard.press("Tab")
        focused = page.evaluate("() => (document.activeElement?.textContent || '').trim()")
        if focused.startswith(label_start):
            page.keyboard.press("Enter")
            return
    raise AssertionError(f"Tab from Refresh never reached {label_start!r} (last focused: {focused!r})")


def _standing(page: Page) -> list[str]:
    items = page.locator(f"{PANEL} .gm-cells-pane .gm-conditions li")
    return [items.nth(i).inner_text().strip() for i in range(items.count()) if items.nth(i).is_visible()]


def _action_while_a_cell_runs(page: Page) -> float:
    """Click "Drop model's gradients" 2 s into a long cell: seconds until its result is shown."""
    loop = run_cell(page, LONG_CELL, wait=False)
    page.wait_for_timeout(2000)
    button = page.locator(BUTTONS, has_text="Drop model's gradients").first
    assert button.is_visible()
    clicked = time.monotonic()
    button.click()
    _wait_for(lambda: "model's gradients" in _result(page) and "as promised" in _result(page), 10,
              "the gradients' result", page)  # fmt: skip
    answer_s = time.monotonic() - clicked
    running = "*" in str(loop.locator(".jp-InputPrompt").first.inner_text())
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:interrupt-kernel')")
    wait_for_cell_done(loop, timeout=30)
    assert running, f"the cell ended before the action answered ({answer_s:.1f} s): the test proves nothing"
    assert answer_s < ANSWER_WITHIN_S, f"the action answered {answer_s:.2f} s after the click"
    return answer_s


def _a_cells_report_in_the_panel(page: Page) -> None:
    """A measured cell is offered in the panel's compact history; picking it shows its report there."""
    run_cell(page, "%%gpumem\nreported = torch.ones(500_000)")
    choice = page.locator(f"{PANEL} .gm-cells-pane select").first
    label = _wait_for(lambda: next((o for o in choice.locator("option").all_inner_texts() if "reported" in o), None),
                      20, "the measured cell in the compact history", page)  # fmt: skip
    choice.select_option(label=label)
    _wait_for(lambda: "reported = torch.ones" in page.locator(f"{PANEL} .gm-cells-pane").first.inner_text(), 15,
              "the cell's report in the panel", page)  # fmt: skip


def _oom_in_the_panel(page: Page) -> None:
    """A cell dies of out-of-memory: the panel explains it once and frees what its frames keep in one click."""
    run_cell(page, OOM_CELL)
    oom = page.locator(f"{PANEL} .gm-cells-pane [role=alert]").first
    _wait_for(oom.is_visible, 30, "the out-of-memory explanation in the panel", page)
    explanation = str(page.locator(f"{PANEL} .gm-cells-pane").first.inner_text())
    assert "Out of memory" in explanation and "2.0 GiB" in explanation and "1.5 GiB" in explanation, explanation
    label = _wait_for(lambda: next((t for t in _labels(page) if t.startswith("Drop the last exception")), None), 30,
                      "the action that drops the exception's frames", page)  # fmt: skip
    assert label == "Drop the last exception's frames: 3.8 MiB", label
    page.locator(BUTTONS, has_text="Drop the last exception").first.click()
    text = _wait_for(lambda: "last exception" in (t := _result(page)) and "as promised" in t and t, 15,
                     "the drop's result", page)  # fmt: skip
    assert re.search(r"Drop the last exception's frames: .*as promised", text), text
    assert page.locator(f"{PANEL} .gm-cells-pane [role=alert]").count() == 1, "the explanation is shown once"


def _assert_fits(page: Page, what: str, *, whole_panel: bool = True) -> None:
    """The holders pane (and, where the plot has room, the whole panel) scrolls not sideways, cuts no button."""
    page.locator(PANEL).first.scroll_into_view_if_needed()
    fits = page.evaluate(FITS_JS, PANEL)
    assert fits["pane"] <= 0, f"{what}: the holders view scrolls sideways: {fits}"
    if whole_panel:
        assert fits["panel"] <= 0 and fits["output"] <= 0, f"{what}: the panel scrolls sideways: {fits}"
    assert not fits["cut"], f"{what}: buttons cut: {fits['cut']}"


def test_holders_in_jupyterlab(jupyter_server: JupyterServer, browser_page: Page) -> None:
    page = browser_page
    page.set_viewport_size({"width": 1600, "height": 1000})
    jupyter_server.make_notebook("holders.ipynb", [""])
    open_notebook(page, jupyter_server, "holders.ipynb")
    run_cell(page, "%load_ext gpumem")
    run_cell(page, SETUP)
    run_cell(page, "%gpumem monitor")
    page.locator(PANEL).first.wait_for(state="visible")
    # The condition IPython's Out makes stands under the cells with its cell and its button, until released.
    line = _wait_for(lambda: next(iter(_standing(page)), None), 30, "the standing Out condition", page)
    assert re.fullmatch(
        r"IPython holds 3\.8 MiB in Out\[(\d+)\] \(cell \[\1\]\) — Release Out\[\1\]: 3\.8 MiB", line
    ), line
    _release_out_without_typing(page)
    _wait_for(lambda: not _standing(page), 15, "the Out condition to go once released", page)
    _assert_fits(page, "1600 px notebook")
    page.locator(PANEL).first.screenshot(path=str(artifacts_path() / "holders_jupyterlab.png"))
    _action_while_a_cell_runs(page)
    _a_cells_report_in_the_panel(page)
    _oom_in_the_panel(page)
    check = run_cell(
        page, "print('grad', model.weight.grad, 'out', [n for n, v in Out.items() if hasattr(v, 'numel')])"
    )
    wait_for_output(check, "grad None out []")
    # The notebook's column about a sidebar's width (the plot keeps its own minimum width there).
    page.set_viewport_size({"width": 560, "height": 1000})
    page.wait_for_timeout(500)
    _assert_fits(page, "narrow notebook", whole_panel=False)
    page.locator(PANEL).first.screenshot(path=str(artifacts_path() / "holders_narrow.png"))


def test_holders_in_notebook7(notebook_server: JupyterServer, browser_page: Page) -> None:
    page = browser_page
    notebook_server.make_notebook("holders_nb7.ipynb", [""])
    open_notebook(page, notebook_server, "holders_nb7.ipynb")
    run_cell(page, SETUP)
    run_cell(page, "import gpumem\ngpumem.Panel(window='1min')")
    page.locator(PANEL).first.wait_for(state="visible")
    _release_out_without_typing(page, by_keyboard=True)
    page.locator(PANEL).first.screenshot(path=str(artifacts_path() / "holders_notebook7.png"))


# The docked holders view at a width: no sideways scroll, no text cut or past the edges, every button inside.
_SIDEBAR_FITS_JS = """() => {
    const sidebar = document.querySelector('#gpumem-sidebar');
    const pane = sidebar.querySelector('.gm-holders-pane');
    const view = sidebar.getBoundingClientRect();
    const all = [pane, ...pane.querySelectorAll('*')].filter(e => e.getBoundingClientRect().width > 0);
    const name = e => `${e.tagName.toLowerCase()} "${(e.textContent || '').trim().slice(0, 30)}"`;
    const scrollers = all.filter(e => e.scrollWidth > e.clientWidth + 1 &&
        ['auto', 'scroll', 'hidden'].includes(getComputedStyle(e).overflowX)).map(name);
    const outside = all.filter(e => { const r = e.getBoundingClientRect();
        return r.left < view.left - 0.5 || r.right > view.right + 0.5; }).map(name);
    return {width: view.width, scrollers, outside};
}"""


@pytest.mark.usefixtures("labextension")
def test_holders_in_the_sidebar(jupyter_server: JupyterServer, browser_page: Page) -> None:
    page = browser_page
    jupyter_server.make_notebook("holders_sidebar.ipynb", [""])
    open_notebook(page, jupyter_server, "holders_sidebar.ipynb")
    run_cell(page, "%load_ext gpumem")
    run_cell(page, SETUP)
    run_cell(page, "%gpumem sidebar")
    selector = "#gpumem-sidebar .gpumem-panel"
    page.locator(selector).first.wait_for(state="visible")
    _wait_for(lambda: page.locator(f"{selector} .gm-reclaim button", has_text="Release Out[").count(), 30,
              "the docked Release Out button", page)  # fmt: skip
    for width in (250, 350):
        _resize_right_sidebar(page, width)
        page.wait_for_timeout(500)
        fits = page.evaluate(_SIDEBAR_FITS_JS)
        assert abs(fits["width"] - width) < 1 and not fits["scrollers"] and not fits["outside"], fits
        save_screenshot(page, f"holders_sidebar_{width}px")
    page.locator(f"{selector} .gm-reclaim button", has_text="Release Out[").first.click()
    _wait_for(lambda: "as promised" in page.locator(f"{selector} .gm-holders-pane .gm-result").first.inner_text(), 15,
              "the docked release's result", page)  # fmt: skip
