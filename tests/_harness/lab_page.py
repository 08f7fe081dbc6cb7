"""Driving a JupyterLab / Notebook 7 page: open a notebook, type and run cells, wait for outputs."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _harness.config import KERNEL_TIMEOUT, OUTPUT_TIMEOUT
from _harness.servers import JupyterServer

if TYPE_CHECKING:  # pragma: no cover
    from playwright.sync_api import Locator, Page


NOTEBOOK = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook"


def notebook_panel(page: Page) -> Locator:
    """The visible notebook (JupyterLab's current tab, or Notebook 7's only notebook)."""
    return page.locator(NOTEBOOK).first


def cells(page: Page) -> Locator:
    return notebook_panel(page).locator(".jp-Cell")


def open_notebook(
    page: Page, server: JupyterServer, path: str, *, app: str | None = None, timeout: float = KERNEL_TIMEOUT
) -> Locator:
    """Open notebook ``path`` (relative to the server root), wait for its kernel to be idle.

    Returns the notebook locator. ``app`` is ``"lab"`` or ``"notebook"`` (default: the server's app;
    a lab server also serves Notebook 7's ``/notebooks/`` pages when both are installed).
    """
    page.goto(server.notebook_url(path, app=app), wait_until="domcontentloaded", timeout=timeout * 1000)
    nb = notebook_panel(page)
    nb.wait_for(state="visible", timeout=timeout * 1000)
    wait_for_kernel_idle(page, timeout=timeout)
    return nb


_KERNEL_STATE_JS = """() => {
    const app = window.jupyterapp;
    const widget = app && app.shell && app.shell.currentWidget;
    const ctx = widget && widget.sessionContext;
    if (ctx) {
        const kernel = ctx.session && ctx.session.kernel;
        if (!kernel) { return ctx.isReady ? 'no kernel' : 'starting'; }
        return kernel.connectionStatus === 'connected' ? kernel.status : kernel.connectionStatus;
    }
    if (app) { return null; }
    // Without window.jupyterapp (a server not started by the harness): the toolbar's indicator.
    const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)') || document;
    const el = panel.querySelector('.jp-Notebook-ExecutionIndicator[data-status]');
    return el ? el.getAttribute('data-status') : null;
}"""


def kernel_status(page: Page) -> str | None:
    """The current notebook's kernel status as the front end sees it.

    ``idle``/``busy``/``starting``/``restarting``/... when connected, else the connection status
    (``connecting``, ``disconnected``); ``None`` when no notebook is current.
    """
    status: str | None = page.evaluate(_KERNEL_STATE_JS)
    return status


def wait_for_kernel_idle(page: Page, timeout: float = KERNEL_TIMEOUT) -> None:
    """Wait until the current notebook's kernel is started, connected and idle."""
    try:
        page.wait_for_function(f"() => ({_KERNEL_STATE_JS})() === 'idle'", timeout=timeout * 1000, polling=200)
    except Exception as exc:
        raise AssertionError(f"kernel not idle after {timeout}s (status: {kernel_status(page)!r})") from exc


def _editor(cell: Locator) -> Locator:
    return cell.locator(".jp-InputArea-editor .cm-content").first


def run_cell(
    page: Page, code: str, *, index: int | None = None, wait: bool = True, timeout: float = OUTPUT_TIMEOUT
) -> Locator:
    """Type ``code`` into a code cell and run it with Shift+Enter; return that cell's locator.

    ``index=None`` uses the last cell (a fresh notebook has one empty cell; after Shift+Enter on
    the last cell JupyterLab appends a new one, so calling this repeatedly runs cells in sequence).
    The cell's previous source is replaced. With ``wait`` it returns once the cell has finished
    (its prompt shows a number). Single-line code is typed key by key; multi-line code is
    inserted as text so the editor's auto-indent does not re-indent it.
    """
    all_cells = cells(page)
    if index is None:
        all_cells.first.wait_for(state="attached")
        index = all_cells.count() - 1
    # A fixed index: `.last` would move to the cell that Shift+Enter appends.
    cell = all_cells.nth(index)
    cell.scroll_into_view_if_needed()
    editor = _editor(cell)
    editor.click()
    page.keyboard.press("ControlOrMeta+a")
    page.keyboard.press("Backspace")
    if "\n" in code:
        page.keyboard.insert_text(code)
    else:
        page.keyboard.type(code)
    page.keyboard.press("Shift+Enter")
    if wait:
        wait_for_cell_done(cell, timeout=timeout)
    return cell


def wait_for_cell_done(cell: Locator, timeout: float = OUTPUT_TIMEOUT) -> None:
    """Wait until the cell's input prompt shows an execution count (``[3]:``), not ``[*]:``."""
    prompt = cell.locator(".jp-InputPrompt").first
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = prompt.inner_text(timeout=timeout * 1000)
        if re.search(r"\[\s*\d+\s*\]", text):
            return
        time.sleep(0.1)
    raise AssertionError(f"cell did not finish within {timeout}s (prompt {text!r})")


def cell_outputs_text(cell: Locator) -> str:
    """Visible text of all the outputs of ``cell``."""
    outputs = cell.locator(".jp-OutputArea-output")
    return "\n".join(outputs.all_inner_texts())


def wait_for_output(cell_or_page: Locator | Page, text: str | re.Pattern[str], timeout: float = OUTPUT_TIMEOUT) -> str:
    """Wait until an output (of a cell locator, or anywhere in the page's notebook) contains ``text``.

    ``text`` is a substring or a compiled regex. Returns the matching outputs' text.
    """
    scope: Any = cell_or_page
    if not hasattr(scope, "locator") or not hasattr(scope, "all_inner_texts"):
        scope = notebook_panel(scope)  # a Page
    outputs = scope.locator(".jp-OutputArea-output")
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        seen = "\n".join(outputs.all_inner_texts())
        if text.search(seen) if isinstance(text, re.Pattern) else text in seen:
            return seen
        time.sleep(0.2)
    raise AssertionError(f"no output containing {text!r} within {timeout}s; outputs were:\n{seen[-2000:]}")


def wait_for_text(target: Locator, text: str | re.Pattern[str], timeout: float = OUTPUT_TIMEOUT) -> str:
    """Wait until the first element of ``target`` contains ``text`` (a substring or a regex); its text."""
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        if target.count():
            seen = str(target.first.inner_text())
            if text.search(seen) if isinstance(text, re.Pattern) else text in seen:
                return seen
        time.sleep(0.2)
    raise AssertionError(f"no text containing {text!r} within {timeout}s; the element said: {seen[-2000:]!r}")


def readme_screenshot(target: Locator, name: str, *, down_to: Locator | None = None) -> Path | None:
    """Save ``target`` (an element) as ``$GPUMEM_SCREENSHOTS/<name>.png`` for the README; None when unset.

    ``down_to`` (an element inside ``target``) ends the picture a little under that element, so a tall
    sidebar's empty bottom is left out. Only ``make screenshots`` sets the variable, so an ordinary
    test run never rewrites the tracked pictures.
    """
    folder = os.environ.get("GPUMEM_SCREENSHOTS")
    if not folder:
        return None
    path = Path(folder) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    target.scroll_into_view_if_needed()
    box, end = target.bounding_box(), down_to.bounding_box() if down_to is not None else None
    if box is None or end is None:
        target.screenshot(path=str(path), animations="disabled", caret="hide")
        return path
    height = min(box["height"], end["y"] + end["height"] + 8 - box["y"])
    target.page.screenshot(path=str(path), animations="disabled", caret="hide", clip={**box, "height": height})
    return path


class KernelFrames:
    """What the page receives on its kernel websockets: each frame's arrival time, size and kind."""

    def __init__(self, page: Page) -> None:
        self.frames: list[tuple[float, int, bool, bool]] = []  # (monotonic, bytes, a comm_msg, a state update)
        page.on("websocket", self._attach)

    def _attach(self, ws: Any) -> None:
        if "/api/kernels/" in ws.url:
            ws.on("framereceived", self._frame)

    def _frame(self, payload: str | bytes) -> None:
        data = payload.encode() if isinstance(payload, str) else payload
        comm = b'"comm_msg"' in data
        self.frames.append((time.monotonic(), len(data), comm, comm and b'"update"' in data))

    def bytes_between(self, start: float, end: float, *, comm: bool = False, update: bool = False) -> int:
        """Bytes received from ``start`` to ``end`` (monotonic s): all, or only comm messages / widget updates."""
        return sum(
            size
            for at, size, is_comm, is_update in self.frames
            if start <= at <= end and (is_comm or not comm) and (is_update or not update)
        )
