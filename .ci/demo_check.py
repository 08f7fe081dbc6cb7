"""`GPUMEM_DEMO_CHECK=1 make demo`: start the demo server as `make demo` does, prove the notebook opens, stop.

Usage (the Makefile's demo target calls it): demo_check.py NOTEBOOK -- SERVER COMMAND...

The server command runs unchanged except for $BROWSER, which points back at this script: the URL
JupyterLab hands to "the browser" is recorded instead of opened. Then:
  1. the server answers (/api/status) and serves the notebook (/api/contents: a notebook, as many cells
     as the file has);
  2. when Debian's chromium is installed, headless chromium (Playwright) loads exactly the URL a
     user's browser gets, and the check waits until the notebook's first cell is rendered with the
     file's own first line and the notebook's kernel is idle. Without chromium (or Playwright) step 1 is
     the whole check, and the script says so.
The server (and its kernels) are stopped, and the exit status is 0, or 1 with the server log's tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

TIMEOUT_S = float(os.environ.get("GPUMEM_DEMO_CHECK_TIMEOUT", "240"))
CHROMIUM = os.environ.get("GPUMEM_CHROMIUM", "/usr/bin/chromium")  # Debian's, as the browser tests use
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
]
LOG_TAIL_LINES = 40
KERNEL_STATES_JS = """() => [...document.querySelectorAll('.jp-Notebook-ExecutionIndicator')]
    .map(e => e.getAttribute('data-status'))"""


class CheckFailedError(Exception):
    """The demo did not open: the message says what was seen."""


def record_url(target: str, url: str) -> int:
    """The $BROWSER side: keep the URL the server asked a browser to open (written whole, then renamed)."""
    tmp = Path(target + ".tmp")
    tmp.write_text(url, encoding="utf-8")
    tmp.replace(target)
    return 0


def wait_for_browser_url(server: subprocess.Popen[bytes], url_file: Path, deadline: float) -> str:
    while time.monotonic() < deadline:
        if url_file.exists():
            return url_file.read_text(encoding="utf-8").strip()
        if server.poll() is not None:
            raise CheckFailedError(f"the server exited with status {server.returncode} before opening a browser")
        time.sleep(0.2)
    raise CheckFailedError(f"the server did not ask for a browser within {TIMEOUT_S:.0f} s")


def http_url(browser_url: str) -> str:
    """The http URL behind what the server gives the browser (a local redirect file, or the URL itself)."""
    if not browser_url.startswith("file:"):
        return browser_url
    page = Path(urllib.request.url2pathname(urllib.parse.urlparse(browser_url).path)).read_text(encoding="utf-8")
    found = re.search(r'<a href="([^"]+)"', page)
    if found is None:
        raise CheckFailedError(f"no link in the server's browser-open file {browser_url}")
    return found.group(1).replace("&amp;", "&")


def get_json(url: str, token: str) -> object:
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read().decode("utf-8"))


def check_rest(url: str, notebook: Path) -> str:
    """The server answers and serves the notebook the URL names; returns a selector for its first line."""
    parts = urllib.parse.urlsplit(url)
    token = urllib.parse.parse_qs(parts.query).get("token", [""])[0]
    name = urllib.parse.unquote(parts.path.rsplit("/", 1)[-1])
    if not parts.path.endswith("/lab/tree/" + urllib.parse.quote(notebook.name)):
        raise CheckFailedError(f"the browser would open {parts.path}, not the demo notebook {notebook.name}")
    base = f"{parts.scheme}://{parts.netloc}{parts.path.split('/lab/tree/')[0]}"
    get_json(f"{base}/api/status", token)
    model = get_json(f"{base}/api/contents/{urllib.parse.quote(name)}?content=1", token)
    expected = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    if not isinstance(model, dict) or model.get("type") != "notebook":
        raise CheckFailedError(f"/api/contents/{name} is not a notebook")
    cells = model["content"]["cells"]
    if len(cells) != len(expected):
        raise CheckFailedError(f"the server's {name} has {len(cells)} cells, the file {len(expected)}")
    return first_cell_locator(expected[0]) if expected else ""


def first_cell_locator(cell: dict[str, object]) -> str:
    """A Playwright selector, inside the first cell, for its first line as JupyterLab shows it."""
    source = cell["source"]
    text = "".join(source) if isinstance(source, list) else str(source)
    lines = text.strip().splitlines()
    if not lines:
        return ""
    if cell["cell_type"] == "markdown":  # rendered: a heading's '#' is gone
        return f".jp-RenderedMarkdown >> text={json.dumps(lines[0].lstrip('#').strip())}"
    return f".jp-InputArea-editor >> text={json.dumps(lines[0].strip())}"


def check_browser(browser_url: str, first_line: str, deadline: float) -> str:
    """Chromium loads what the user's browser would; the notebook renders and its kernel goes idle."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))

            def left_ms() -> float:
                return max(1000.0, (deadline - time.monotonic()) * 1000)

            page.goto(browser_url, timeout=left_ms())
            panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)").first
            first = panel.locator(".jp-Notebook .jp-Cell").first
            step = "the notebook's first cell"
            try:
                first.wait_for(state="visible", timeout=left_ms())
                if first_line:
                    step = f"the first cell's first line ({first_line})"
                    first.locator(first_line).first.wait_for(state="visible", timeout=left_ms())
                # The kernel indicator (JupyterLab: in the status bar) of the current notebook.
                step = "an idle kernel"
                page.locator('.jp-Notebook-ExecutionIndicator[data-status="idle"]').first.wait_for(
                    state="attached", timeout=left_ms()
                )
            except Exception as exc:
                shown = page.locator("body").inner_text(timeout=5000)[:600]
                kernel = page.evaluate(KERNEL_STATES_JS)
                raise CheckFailedError(
                    f"chromium at {page.url.split('?')[0]} never showed {step} "
                    f"({type(exc).__name__}); kernel indicators: {kernel}; the page shows: {shown!r}; "
                    f"page errors: {errors}"
                ) from None
            return page.url.split("?")[0]
        finally:
            browser.close()


def browser_available() -> str | None:
    """None when the browser check can run, else why not."""
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is not installed"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed"
    return None


def stop(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the server shuts its kernels down), then whatever is left of its process group."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def log_tail(log: Path) -> str:
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join(lines[-LOG_TAIL_LINES:])


def run_check(notebook: Path, command: Sequence[str]) -> int:
    started = time.monotonic()
    deadline = started + TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="gpumem-demo-check-") as tmp:
        url_file = Path(tmp) / "browser-url"
        log = Path(tmp) / "server.log"
        env = dict(os.environ)
        env["BROWSER"] = " ".join(shlex.quote(p) for p in (sys.executable, __file__, "--record", str(url_file))) + " %s"
        print(f"==> GPUMEM_DEMO_CHECK: starting the server, checking that {notebook.name} opens, then stopping it")
        with log.open("wb") as out:
            server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            browser_url = wait_for_browser_url(server, url_file, deadline)
            url = http_url(browser_url)
            first_line = check_rest(url, notebook)
            why_not = browser_available()
            if why_not is None:
                opened = check_browser(browser_url, first_line, deadline)
                how = f"chromium rendered {opened} and its kernel is idle"
            else:
                how = f"the server serves it (REST API only: {why_not})"
        except Exception as exc:
            stop(server)
            reason = str(exc) if isinstance(exc, CheckFailedError) else f"{type(exc).__name__}: {exc}"
            print(f"demo check FAILED: {reason}\n--- server log (last {LOG_TAIL_LINES} lines) ---\n{log_tail(log)}")
            return 1
        stop(server)
    print(f"==> demo check passed in {time.monotonic() - started:.1f} s: {how}")
    return 0


def main(argv: Sequence[str]) -> int:
    if len(argv) == 3 and argv[0] == "--record":  # noqa: PLR2004 - --record FILE URL
        return record_url(argv[1], argv[2])
    if len(argv) < 3 or argv[1] != "--":  # noqa: PLR2004 - NOTEBOOK -- COMMAND
        print(__doc__, file=sys.stderr)
        return 2
    return run_check(Path(argv[0]).resolve(), argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
