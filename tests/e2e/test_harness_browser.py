"""Smoke tests of the browser harness: a real kernel behind JupyterLab and Notebook 7 in chromium."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from _harness import (
    JupyterServer,
    open_notebook,
    run_cell,
    save_screenshot,
    wait_for_output,
)

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = pytest.mark.browser


def test_jupyterlab_runs_a_cell(
    jupyter_server: JupyterServer, browser_page: Page, request: pytest.FixtureRequest
) -> None:
    jupyter_server.make_notebook("smoke_lab.ipynb", [""])
    open_notebook(browser_page, jupyter_server, "smoke_lab.ipynb")
    cell = run_cell(browser_page, "print(6*7)")
    assert "42" in wait_for_output(cell, "42")
    # A second cell, multi-line, runs in the same kernel.
    cell2 = run_cell(browser_page, "x = 6\nfor i in range(2):\n    x *= 7\nprint('x =', x)")
    wait_for_output(cell2, "x = 294")
    save_screenshot(browser_page, request)


def test_notebook7_runs_a_cell(
    notebook_server: JupyterServer, browser_page: Page, request: pytest.FixtureRequest
) -> None:
    notebook_server.make_notebook("smoke_nb7.ipynb", [""])
    open_notebook(browser_page, notebook_server, "smoke_nb7.ipynb")
    assert "/notebooks/" in browser_page.url
    cell = run_cell(browser_page, "print(6*7)")
    wait_for_output(cell, "42")
    save_screenshot(browser_page, request)
