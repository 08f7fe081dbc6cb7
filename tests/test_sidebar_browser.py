"""The front-end extension (js/) in a real JupyterLab 4 and Notebook 7, driven in Debian's chromium.

Covers: the sidebar docks a live widget and follows its updates, closes and reopens, shows a clear
message (not a dead view) after a kernel restart, reconnects when run again, names the right notebook
with two open, and the status bar shows the active kernel's memory. Plus packaging: the extension is
listed by ``jupyter labextension list`` and shipped in the wheel.

The labextension is taken from the environment when gpumem is pip-installed (``make test`` does an
editable install, which builds it); otherwise ``src/gpumem/labextension`` is built with npm if needed
and linked into the test's Jupyter data directory, as ``jupyter labextension develop`` would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from _harness import (
    REPO_ROOT,
    JupyterEnv,
    JupyterServer,
    open_notebook,
    run_cell,
    save_screenshot,
    wait_for_kernel_idle,
    wait_for_output,
)

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

pytestmark = pytest.mark.browser

JS_DIR = REPO_ROOT / "js"
BUILT = REPO_ROOT / "src" / "gpumem" / "labextension"
SIDEBAR = "#gpumem-sidebar"
STATUS_ITEM = ".gpumem-StatusItem"
NOTE = "GPU memory panel docked in the right sidebar"

# A widget that changes by itself: a Label ticking from a thread, docked through the public helper.
TICKER_CELL = """\
import threading, time
import ipywidgets as widgets
from gpumem import _frontend
_frontend.register_status_target()
ticker = widgets.Label('{name} 0')
def _tick(label=ticker):
    i = 0
    while True:
        i += 1
        label.value = f'{name} {{i}}'
        time.sleep(0.25)
threading.Thread(target=_tick, daemon=True).start()
_frontend.set_sidebar_factory(lambda: ticker)
_frontend.show_sidebar(ticker)
"""


def _installed_labextension() -> Path | None:
    """The labextension installed in this environment's data files (pip install / -e)."""
    path = Path(sysconfig.get_path("data")) / "share" / "jupyter" / "labextensions" / "gpumem"
    return path if (path / "package.json").is_file() else None


def _build_labextension() -> None:
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("the labextension is not built and npm is not available to build it")
    if not (JS_DIR / "node_modules").is_dir():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=JS_DIR, check=True, timeout=600)
    subprocess.run([npm, "run", "build"], cwd=JS_DIR, check=True, timeout=600)


@pytest.fixture(scope="session")
def labextension(jupyter_env: JupyterEnv) -> Path:
    """Make sure the servers of this session load the gpumem labextension; return its directory."""
    installed = _installed_labextension()
    if installed is not None:
        return installed
    if not (BUILT / "package.json").is_file():
        _build_labextension()
    link = jupyter_env.data_dir / "labextensions" / "gpumem"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(BUILT, target_is_directory=True)
    return link


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def sidebar(page: Page) -> Locator:
    return page.locator(SIDEBAR)


def sidebar_label_text(page: Page) -> str:
    label = sidebar(page).locator(".widget-label")
    label.first.wait_for(state="visible")
    return label.first.inner_text()


def wait_label_changes(page: Page, prefix: str, timeout: float = 30) -> tuple[str, str]:
    """The docked Label shows ``prefix N`` and N changes: the view is live."""
    first = sidebar_label_text(page)
    assert first.startswith(prefix), first
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = sidebar_label_text(page)
        if now != first:
            assert now.startswith(prefix), now
            return first, now
        time.sleep(0.2)
    raise AssertionError(f"the docked widget did not update in {timeout}s (stuck at {first!r})")


def wait_sidebar_text(page: Page, text: str | re.Pattern[str], timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        loc = sidebar(page)
        seen = loc.inner_text() if loc.count() else ""
        if text.search(seen) if isinstance(text, re.Pattern) else text in seen:
            return seen
        time.sleep(0.2)
    raise AssertionError(f"sidebar never showed {text!r}; it shows {seen!r}")


def wait_status_text(page: Page, pattern: re.Pattern[str], timeout: float = 30) -> str:
    item = page.locator(STATUS_ITEM)
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        seen = item.inner_text() if item.count() and item.first.is_visible() else ""
        if pattern.search(seen):
            return seen
        time.sleep(0.2)
    raise AssertionError(f"status bar item never matched {pattern.pattern!r}; it shows {seen!r}")


def run_palette_command(page: Page, label: str) -> None:
    """Run a command through the command palette UI."""
    page.keyboard.press("Control+Shift+C")
    search = page.locator(".lm-CommandPalette-input").first
    search.wait_for(state="visible")
    search.fill(label)
    page.locator(".lm-CommandPalette-item", has_text=label).first.click()


def restart_kernel(page: Page) -> None:
    """Restart through the menu (Kernel > Restart Kernel…) and accept the dialog."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Kernel$")).first.click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Restart Kernel…?$")).first.click()
    dialog = page.locator(".jp-Dialog")
    dialog.locator("button.jp-mod-accept").first.click()
    dialog.wait_for(state="detached")


def open_second_notebook(page: Page, path: str) -> None:
    page.evaluate("path => window.jupyterapp.commands.execute('docmanager:open', {path})", path)
    page.locator(".lm-TabBar-tab.lm-mod-current", has_text=path).first.wait_for()
    wait_for_kernel_idle(page)


# --------------------------------------------------------------------------------------------
# Packaging
# --------------------------------------------------------------------------------------------


def test_labextension_list_shows_gpumem_enabled() -> None:
    if _installed_labextension() is None:
        pytest.skip("gpumem is not pip-installed in this environment (make test installs it)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
    proc = subprocess.run(
        [sys.executable, "-m", "jupyter", "labextension", "list"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    line = next((ln for ln in out.splitlines() if re.match(r"\s*gpumem\b", ln)), None)
    assert line is not None, out
    assert "enabled" in line and "OK" in line, line


def test_wheel_ships_the_labextension(tmp_path: Path) -> None:
    """``pip wheel`` puts the prebuilt extension and install.json in the wheel's data files."""
    src = tmp_path / "src-tree"
    src.mkdir()
    for name in ("pyproject.toml", "LICENSE", "README.md", ".gitignore"):
        if (REPO_ROOT / name).exists():
            shutil.copy2(REPO_ROOT / name, src / name)
    if not (src / "README.md").exists():
        (src / "README.md").write_text("# gpumem\n")
    shutil.copytree(REPO_ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(JS_DIR, src / "js", ignore=shutil.ignore_patterns("node_modules", "lib", "*.tsbuildinfo"))
    if not (src / "src" / "gpumem" / "labextension" / "package.json").is_file():
        pytest.skip("src/gpumem/labextension is not built (a fresh build runs npm; make test builds it)")
    dist = tmp_path / "dist"
    # No build isolation: the dev environment has hatchling and hatch-jupyter-builder, and the
    # prebuilt extension is reused (skip-if-exists), so this stays quick.
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-w", str(dist)],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = dist.glob("gpumem-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    prefix = next(n.split("/data/")[0] for n in names if ".data/data/" in n) + "/data/"
    ext = prefix + "share/jupyter/labextensions/gpumem/"
    assert ext + "package.json" in names
    assert ext + "install.json" in names
    static = [n for n in names if n.startswith(ext + "static/") and n.endswith(".js")]
    assert any("remoteEntry." in n for n in static), static
    meta = json.loads(zipfile.ZipFile(wheel).read(ext + "package.json"))
    assert meta["name"] == "gpumem"
    assert meta["jupyterlab"]["_build"]["load"].startswith("static/remoteEntry.")
    install = json.loads(zipfile.ZipFile(wheel).read(ext + "install.json"))
    assert install["packageName"] == "gpumem"


# --------------------------------------------------------------------------------------------
# JupyterLab 4
# --------------------------------------------------------------------------------------------


def test_lab_sidebar_lifecycle(
    labextension: Path, jupyter_server: JupyterServer, browser_page: Page, request: pytest.FixtureRequest
) -> None:
    page = browser_page
    jupyter_server.make_notebook("train.ipynb", [""])
    jupyter_server.make_notebook("other.ipynb", [""])
    open_notebook(page, jupyter_server, "train.ipynb")

    # Dock: a note in the cell, the live widget in the sidebar, titled after the notebook.
    cell = run_cell(page, TICKER_CELL.format(name="train"))
    wait_for_output(cell, NOTE)
    sidebar(page).wait_for(state="visible")
    wait_sidebar_text(page, "GPU memory · train.ipynb")
    wait_label_changes(page, "train")
    assert cell.locator(".widget-label").count() == 0, "the panel must not also render inline"
    save_screenshot(page, f"{request.node.name}.docked")

    # Status bar: this kernel's figures (no GPU in CI: host RSS).
    status = wait_status_text(page, re.compile(r"^(RAM [\d.]+ [MG]iB \(no GPU in use\)|GPU [\d.]+ / [\d.]+ GiB)"))
    assert status

    # Close with the sidebar's own button, reopen from the command palette: the view is live again.
    sidebar(page).locator(".gpumem-Sidebar-close").click()
    sidebar(page).wait_for(state="detached")
    run_palette_command(page, "GPU memory: show sidebar")
    sidebar(page).wait_for(state="visible")
    wait_label_changes(page, "train")

    # Close again and reopen from the status-bar item.
    sidebar(page).locator(".gpumem-Sidebar-close").click()
    sidebar(page).wait_for(state="detached")
    page.locator(STATUS_ITEM).click()
    sidebar(page).wait_for(state="visible")
    wait_label_changes(page, "train")

    # Restart: a clear message instead of a dead widget, and the status item goes away.
    restart_kernel(page)
    wait_sidebar_text(page, "The kernel of train.ipynb restarted; run %gpumem sidebar again to reconnect")
    assert sidebar(page).locator(".widget-label").count() == 0
    page.locator(STATUS_ITEM).wait_for(state="hidden")
    save_screenshot(page, f"{request.node.name}.restarted")
    wait_for_kernel_idle(page)

    # Run again: reconnects.
    cell = run_cell(page, TICKER_CELL.format(name="train"), index=0)
    wait_for_output(cell, NOTE)
    wait_label_changes(page, "train")
    assert "restarted" not in sidebar(page).inner_text()

    # A second notebook: its panel takes the sidebar, and the title names it.
    open_second_notebook(page, "other.ipynb")
    cell2 = run_cell(page, TICKER_CELL.format(name="other"))
    wait_for_output(cell2, NOTE)
    wait_sidebar_text(page, "GPU memory · other.ipynb")
    wait_label_changes(page, "other")
    tab = page.locator(f'.lm-TabBar-tab[data-id="{SIDEBAR[1:]}"]')
    assert tab.get_attribute("title") == "GPU memory · other.ipynb"
    save_screenshot(page, f"{request.node.name}.other")

    # Back to train.ipynb: its status item click asks its kernel for a panel (sidebar factory).
    page.locator(".lm-TabBar-tab", has_text="train.ipynb").first.click()
    wait_status_text(page, re.compile(r"RAM|GPU"))
    page.locator(STATUS_ITEM).click()
    wait_sidebar_text(page, "GPU memory · train.ipynb")
    wait_label_changes(page, "train")
    save_screenshot(page, f"{request.node.name}.back")


def test_lab_restored_output_does_not_dock_a_dead_widget(
    labextension: Path, jupyter_server: JupyterServer, browser_page: Page
) -> None:
    """A saved ``%gpumem sidebar`` output of an earlier kernel only offers a button."""
    page = browser_page
    bundle = {
        "application/vnd.gpumem.sidebar+json": {"model_id": "0123456789abcdef"},
        "application/vnd.jupyter.widget-view+json": {
            "model_id": "0123456789abcdef",
            "version_major": 2,
            "version_minor": 0,
        },
        "text/plain": "GPU memory panel (inline fallback)",
    }
    cell = {
        "cell_type": "code",
        "source": "%gpumem sidebar",
        "outputs": [{"output_type": "display_data", "data": bundle, "metadata": {}}],
    }
    path = jupyter_server.make_notebook("restored.ipynb", [])
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    nb.cells.append(nbformat.from_dict({**cell, "metadata": {}, "execution_count": 1}))
    nbformat.write(nb, str(path))
    # Trusted, as if the user ran it here before (an untrusted output falls back to text/plain).
    subprocess.run(
        [sys.executable, "-m", "jupyter", "trust", str(path)],
        env=jupyter_server.env.env,
        check=True,
        capture_output=True,
        timeout=60,
    )
    open_notebook(page, jupyter_server, "restored.ipynb")
    note = page.locator(".gpumem-SidebarNote")
    note.wait_for(state="visible")
    assert "earlier run" in note.inner_text()
    page.wait_for_timeout(1000)
    assert sidebar(page).count() == 0


# --------------------------------------------------------------------------------------------
# Notebook 7
# --------------------------------------------------------------------------------------------


def test_notebook7_sidebar(
    labextension: Path, notebook_server: JupyterServer, browser_page: Page, request: pytest.FixtureRequest
) -> None:
    page = browser_page
    notebook_server.make_notebook("nb7.ipynb", [""])
    open_notebook(page, notebook_server, "nb7.ipynb")
    cell = run_cell(page, TICKER_CELL.format(name="nb7"))
    wait_for_output(cell, NOTE)
    sidebar(page).wait_for(state="visible")
    wait_sidebar_text(page, "GPU memory · nb7.ipynb")
    wait_label_changes(page, "nb7")
    save_screenshot(page, f"{request.node.name}.docked")

    sidebar(page).locator(".gpumem-Sidebar-close").click()
    sidebar(page).wait_for(state="detached")
    # The note's button reopens it.
    cell.locator(".gpumem-SidebarNote-button").click()
    sidebar(page).wait_for(state="visible")
    wait_label_changes(page, "nb7")

    restart_kernel(page)
    wait_sidebar_text(page, "The kernel of nb7.ipynb restarted; run %gpumem sidebar again to reconnect")
    assert sidebar(page).locator(".widget-label").count() == 0
    save_screenshot(page, f"{request.node.name}.restarted")
    wait_for_kernel_idle(page)
    cell = run_cell(page, TICKER_CELL.format(name="nb7"), index=0)
    wait_for_output(cell, NOTE)
    wait_label_changes(page, "nb7")
