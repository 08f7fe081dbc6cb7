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

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

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
    wait_for_text,
)
from _harness.lab_page import readme_screenshot

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

browser = pytest.mark.browser

JS_DIR = REPO_ROOT / "js"
BUILT = REPO_ROOT / "src" / "gpumem" / "labextension"
SIDEBAR = "#gpumem-sidebar"
STATUS_ITEM = ".gpumem-StatusItem"
NOTE = "GPU memory panel docked in the right sidebar"

# A widget that changes by itself: a Label ticking from a thread, docked through the public helper.
TICKER_CELL = """\
import threading, time
import ipywidgets as widgets
from gpumem.panel import frontend as _frontend
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


def _newest_mtime(*roots: Path) -> float:
    return max(
        (p.stat().st_mtime for root in roots if root.exists() for p in root.rglob("*") if p.is_file()), default=0.0
    )


def _build_is_stale() -> bool:
    if not (BUILT / "package.json").is_file():
        return True
    sources = _newest_mtime(JS_DIR / "src", JS_DIR / "style")
    return sources > _newest_mtime(BUILT)


def _build_labextension() -> None:
    npm = shutil.which("npm")
    if npm is None:
        if (BUILT / "package.json").is_file():
            return  # stale maybe, but usable
        pytest.skip("the labextension is not built and npm is not available to build it")
    if not (JS_DIR / "node_modules").is_dir():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=JS_DIR, check=True, timeout=600)
    subprocess.run([npm, "run", "build"], cwd=JS_DIR, check=True, timeout=600)


@pytest.fixture(scope="session")
def labextension(jupyter_env: JupyterEnv) -> Path:
    """Make the servers of this session load the labextension built from this checkout.

    It is linked into the test's Jupyter data directory, which comes first in the labextension
    search path, so an older copy installed in the environment (an editable install copies the
    files) cannot shadow what is being tested. Built with npm first when missing or older than js/.
    """
    if _build_is_stale():
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
# Kernel side (gpumem.panel.frontend) with fake comms: fast, no browser
# --------------------------------------------------------------------------------------------


class FakeComm:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.sent: list[dict[str, Any]] = []
        self.closed = False
        self._on_msg: Any = None
        self._on_close: Any = None

    def send(self, data: dict[str, Any]) -> None:
        if self.closed:
            raise RuntimeError("closed")
        self.sent.append(data)

    def on_msg(self, callback: Any) -> None:
        self._on_msg = callback

    def on_close(self, callback: Any) -> None:
        self._on_close = callback

    def close(self) -> None:
        self.closed = True

    # What the kernel's comm manager does on messages from the front end (``page``: its session id).
    def receive(self, data: dict[str, Any], page: str = "page") -> None:
        self._on_msg({"header": {"session": page}, "content": {"data": data}})

    def receive_close(self) -> None:
        self.closed = True
        self._on_close({"content": {"data": {}}})


class FakeManager:
    def __init__(self) -> None:
        self.targets: dict[str, Any] = {}

    def register_target(self, name: str, handler: Any) -> None:
        self.targets[name] = handler

    def unregister_target(self, name: str, handler: Any) -> None:
        assert self.targets.pop(name) is handler

    def open_from_frontend(self, data: dict[str, Any] | None = None, page: str = "page") -> FakeComm:
        comm = FakeComm()
        message = {"header": {"session": page}, "content": {"data": data or {"request": "snapshot"}}}
        self.targets["gpumem.status"](comm, message)
        return comm


class FakeShell:
    def __init__(self) -> None:
        self.kernel = SimpleNamespace(comm_manager=FakeManager())


@pytest.fixture
def frontend(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from gpumem.panel import frontend as _frontend
    from gpumem.panel import writer

    announced: list[FakeComm] = []

    def create_comm(**kwargs: Any) -> FakeComm:
        comm = FakeComm(**kwargs)
        announced.append(comm)
        return comm

    import comm as comm_module

    monkeypatch.setattr(comm_module, "create_comm", create_comm)
    monkeypatch.setattr(_frontend, "PUBLISH_INTERVAL_S", 0.05)
    monkeypatch.setattr(writer, "_docked", None)  # no panel docked by an earlier test
    _frontend.announced = announced  # type: ignore[attr-defined]
    try:
        yield _frontend
    finally:
        _frontend.unregister_status_target()
        _frontend.set_sidebar_factory(None)
        del _frontend.announced  # type: ignore[attr-defined]


def test_sidebar_bundle_shape() -> None:
    from gpumem.panel.frontend import INLINE_NOTE, sidebar_bundle

    bundle = sidebar_bundle("abc", "wrap")
    assert bundle["application/vnd.gpumem.sidebar+json"] == {"model_id": "abc"}
    assert bundle["application/vnd.jupyter.widget-view+json"] == {
        "model_id": "wrap",
        "version_major": 2,
        "version_minor": 0,
    }
    assert bundle["text/plain"] == INLINE_NOTE
    assert "not present" in INLINE_NOTE


def test_show_sidebar_displays_one_output(ip: Any) -> None:
    import ipywidgets
    from IPython.utils.capture import capture_output

    from gpumem.panel import frontend as _frontend
    from gpumem.panel.frontend import show_sidebar

    panel = ipywidgets.Label("panel")
    with capture_output() as captured:
        show_sidebar(panel)
        first = _frontend._inline_wrappers[panel.model_id]
        show_sidebar(panel, note="why it is inline")
    assert len(captured.outputs) == 2
    data = captured.outputs[-1].data
    assert data["application/vnd.gpumem.sidebar+json"] == {"model_id": panel.model_id}
    wrapper = _frontend._inline_wrappers[panel.model_id]
    assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == wrapper.model_id
    assert wrapper.children[1] is panel and "why it is inline" in wrapper.children[0].value
    # The first inline wrapper was closed, the panel was not.
    assert first.comm is None and first is not wrapper
    assert panel.comm is not None
    with pytest.raises(TypeError):
        show_sidebar(object())
    # While it is open, the status payload names the docked panel: a page that opens later (a new window)
    # docks it again; once it is closed, no more.
    assert _frontend._build_payload()["docked_model_id"] == panel.model_id
    panel.close()
    assert "docked_model_id" not in _frontend._build_payload()


def test_status_target_without_kernel_does_nothing(frontend: Any) -> None:
    assert frontend.register_status_target(SimpleNamespace()) is False
    assert frontend.publish_status({"devices": [], "host": {}, "cuda_in_use": False}) == 0


def test_status_comm_protocol(frontend: Any) -> None:
    shell = FakeShell()
    manager = shell.kernel.comm_manager
    assert frontend.register_status_target(shell) is True
    assert "gpumem.status" in manager.targets

    # The announce comm carries a payload and is not published to until the front end speaks.
    (announce,) = frontend.announced
    assert announce.kwargs["target_name"] == "gpumem.status"
    assert set(announce.kwargs["data"]) == {"devices", "host", "cuda_in_use"}
    payload = {"devices": [], "host": {"rss_bytes": 1}, "cuda_in_use": False}
    assert frontend.publish_status(payload) == 0

    # A front-end-opened comm gets a snapshot at once and then every published payload.
    comm = manager.open_from_frontend()
    assert comm.sent and comm.sent[0]["cuda_in_use"] is False
    assert isinstance(comm.sent[0]["host"]["rss_bytes"], int)
    assert frontend.publish_status(payload) == 1
    assert comm.sent[-1] == payload
    announce.receive({"request": "snapshot"})
    assert frontend.open_status_comms() == 2
    assert frontend.publish_status(payload) == 2

    # Sidebar requests: an error without a factory, the widget's model id with one.
    comm.receive({"request": "sidebar"})
    assert "sidebar_error" in comm.sent[-1]
    frontend.set_sidebar_factory(lambda: SimpleNamespace(model_id="m1"))
    comm.receive({"request": "sidebar"})
    assert comm.sent[-1] == {"sidebar_model_id": "m1"}
    frontend.set_sidebar_factory(lambda: 1 / 0)
    comm.receive({"request": "sidebar"})
    assert "ZeroDivisionError" in comm.sent[-1]["sidebar_error"]

    # Closed comms are dropped; unregister closes the rest and removes the target.
    comm.receive_close()
    assert frontend.publish_status(payload) == 1
    frontend.unregister_status_target()
    assert announce.closed
    assert "gpumem.status" not in manager.targets
    assert frontend.publish_status(payload) == 0


def test_comms_of_pages_that_went_away_are_dropped(frontend: Any) -> None:
    shell = FakeShell()
    frontend.register_status_target(shell)
    manager = shell.kernel.comm_manager
    (beacon,) = frontend.announced
    beacon.receive({"request": "snapshot"})  # adopted by a first page
    gone, alive = manager.open_from_frontend(), manager.open_from_frontend()
    payload = {"devices": [], "host": {"rss_bytes": 1}, "cuda_in_use": False}
    assert frontend.publish_status(payload) == 3
    # All silent for long: nothing is dropped (the kernel may just be busy).
    for entry in frontend._comms.values():
        entry.last_seen -= 10 * frontend.STALE_COMM_S
    assert frontend.publish_status(payload) == 3
    # One keeps sending keepalives, the others stay silent: the front-end comm is closed, the
    # beacon stays open (for comm_info) but is no longer published to.
    alive.receive({"request": "keepalive"})
    assert frontend.publish_status(payload) == 1
    assert gone.closed and not alive.closed and not beacon.closed
    assert frontend.open_status_comms() == 1
    assert len(frontend._comms) == 2


def test_pages_that_said_bye_or_closed_their_comm_are_gone(frontend: Any) -> None:
    shell = FakeShell()
    frontend.register_status_target(shell)
    manager = shell.kernel.comm_manager
    (beacon,) = frontend.announced
    beacon.receive({"request": "snapshot"}, page="a")  # page a adopts the beacon
    own = manager.open_from_frontend(page="b")
    pages = ["a", "b", "never heard"]  # the last: a front end without the extension
    assert frontend.pages_gone(pages) == frozenset()
    beacon.receive({"request": "bye"}, page="a")  # page a is reloaded
    assert frontend.pages_gone(pages) == {"a"}
    assert not beacon.closed, "the beacon stays open for the next page's comm_info_request"
    assert frontend.open_status_comms() == 1
    beacon.receive({"request": "keepalive"}, page="c")  # the reloaded page adopts it
    assert frontend.pages_gone([*pages, "c"]) == {"a"}
    own.receive({"request": "bye"}, page="b")  # a page's own comm: closed by the kernel
    assert own.closed
    assert frontend.pages_gone([*pages, "c"]) == {"a", "b"}
    assert frontend.publish_status({"devices": [], "host": {}, "cuda_in_use": False}) == 1


def test_publisher_thread_runs_only_while_a_comm_listens(frontend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []

    def provider() -> dict[str, Any]:
        calls.append(time.monotonic())
        return {"devices": [], "host": {"rss_bytes": len(calls)}, "cuda_in_use": False}

    monkeypatch.setattr(frontend, "default_status_payload", provider)
    shell = FakeShell()
    frontend.register_status_target(shell)
    time.sleep(0.3)
    assert len(calls) == 1, "only the announce payload while nobody listens"
    comm = shell.kernel.comm_manager.open_from_frontend()
    deadline = time.monotonic() + 5
    while len(comm.sent) < 4:
        assert time.monotonic() < deadline, comm.sent
        time.sleep(0.02)
    # Someone else publishing: the default publisher stays quiet.
    for _ in range(10):
        frontend.publish_status({"devices": [], "host": {"rss_bytes": -1}, "cuda_in_use": False})
        time.sleep(0.03)
    assert all(m["host"]["rss_bytes"] == -1 for m in comm.sent[-5:])
    comm.receive_close()
    time.sleep(0.3)
    thread = frontend._publisher
    assert thread is None or not thread.is_alive()


def test_publisher_sends_a_comm_a_payload_only_when_it_changed(frontend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The front end keeps showing the last payload: the same again would cost the kernel a serialization.
    monkeypatch.setattr(frontend, "_last_external_publish", 0.0)  # nobody else published recently
    payload: dict[str, Any] = {"devices": [], "host": {"rss_bytes": 1}, "cuda_in_use": False}
    monkeypatch.setattr(frontend, "default_status_payload", lambda: payload)  # the same dict, changed in place below
    shell = FakeShell()
    frontend.register_status_target(shell)
    comm = shell.kernel.comm_manager.open_from_frontend()
    assert len(comm.sent) == 1, "the snapshot request is answered at once"
    time.sleep(0.5)  # ten publisher passes
    assert len(comm.sent) == 1, comm.sent
    payload["host"]["rss_bytes"] = 2
    deadline = time.monotonic() + 5
    while len(comm.sent) < 2:
        assert time.monotonic() < deadline, comm.sent
        time.sleep(0.02)
    time.sleep(0.3)
    assert len(comm.sent) == 2, comm.sent
    comm.receive({"request": "snapshot"})  # asked: answered, changed or not
    assert len(comm.sent) == 3
    comm.receive({"request": "sidebar"})  # another message in between: the payload is sent again once
    deadline = time.monotonic() + 5
    while not (len(comm.sent) == 5 and comm.sent[-1] is payload):
        assert time.monotonic() < deadline, comm.sent
        time.sleep(0.02)


def test_publisher_publishes_with_the_samplers_beat(frontend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the sampler runs (here at 1 Hz, out of step with the comm's opening), each publication goes
    right after a sample: what the status bar shows is fresh, and the thread wakes with the sampler."""
    from gpumem.core.monitoring.monitor import Monitor
    from gpumem.testing import FakeSource

    monitor = Monitor(FakeSource())
    monkeypatch.setattr("gpumem.core.monitoring.monitor._default", monitor)
    monkeypatch.setattr(frontend, "PUBLISH_INTERVAL_S", 1.0)
    monkeypatch.setattr(frontend, "_last_external_publish", 0.0)
    sampled: list[float] = []
    monitor.sampler.add_listener(lambda snapshot: sampled.append(snapshot.monotonic_s))
    published: list[float] = []

    def provider() -> dict[str, Any]:
        published.append(time.monotonic())
        return {"devices": [], "host": {"rss_bytes": len(published)}, "cuda_in_use": False}

    monkeypatch.setattr(frontend, "default_status_payload", provider)
    monitor.acquire("test")
    try:
        time.sleep(0.5)
        shell = FakeShell()
        frontend.register_status_target(shell)
        shell.kernel.comm_manager.open_from_frontend()
        deadline = time.monotonic() + 15
        while len(published) < 7:
            assert time.monotonic() < deadline, published
            time.sleep(0.02)
    finally:
        monitor.release("test")
        monitor.stop()
    steady = published[2:]  # the announcement and the answer to the comm's request come first
    ages = [at - max(t for t in sampled if t <= at) for at in steady]
    assert max(ages) < 0.2, ages
    assert all(0.8 < b - a < 1.3 for a, b in itertools.pairwise(steady)), steady


def test_default_payload_never_touches_cuda_before_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumem.core.monitoring.monitor import Monitor
    from gpumem.panel import frontend as _frontend

    # The figures come from the shared monitor's source: a fresh one, on a machine whose only GPU is the
    # fake torch below (no NVML).
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr("gpumem.core.monitoring.monitor._default", Monitor())

    class NotInitialized:
        def is_initialized(self) -> bool:
            return False

        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"torch.cuda.{name} called before CUDA was initialized")

    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=NotInitialized()))
    payload = _frontend.default_status_payload()
    assert payload["cuda_in_use"] is False and payload["devices"] == []
    assert payload["host"]["rss_bytes"] > 0

    cuda = SimpleNamespace(
        is_initialized=lambda: True,
        device_count=lambda: 2,
        memory_stats=lambda i: {"allocated_bytes.all.current": 100 + i, "reserved_bytes.all.current": 200 + i},
        get_device_properties=lambda i: SimpleNamespace(name=f"Fake {i}", total_memory=1000),
    )
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    payload = _frontend.default_status_payload()
    assert payload["cuda_in_use"] is True
    assert payload["devices"][1] == {
        "index": 1,
        "name": "Fake 1",
        "allocated_bytes": 101,
        "reserved_bytes": 201,
        "total_bytes": 1000,
    }


def test_status_payload_is_the_samplers_snapshot_when_it_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumem.core.monitoring.monitor import Monitor
    from gpumem.panel.frontend import StatusReader
    from gpumem.testing import GIB, FakeSource

    source = FakeSource(devices=2, total_bytes=40 * GIB)
    monitor = Monitor(source)
    monkeypatch.setattr("gpumem.core.monitoring.monitor._default", monitor)
    source.allocate(3 * GIB, 1)
    reader = StatusReader()
    # Not listening and no sample: one snapshot read through the monitor.
    taken = source.snapshots_taken
    payload = reader.now()
    assert source.snapshots_taken == taken + 1
    assert payload["cuda_in_use"] is True and payload["devices"][1]["allocated_bytes"] == 3 * GIB
    # Listening while the sampler samples: its snapshot, nothing read again.
    reader.start()
    try:
        monitor.sampler.sample_once()
        source.allocate(1 * GIB, 1)  # not sampled yet: the payload shows what the sampler saw
        taken = source.snapshots_taken
        payload = reader.now()
        assert source.snapshots_taken == taken
        assert payload["devices"][1] == {
            "index": 1,
            "name": "Fake GPU",
            "allocated_bytes": 3 * GIB,
            "reserved_bytes": 3 * GIB,
            "total_bytes": 40 * GIB,
        }
        assert payload["host"]["rss_bytes"] == source.host_rss_bytes
    finally:
        reader.stop()
    assert not monitor.running  # the status bar never starts the sampler


def test_frontend_module_imports_nothing_heavy() -> None:
    code = (
        "import sys; import gpumem.panel.frontend; "
        "heavy = [m for m in ('torch', 'ipywidgets', 'psutil', 'IPython', 'bqplot') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout


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
    # The prebuilt extension is reused (skip-if-exists). Without build isolation when this
    # environment has the build backend (a few seconds), else pip makes one (a minute, needs PyPI).
    import importlib.util

    backend = all(importlib.util.find_spec(m) for m in ("hatchling", "hatch_jupyter_builder"))
    isolation = ["--no-build-isolation"] if backend else []
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", *isolation, "-w", str(dist)],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = dist.glob("jupyter_gpumem-*.whl")  # the distribution name; the import name is gpumem
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
    assert install["packageName"] == "jupyter-gpumem"  # what `jupyter labextension list` tells users to uninstall
    assert "jupyter-gpumem" in install["uninstallInstructions"]
    wheel_meta = zipfile.ZipFile(wheel).read(prefix.removesuffix(".data/data/") + ".dist-info/METADATA").decode()
    assert "\nName: jupyter-gpumem\n" in wheel_meta
    assert any(n.startswith("gpumem/") and n.endswith("/__init__.py") for n in names) or "gpumem/__init__.py" in names


# --------------------------------------------------------------------------------------------
# JupyterLab 4
# --------------------------------------------------------------------------------------------


@browser
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
    figures = r"^(RAM [\d.]+ [MG]iB \(no GPU in use\)|GPU [\d.]+ (\wiB|B) / [\d.]+ \wiB)"
    status = wait_status_text(page, re.compile(figures))
    assert status

    _close_and_reopen_from_palette_and_status_item(page, "train")

    # Restart: a clear message instead of a dead widget, and the status item goes away.
    restart_kernel(page)
    wait_sidebar_text(
        page, "The kernel of train.ipynb restarted; run %load_ext gpumem, then %gpumem sidebar to reconnect"
    )
    assert sidebar(page).locator(".widget-label").count() == 0
    page.locator(STATUS_ITEM).wait_for(state="hidden")
    save_screenshot(page, f"{request.node.name}.restarted")
    wait_for_kernel_idle(page)

    # Run again: reconnects.
    cell = run_cell(page, TICKER_CELL.format(name="train"), index=0)
    wait_for_output(cell, NOTE)
    wait_label_changes(page, "train")
    assert "restarted" not in sidebar(page).inner_text()

    _second_notebook_takes_the_sidebar(page, f"{request.node.name}.other")

    # Back to train.ipynb: its status item click asks its kernel for a panel (sidebar factory).
    page.locator(".lm-TabBar-tab", has_text="train.ipynb").first.click()
    wait_status_text(page, re.compile(r"RAM|GPU"))
    page.locator(STATUS_ITEM).click()
    wait_sidebar_text(page, "GPU memory · train.ipynb")
    wait_label_changes(page, "train")
    # It stays: other.ipynb's status messages (about one a second) must not dock its panel back.
    page.wait_for_timeout(3000)
    assert "GPU memory · train.ipynb" in sidebar(page).inner_text()
    wait_label_changes(page, "train")
    save_screenshot(page, f"{request.node.name}.back")

    # Closing the notebook never leaves its widget: a message says it was closed, or another notebook's
    # panel, docked meanwhile by its own cell or its status bar item, shows instead.
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    page.locator(".lm-TabBar-tab.jp-mod-dirty", has_text="train.ipynb").wait_for(state="detached")
    page.evaluate("() => window.jupyterapp.commands.execute('application:close')")
    _wait_closed_or_handed_back(page)


def _wait_closed_or_handed_back(page: Page, timeout: float = 30) -> None:
    """After train.ipynb closed: its message with no widget, or other.ipynb's live widget alone."""
    deadline = time.monotonic() + timeout
    while True:
        text = sidebar(page).inner_text() if sidebar(page).count() else ""
        labels = sidebar(page).locator(".widget-label").all_inner_texts()
        if "train.ipynb was closed" in text and not labels:
            return
        if "GPU memory · other.ipynb" in text and labels and all(label.startswith("other") for label in labels):
            return
        assert time.monotonic() < deadline, (text, labels)
        time.sleep(0.2)


def _second_notebook_takes_the_sidebar(page: Page, screenshot: str) -> None:
    # A second notebook: its panel takes the sidebar, and the title names it.
    open_second_notebook(page, "other.ipynb")
    cell2 = run_cell(page, TICKER_CELL.format(name="other"))
    wait_for_output(cell2, NOTE)
    wait_sidebar_text(page, "GPU memory · other.ipynb")
    wait_label_changes(page, "other")
    tab = page.locator(f'.lm-TabBar-tab[data-id="{SIDEBAR[1:]}"]')
    assert tab.get_attribute("title") == "GPU memory · other.ipynb"
    save_screenshot(page, screenshot)


def _close_and_reopen_from_palette_and_status_item(page: Page, prefix: str) -> None:
    # Close with the sidebar's own button, reopen from the command palette: the view is live again.
    sidebar(page).locator(".gpumem-Sidebar-close").click()
    sidebar(page).wait_for(state="detached")
    run_palette_command(page, "GPU memory: show sidebar")
    sidebar(page).wait_for(state="visible")
    wait_label_changes(page, prefix)

    # Close again and reopen from the status-bar item.
    sidebar(page).locator(".gpumem-Sidebar-close").click()
    sidebar(page).wait_for(state="detached")
    page.locator(STATUS_ITEM).click()
    sidebar(page).wait_for(state="visible")
    wait_label_changes(page, prefix)


_LINES_JS = """() => [...document.querySelectorAll('#gpumem-sidebar path.line')]
    .map(p => p.getAttribute('d') || '').join('|')"""


@browser
def test_lab_magic_sidebar_and_reload(
    labextension: Path, jupyter_server: JupyterServer, browser_page: Page, request: pytest.FixtureRequest
) -> None:
    """``%gpumem sidebar`` docks the real panel; after a page reload the status bar reconnects and
    its click docks the kernel's panel again."""
    page = browser_page
    jupyter_server.make_notebook("magic.ipynb", [""])
    open_notebook(page, jupyter_server, "magic.ipynb")
    run_cell(page, "%load_ext gpumem")
    cell = run_cell(page, "%gpumem sidebar --host")
    wait_for_output(cell, NOTE)
    sidebar(page).locator(".gpumem-panel").wait_for(state="visible")
    wait_sidebar_text(page, "GPU memory · magic.ipynb")
    first = page.evaluate(_LINES_JS)
    deadline = time.monotonic() + 30
    while page.evaluate(_LINES_JS) in ("", first):
        assert time.monotonic() < deadline, "the docked panel's curves did not move"
        time.sleep(0.25)
    wait_status_text(page, re.compile(r"RAM|GPU"))
    save_screenshot(page, f"{request.node.name}.docked")

    # Save (the output is signed, so it is trusted when it comes back) and reload: the kernel lives on.
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    page.locator(".lm-TabBar-tab.jp-mod-dirty", has_text="magic.ipynb").wait_for(state="detached")
    # Reload: the kernel lives on. The restored note asks the kernel (its status comm reconnects) whether
    # its panel is still the live docked one: it is, so the note says docked, not "earlier run".
    page.reload(wait_until="domcontentloaded")
    wait_for_kernel_idle(page)
    page.locator(".gpumem-SidebarNote").first.wait_for(state="visible")
    wait_for_text(page.locator(".gpumem-SidebarNote"), NOTE)
    # It was docked before the reload: it comes back by itself once the status comm reconnects.
    sidebar(page).locator(".gpumem-panel").wait_for(state="visible", timeout=30_000)
    wait_sidebar_text(page, "GPU memory · magic.ipynb")
    save_screenshot(page, f"{request.node.name}.reloaded")
    _narrow_sidebar_fits(page)


_RIGHT_HANDLE_JS = """() => {
    // The split handle between the main area and the right sidebar (the one just left of it).
    const stack = document.querySelector('#jp-right-stack').getBoundingClientRect();
    const handles = [...document.querySelectorAll('#jp-main-split-panel > .lm-SplitPanel-handle')]
        .map(h => h.getBoundingClientRect()).filter(r => r.width > 0 && r.right <= stack.left + 1);
    const h = handles.sort((a, b) => b.right - a.right)[0];
    return {x: h.left + h.width / 2, y: h.top + h.height / 2,
            width: document.querySelector('#gpumem-sidebar').getBoundingClientRect().width};
}"""


def _resize_right_sidebar(page: Page, width: float) -> None:
    """Drag the sidebar's split handle, as a user would, until the docked panel is ``width`` px wide."""
    for _ in range(4):
        handle = page.evaluate(_RIGHT_HANDLE_JS)
        delta = handle["width"] - width
        if abs(delta) < 1:
            return
        page.mouse.move(handle["x"], handle["y"])
        page.mouse.down()
        page.mouse.move(handle["x"] + delta, handle["y"], steps=5)
        page.mouse.up()
    raise AssertionError(f"the sidebar did not become {width} px wide: {page.evaluate(_RIGHT_HANDLE_JS)}")


_FITS_JS = """() => {
    const sidebar = document.querySelector('#gpumem-sidebar');
    const panel = sidebar.querySelector('.gpumem-panel');
    const view = sidebar.getBoundingClientRect();
    const name = e => `${e.tagName.toLowerCase()}.${String(e.className.baseVal ?? e.className)}`
        + ` "${(e.textContent || '').trim().slice(0, 30)}"`;
    const all = [sidebar, ...sidebar.querySelectorAll('*')];
    const scrollers = all.filter(e => ['auto', 'scroll'].includes(getComputedStyle(e).overflowX)
        && e.scrollWidth > e.clientWidth + 1).map(name);
    // Text that is cut: past the sidebar's edges, past its own svg, or clipped by its own box.
    const texts = all.filter(e => [...e.childNodes].some(n => n.nodeType === 3 && n.textContent.trim()))
        .filter(e => e.getBoundingClientRect().width > 0);
    const cut = texts.filter(e => {
        const r = e.getBoundingClientRect();
        const svg = e.ownerSVGElement && e.ownerSVGElement.getBoundingClientRect();
        const box = svg || view;
        const clipped = !svg && getComputedStyle(e).overflowX !== 'visible' && e.scrollWidth > e.clientWidth + 1;
        return r.left < Math.max(box.left, view.left) - 0.5 || r.right > Math.min(box.right, view.right) + 0.5
            || clipped;
    }).map(name);
    // bqplot's Label mark draws each text as <text class="label element"> in a .object_grp group.
    const labels = [...panel.querySelectorAll('.object_grp text.label')].filter(t => t.textContent.trim())
        .map(t => t.getBoundingClientRect());
    const overlaps = labels.some((a, i) => labels.slice(i + 1).some(b =>
        a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom));
    const cardRows = new Set([...panel.querySelectorAll('.gm-card')]
        .map(c => Math.round(c.getBoundingClientRect().top))).size;
    const buttons = [...panel.querySelectorAll('button')].filter(b => b.getBoundingClientRect().width > 0);
    const badButtons = buttons.filter(b => { const r = b.getBoundingClientRect();
        return r.left < view.left - 0.5 || r.right > view.right + 0.5 || b.scrollWidth > b.clientWidth + 1; })
        .map(name);
    const free = [...buttons].find(b => b.textContent.includes('Free')).getBoundingClientRect();
    const msgEl = panel.querySelector('.gm-msg');
    const msg = msgEl.getBoundingClientRect();
    // What the user sees of the message: clipped by every scrolling ancestor and by the window.
    // (Not <body>: JupyterLab lays the page out absolutely, so its box has no height.)
    let visibleBottom = window.innerHeight;
    for (let e = msgEl.parentElement; e && e !== document.body; e = e.parentElement) {
        if (getComputedStyle(e).overflowY !== 'visible') {
            visibleBottom = Math.min(visibleBottom, e.getBoundingClientRect().bottom);
        }
    }
    return {width: view.width, scrollers, cut, labels: labels.length, overlaps, cardRows, badButtons,
            msgText: msgEl.textContent, msgTop: msg.top, freeBottom: free.bottom, msgBottom: msg.bottom,
            visibleBottom};
}"""


def _narrow_sidebar_fits(page: Page) -> None:
    """At 280 px: no sideways scroll, no cut text, marker labels apart, the cards wrap, the buttons
    fit, and Free's result shows under its button without scrolling."""
    _resize_right_sidebar(page, 280)
    run_cell(page, "%gpumem auto on")
    for _ in range(30):  # quick cells: their markers crowd a narrow plot
        run_cell(page, "x = 1")
    page.locator("#gpumem-sidebar .gpumem-panel button", has_text="Free").first.click()
    deadline = time.monotonic() + 30
    while "Freed" not in sidebar(page).locator(".gm-msg").inner_text():
        assert time.monotonic() < deadline, "Free's result did not appear"
        time.sleep(0.25)
    time.sleep(1)  # a sample or two after the click: the layout the user then sees
    fits = page.evaluate(_FITS_JS)
    save_screenshot(page, "sidebar_docked_280px")
    assert abs(fits["width"] - 280) < 1, fits
    assert not fits["scrollers"], fits
    assert not fits["cut"], fits
    assert fits["labels"] >= 2, fits
    assert not fits["overlaps"], fits
    assert fits["cardRows"] >= 2, fits
    assert not fits["badButtons"], fits
    assert fits["msgTop"] >= fits["freeBottom"], fits
    assert fits["msgBottom"] <= fits["visibleBottom"], json.dumps(fits)
    readme_screenshot(page.locator("#gpumem-sidebar"), "panel_sidebar", down_to=sidebar(page).locator(".gpumem-panel"))


@browser
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
    import nbformat
    from nbformat import v4

    path = jupyter_server.make_notebook("restored.ipynb", [])
    nb = nbformat.read(str(path), as_version=4)
    output = v4.new_output("display_data", data=bundle)
    nb.cells.append(v4.new_code_cell("%gpumem sidebar", execution_count=1, outputs=[output]))
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
    # Its kernel has no gpumem: once asked (no status comm there), the note says so, without docking.
    wait_for_text(note, "earlier run", timeout=20)
    page.wait_for_timeout(1000)
    assert sidebar(page).count() == 0


# --------------------------------------------------------------------------------------------
# Notebook 7
# --------------------------------------------------------------------------------------------


@browser
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
    # And the command palette.
    sidebar(page).locator(".gpumem-Sidebar-close").click()
    sidebar(page).wait_for(state="detached")
    run_palette_command(page, "GPU memory: show sidebar")
    sidebar(page).wait_for(state="visible")
    wait_label_changes(page, "nb7")

    restart_kernel(page)
    restarted = "The kernel of nb7.ipynb restarted; run %load_ext gpumem, then %gpumem sidebar to reconnect"
    wait_sidebar_text(page, restarted)
    assert sidebar(page).locator(".widget-label").count() == 0
    save_screenshot(page, f"{request.node.name}.restarted")
    wait_for_kernel_idle(page)
    cell = run_cell(page, TICKER_CELL.format(name="nb7"), index=0)
    wait_for_output(cell, NOTE)
    wait_label_changes(page, "nb7")
