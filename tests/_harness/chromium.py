"""Playwright on Debian's chromium: the ``browser`` and ``browser_page`` fixtures."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from _harness.artifacts import artifacts_path, safe_name, save_screenshot
from _harness.config import OUTPUT_TIMEOUT

if TYPE_CHECKING:  # pragma: no cover
    from playwright.sync_api import Browser, Page

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--disable-dev-shm-usage",
]



def chromium_path() -> str | None:
    return os.environ.get("GPUMEM_CHROMIUM") or shutil.which("chromium")


# Module scope, not session: Playwright's sync API leaves its asyncio loop marked as running in this
# thread while it is open, which breaks IPython's top-level ``await`` and other asyncio users in
# tests that run later. Closing it at the end of each browser-test module keeps that contained.
@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    exe = chromium_path()
    if exe is None:
        pytest.skip("Debian's chromium is not installed (make test installs it with apt-get)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def browser_page(request: pytest.FixtureRequest, browser: Browser) -> Iterator[Page]:
    """A fresh page in its own browser context (clean storage), 1400x900.

    On failure a screenshot and the browser console go to ``test-artifacts/<test>.png|.console.txt``.
    Kernels the test started on ``jupyter_server`` / ``notebook_server`` are shut down afterwards.
    """
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(OUTPUT_TIMEOUT * 1000)
    page = context.new_page()
    console = capture_console(page)
    try:
        yield page
    finally:
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            name = safe_name(request.node.nodeid)
            with contextlib.suppress(Exception):
                save_screenshot(page, f"{name}.failed")
            with contextlib.suppress(Exception):
                (artifacts_path() / f"{name}.failed.console.txt").write_text("\n".join(console))
        with contextlib.suppress(Exception):
            context.close()
        for fixture in ("jupyter_server", "notebook_server"):
            if fixture in request.fixturenames:
                request.getfixturevalue(fixture).shutdown_kernels()


def capture_console(page: Page) -> list[str]:
    """Collect ``page``'s console lines and uncaught errors (with their stack) from now on; the list."""
    console: list[str] = []
    page.on("console", lambda msg: console.append(f"[{msg.type}] {msg.text}"))
    page.on("pageerror", lambda exc: console.append(f"[pageerror] {exc}\n{getattr(exc, 'stack', '') or ''}"))
    page.gpumem_console = console  # type: ignore[attr-defined]
    return console


def console_messages(page: Page) -> list[str]:
    """Browser console lines collected so far for a ``browser_page``."""
    messages: list[str] = getattr(page, "gpumem_console", [])
    return messages


# Console errors that are provably not gpumem's, each with the proof: a line is left out when it contains
# every string of an entry.
CONSOLE_ERRORS_NOT_OURS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("Cannot read properties of undefined (reading 'schema')", "/static/notebook/notebook_core."),
        ("Notebook 7.6.5's own keyboard-shortcut settings loader throws this on every page load, also with "
        "gpumem's extension disabled (page_config disabledExtensions) on a notebook that never loads gpumem"),
    ),
)


def console_errors(page: Page) -> list[str]:
    """The console errors and uncaught page errors of a ``browser_page`` so far, less the allow-listed ones
    (:data:`CONSOLE_ERRORS_NOT_OURS`)."""
    return [
        line
        for line in console_messages(page)
        if line.startswith(("[error]", "[pageerror]"))
        and not any(all(part in line for part in parts) for parts, _why in CONSOLE_ERRORS_NOT_OURS)
    ]


def assert_no_console_errors(page: Page) -> None:
    """Fail with the lines when the page logged a console error (see :func:`console_errors`)."""
    errors = console_errors(page)
    assert not errors, f"{len(errors)} browser console errors:\n" + "\n".join(errors[:20])
