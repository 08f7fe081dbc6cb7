"""Shared test harness for gpumem's suite.

Fixtures (re-exported by ``tests/conftest.py``, so any test can request them by name):

``ip``                 the in-process IPython shell, user namespace reset around every test
``jupyter_env``        (session) isolated Jupyter dirs + a ``python3`` kernelspec running ``sys.executable``
``jupyter_server``     (session) a running ``jupyter lab`` server -> :class:`JupyterServer`
``notebook_server``    (session) a running Notebook 7 (``jupyter notebook``) server -> :class:`JupyterServer`
``browser``            (module) Playwright ``Browser`` on Debian's chromium (skips when chromium is absent)
``browser_page``       a fresh Playwright ``Page`` (own context); screenshot + console log saved on failure
``artifacts_dir``      ``pathlib.Path`` of ``test-artifacts/`` (``$GPUMEM_TEST_ARTIFACTS`` overrides)

Helpers (import them with ``from _harness import ...``): :func:`make_notebook`, :func:`run_notebook`,
:func:`run_cell_capture`, :func:`open_notebook`, :func:`wait_for_kernel_idle`, :func:`run_cell`,
:func:`wait_for_output`, :func:`cell_outputs_text`, :func:`save_screenshot`, :func:`cuda_status`.

Only the standard library is imported at module level: the GPU machine runs this suite without
Playwright, nbformat or a Jupyter server installed.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # pragma: no cover
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import CapturedIO
    from playwright.sync_api import Browser, Locator, Page

REPO_ROOT = Path(__file__).resolve().parent.parent
SRC_DIR = REPO_ROOT / "src"

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

# Default timeouts (seconds). A 2-core CI machine is slow to start JupyterLab and kernels.
SERVER_START_TIMEOUT = 120.0
KERNEL_TIMEOUT = 90.0
OUTPUT_TIMEOUT = 60.0


# --------------------------------------------------------------------------------------------
# Artifacts
# --------------------------------------------------------------------------------------------


def artifacts_path() -> Path:
    """Directory for screenshots and logs (``$GPUMEM_TEST_ARTIFACTS`` or ``<repo>/test-artifacts``)."""
    path = Path(os.environ.get("GPUMEM_TEST_ARTIFACTS") or REPO_ROOT / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def safe_name(name: str) -> str:
    """A file-name-safe version of a test name or node id."""
    name = name.split("::", 1)[-1] if "::" in name else name
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[:150] or "unnamed"


def save_screenshot(page: Page, name: str | pytest.FixtureRequest, *, full_page: bool = True) -> Path:
    """Save ``page`` as ``test-artifacts/<name>.png`` and return the path.

    ``name`` may be a string or the test's ``request`` fixture (then the test's name is used).
    """
    label = name if isinstance(name, str) else name.node.name
    path = artifacts_path() / f"{safe_name(label)}.png"
    page.screenshot(path=str(path), full_page=full_page)
    return path


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    return artifacts_path()


# --------------------------------------------------------------------------------------------
# CUDA availability (checked in a subprocess so the test process never initializes CUDA)
# --------------------------------------------------------------------------------------------

_CUDA_PROBE = """
import json
try:
    import torch
except Exception as exc:
    print(json.dumps({"torch": None, "available": False, "count": 0, "error": repr(exc)}))
else:
    ok = bool(torch.cuda.is_available())
    print(json.dumps({"torch": torch.__version__, "available": ok,
                      "count": torch.cuda.device_count() if ok else 0, "error": None}))
"""

_cuda_cache: dict[str, Any] | None = None


def cuda_status() -> dict[str, Any]:
    """``{"torch": version|None, "available": bool, "count": int, "error": str|None, "reason": str}``.

    Probed once per process in a child interpreter: calling ``torch.cuda.is_available()`` here could
    initialize CUDA in the test process and break tests that fork later.
    """
    global _cuda_cache
    if _cuda_cache is None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(SRC_DIR), env.get("PYTHONPATH", "")] if p)
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _CUDA_PROBE],
                capture_output=True,
                text=True,
                timeout=300,
                env=env,
                check=False,
            )
            lines = proc.stdout.strip().splitlines()
            status: dict[str, Any] = (
                json.loads(lines[-1])
                if lines
                else {
                    "torch": None,
                    "available": False,
                    "count": 0,
                    "error": f"probe failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}",
                }
            )
        except (subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
            status = {"torch": None, "available": False, "count": 0, "error": f"probe failed: {exc!r}"}
        if status["torch"] is None:
            status["reason"] = f"torch is not importable ({status['error']})"
        elif not status["available"]:
            status["reason"] = f"torch {status['torch']} sees no CUDA device (torch.cuda.is_available() is False)"
        else:
            status["reason"] = f"torch {status['torch']} with {status['count']} CUDA device(s)"
        _cuda_cache = status
    return _cuda_cache


def gpu_required() -> bool:
    """True when ``$GPUMEM_REQUIRE_GPU`` is set (the GPU CI job): then missing CUDA fails gpu tests."""
    return os.environ.get("GPUMEM_REQUIRE_GPU", "").strip().lower() not in ("", "0", "false", "no")


def check_gpu_item(item: pytest.Item) -> None:
    """Skip (or fail, when a GPU is required) a ``gpu``-marked test if CUDA is not usable.

    Called from ``pytest_runtest_setup`` before pytest evaluates skip marks, so the skip is reported
    at the test's own location.
    """
    if item.get_closest_marker("gpu") is None:
        return
    status = cuda_status()
    if status["available"]:
        return
    if gpu_required():
        pytest.fail(f"GPUMEM_REQUIRE_GPU is set but {status['reason']}", pytrace=False)
    item.add_marker(pytest.mark.skip(reason=f"needs CUDA: {status['reason']}"))


# --------------------------------------------------------------------------------------------
# In-process IPython shell
# --------------------------------------------------------------------------------------------

_shell_state: dict[str, Any] = {}


def _ipython_shell() -> InteractiveShell:
    """The process-wide ``InteractiveShell`` (created once, with in-memory history, no colours)."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    if InteractiveShell.initialized():
        return InteractiveShell.instance()
    if "ipythondir" not in _shell_state:
        _shell_state["ipythondir"] = tempfile.mkdtemp(prefix="gpumem-ipython-")
        os.environ.setdefault("IPYTHONDIR", _shell_state["ipythondir"])
    cfg = Config()
    cfg.HistoryManager.hist_file = ":memory:"
    cfg.InteractiveShell.colors = "nocolor"
    shell: InteractiveShell = InteractiveShell.instance(config=cfg)
    return shell


def _clear_exception_state(shell: InteractiveShell) -> None:
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            with contextlib.suppress(AttributeError):
                delattr(sys, name)
    with contextlib.suppress(AttributeError):
        shell.InteractiveTB.tb = None
    shell.last_execution_result = None


def _snapshot(shell: InteractiveShell) -> dict[str, Any]:
    # IPython 9 registers some magics lazily (%load_ext, %time, ...): a stub that loads its class on
    # first use, once. Restoring a stub after that load would break the magic for later tests.
    load_lazy = getattr(shell.magics_manager, "load_all_lazy_magics", None)
    if load_lazy is not None:
        load_lazy()
    return {
        "extensions": set(shell.extension_manager.loaded),
        "events": {name: list(cbs) for name, cbs in shell.events.callbacks.items()},
        "magics": {kind: dict(table) for kind, table in shell.magics_manager.magics.items()},
        "input_transformers": list(shell.input_transformers_post),
        "ast_transformers": list(shell.ast_transformers),
    }


def _restore(shell: InteractiveShell, snap: dict[str, Any]) -> None:
    # Unload what the test loaded (gives extensions the chance to stop threads), then put back the
    # hooks a misbehaving unload may have left behind.
    for name in sorted(set(shell.extension_manager.loaded) - snap["extensions"]):
        with contextlib.suppress(Exception):
            shell.extension_manager.unload_extension(name)
        shell.extension_manager.loaded.discard(name)
    for name, cbs in snap["events"].items():
        shell.events.callbacks[name][:] = cbs
    for kind, table in snap["magics"].items():
        shell.magics_manager.magics[kind].clear()
        shell.magics_manager.magics[kind].update(table)
    shell.input_transformers_post[:] = snap["input_transformers"]
    shell.ast_transformers[:] = snap["ast_transformers"]


def reset_shell(shell: InteractiveShell) -> None:
    """Reset the user namespace, output cache, remembered exception and execution count of ``shell``.

    Like a fresh kernel: the next cell is ``In[1]``/``Out[1]``. (A new history session; the history
    database is in memory, so this costs nothing.)
    """
    shell.reset(new_session=True)
    _clear_exception_state(shell)
    gc.collect()


@pytest.fixture
def ip() -> Iterator[InteractiveShell]:
    """The session's in-process ``InteractiveShell``; ``get_ipython()`` returns it.

    Every test starts with an empty user namespace and output cache and execution count 1, as in a
    fresh kernel; extensions the test loaded are unloaded afterwards and event callbacks, magics and
    transformers restored.
    """
    shell = _ipython_shell()
    snap = _snapshot(shell)
    reset_shell(shell)
    try:
        yield shell
    finally:
        _restore(shell, snap)
        reset_shell(shell)


def run_cell_capture(shell: InteractiveShell, code: str, *, raise_on_error: bool = False) -> tuple[Any, CapturedIO]:
    """Run ``code`` like a notebook cell; return ``(ExecutionResult, CapturedIO)``.

    ``CapturedIO`` has ``.stdout``, ``.stderr`` and ``.outputs`` (rich ``display()`` outputs, each with
    ``.data`` mapping MIME type -> content, e.g. ``cap.outputs[0].data["text/html"]``).
    """
    from IPython.utils.capture import capture_output

    with capture_output(display=True) as cap:
        result = shell.run_cell(code, store_history=True)
    if raise_on_error:
        result.raise_error()
    return result, cap


# --------------------------------------------------------------------------------------------
# Isolated Jupyter environment, kernels, notebooks
# --------------------------------------------------------------------------------------------


@dataclass
class JupyterEnv:
    """Temporary Jupyter directories: nothing touches the user's ~/.jupyter or ~/.local/share/jupyter."""

    base: Path
    env: dict[str, str]
    data_dir: Path
    config_dir: Path
    runtime_dir: Path
    kernels_dir: Path
    kernel_name: str = "python3"


def _pythonpath(extra: Sequence[str] = ()) -> str:
    parts = [*extra, str(SRC_DIR), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    seen: list[str] = []
    for p in parts:
        if p and p not in seen:
            seen.append(p)
    return os.pathsep.join(seen)


def make_jupyter_env(base: Path) -> JupyterEnv:
    """Create isolated Jupyter dirs under ``base`` with a ``python3`` kernelspec on ``sys.executable``."""
    data_dir, config_dir, runtime_dir = base / "data", base / "config", base / "runtime"
    ipython_dir = base / "ipython"
    for d in (data_dir, config_dir, runtime_dir, ipython_dir):
        d.mkdir(parents=True, exist_ok=True)
    pythonpath = _pythonpath()
    kernels_dir = data_dir / "kernels"
    spec_dir = kernels_dir / "python3"
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-Xfrozen_modules=off", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (ipykernel)",
                "language": "python",
                "metadata": {"debugger": False},
                "env": {"PYTHONPATH": pythonpath, "IPYTHONDIR": str(ipython_dir)},
            },
            indent=1,
        )
    )
    # Quiet, deterministic front end: no news/update toasts, every cell in the DOM.
    settings = config_dir / "lab" / "user-settings" / "@jupyterlab"
    (settings / "apputils-extension").mkdir(parents=True, exist_ok=True)
    (settings / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    (settings / "notebook-extension").mkdir(parents=True, exist_ok=True)
    (settings / "notebook-extension" / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    env = dict(os.environ)
    env.update(
        {
            "JUPYTER_DATA_DIR": str(data_dir),
            "JUPYTER_CONFIG_DIR": str(config_dir),
            "JUPYTER_RUNTIME_DIR": str(runtime_dir),
            "JUPYTER_PATH": str(data_dir),
            "JUPYTER_PLATFORM_DIRS": "1",
            "IPYTHONDIR": str(ipython_dir),
            "PYTHONPATH": pythonpath,
            "PYTHONUNBUFFERED": "1",
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        }
    )
    return JupyterEnv(
        base=base, env=env, data_dir=data_dir, config_dir=config_dir, runtime_dir=runtime_dir, kernels_dir=kernels_dir
    )


@pytest.fixture(scope="session")
def jupyter_env(tmp_path_factory: pytest.TempPathFactory) -> JupyterEnv:
    return make_jupyter_env(tmp_path_factory.mktemp("jupyter-env"))


def make_notebook(
    path: str | os.PathLike[str],
    cells: Sequence[str | Mapping[str, Any]] = (),
    *,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write a notebook (nbformat v4) with code cells from ``cells`` to ``path`` and return the path.

    A cell is a source string (code cell) or ``{"cell_type": "markdown", "source": ...}``. The notebook
    asks for the ``python3`` kernel, so it opens without a kernel-picker dialog.
    """
    import nbformat
    from nbformat import v4

    nb = v4.new_notebook()
    nb.metadata.update(
        {
            "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"},
            "language_info": {"name": "python"},
        }
    )
    if metadata:
        nb.metadata.update(metadata)
    for cell in cells:
        if isinstance(cell, str):
            nb.cells.append(v4.new_code_cell(cell))
        elif cell.get("cell_type") == "markdown":
            nb.cells.append(v4.new_markdown_cell(cell["source"]))
        else:
            nb.cells.append(v4.new_code_cell(cell["source"]))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(out))
    return out


def run_notebook(
    nb_or_path: Any,
    *,
    jupyter_env: JupyterEnv | None = None,
    timeout: float = 300,
    cwd: str | os.PathLike[str] | None = None,
    allow_errors: bool = False,
) -> Any:
    """Execute a notebook (``NotebookNode`` or path) in a real ``python3`` kernel with nbclient.

    Returns the executed ``NotebookNode``. Pass the ``jupyter_env`` fixture to use its kernelspec
    (``sys.executable``, ``src/`` on ``PYTHONPATH``); without it a temporary one is made.
    """
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(str(nb_or_path), as_version=4) if isinstance(nb_or_path, (str, os.PathLike)) else nb_or_path
    if cwd is None:
        cwd = Path(nb_or_path).parent if isinstance(nb_or_path, (str, os.PathLike)) else os.getcwd()
    with contextlib.ExitStack() as stack:
        if jupyter_env is None:
            jupyter_env = make_jupyter_env(
                Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpumem-nbclient-")))
            )
        ksm = KernelSpecManager(kernel_dirs=[str(jupyter_env.kernels_dir)], ensure_native_kernel=False)
        km = KernelManager(kernel_name=jupyter_env.kernel_name, kernel_spec_manager=ksm)
        client = NotebookClient(
            nb,
            km=km,
            timeout=int(timeout),
            allow_errors=allow_errors,
            resources={"metadata": {"path": str(cwd)}},
            kernel_name=jupyter_env.kernel_name,
        )
        client.execute()
    return nb


def cell_text(cell: Any) -> str:
    """All text of one executed cell's outputs (stream text, errors and ``text/plain``), joined."""
    parts: list[str] = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif out.get("output_type") == "error":
            parts.append(f"{out.get('ename')}: {out.get('evalue')}")
        else:
            parts.append(str(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def notebook_text(nb: Any) -> str:
    """All text of an executed notebook's outputs, joined."""
    return "\n".join(cell_text(cell) for cell in nb.cells)


# --------------------------------------------------------------------------------------------
# Jupyter servers
# --------------------------------------------------------------------------------------------


@dataclass
class JupyterServer:
    """A running ``jupyter lab`` / ``jupyter notebook`` server started by the harness."""

    app: str  # "lab" or "notebook"
    url: str  # base URL with a trailing slash, e.g. "http://127.0.0.1:41234/"
    token: str
    root_dir: Path
    process: subprocess.Popen[bytes]
    log_path: Path
    env: JupyterEnv
    _children: set[int] = field(default_factory=set, repr=False)

    # URLs ------------------------------------------------------------------------------------
    def url_for(self, path: str, **query: str) -> str:
        """Absolute URL of ``path`` (relative to the base URL) with the token appended."""
        params = "&".join(f"{k}={v}" for k, v in {**query, "token": self.token}.items())
        sep = "&" if "?" in path else "?"
        return f"{self.url}{path.lstrip('/')}{sep}{params}"

    def notebook_url(self, path: str, app: str | None = None) -> str:
        """URL opening notebook ``path`` (relative to ``root_dir``) in JupyterLab or Notebook 7.

        ``app`` defaults to the server's app: ``lab`` -> ``/lab/tree/<path>?reset`` (``reset`` starts
        from an empty workspace, so notebooks of earlier tests are not re-opened), ``notebook`` ->
        ``/notebooks/<path>``.
        """
        app = app or self.app
        quoted = urllib.request.pathname2url(path)
        if app == "lab":
            return self.url_for(f"lab/tree/{quoted.lstrip('/')}?reset")
        return self.url_for(f"notebooks/{quoted.lstrip('/')}")

    # Files -----------------------------------------------------------------------------------
    def copy_in(self, src: str | os.PathLike[str], dest: str | None = None) -> Path:
        """Copy a file or directory into the server root (``dest`` relative to it); return the new path."""
        src_path = Path(src)
        target = self.root_dir / (dest or src_path.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        if src_path.is_dir():
            shutil.copytree(src_path, target, dirs_exist_ok=True)
        else:
            shutil.copy2(src_path, target)
        return target

    def make_notebook(self, name: str, cells: Sequence[str | Mapping[str, Any]] = (), **kw: Any) -> Path:
        """Create notebook ``name`` (relative to ``root_dir``) with ``cells``; see :func:`make_notebook`."""
        return make_notebook(self.root_dir / name, cells, **kw)

    # REST API --------------------------------------------------------------------------------
    def api(self, method: str, path: str, body: Any = None, timeout: float = 30) -> Any:
        """Call the server's REST API (``path`` like ``"api/kernels"``); return the decoded JSON."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            f"{self.url}{path.lstrip('/')}",
            data=data,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def kernels(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api("GET", "api/kernels")
        return result

    def shutdown_kernels(self) -> None:
        """Shut down every session and kernel of this server (browser tests call it between tests)."""
        with contextlib.suppress(Exception):
            for s in self.api("GET", "api/sessions"):
                with contextlib.suppress(Exception):
                    self.api("DELETE", f"api/sessions/{s['id']}")
        with contextlib.suppress(Exception):
            for k in self.kernels():
                with contextlib.suppress(Exception):
                    self.api("DELETE", f"api/kernels/{k['id']}")

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status_ok(url: str, token: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}api/status?token={token}", timeout=5) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _descendants(pid: int) -> set[int]:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a gpumem dependency
        return set()
    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def _kill_pids(pids: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _stop_server(server: JupyterServer) -> None:
    proc = server.process
    children = server._children | _descendants(proc.pid)
    if proc.poll() is None:
        server.shutdown_kernels()
        with contextlib.suppress(Exception):
            server.api("POST", "api/shutdown", timeout=10)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    # Kernels run in their own sessions: make sure none outlives the server.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    _kill_pids(children, signal.SIGKILL)


@contextlib.contextmanager
def start_jupyter_server(
    app: str = "lab",
    *,
    root_dir: Path,
    env: JupyterEnv,
    extra_args: Sequence[str] = (),
    timeout: float = SERVER_START_TIMEOUT,
) -> Iterator[JupyterServer]:
    """Start ``jupyter lab`` (``app="lab"``) or Notebook 7 (``app="notebook"``) and stop it on exit.

    It listens on 127.0.0.1 on a free port with a random token, serves ``root_dir``, runs kernels with
    ``sys.executable`` and keeps all its state in ``env``'s temporary directories.
    """
    if app not in ("lab", "notebook"):
        raise ValueError(f"app must be 'lab' or 'notebook', not {app!r}")
    module = "jupyterlab" if app == "lab" else "notebook"
    root_dir.mkdir(parents=True, exist_ok=True)
    last_error = ""
    for attempt in range(3):
        port, token = _free_port(), secrets.token_hex(24)
        url = f"http://127.0.0.1:{port}/"
        log_path = env.base / f"{app}-server-{port}.log"
        cmd = [
            sys.executable,
            "-m",
            module,
            "--no-browser",
            "--ServerApp.open_browser=False",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root_dir}",
            "--ServerApp.disable_check_xsrf=True",
            # window.jupyterapp lets the helpers read the kernel's state from the front end.
            *(
                ["--LabApp.news_url=", "--LabApp.expose_app_in_browser=True"]
                if app == "lab"
                else ["--JupyterNotebookApp.expose_app_in_browser=True"]
            ),
            "--ServerApp.shutdown_no_activity_timeout=0",
            "--KernelSpecManager.ensure_native_kernel=False",
            "--MappingKernelManager.cull_idle_timeout=0",
            *extra_args,
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")
        log_file = open(log_path, "wb")  # noqa: SIM115 - kept open for the server's lifetime
        proc = subprocess.Popen(
            cmd,
            cwd=root_dir,
            env=env.env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        server = JupyterServer(
            app=app, url=url, token=token, root_dir=root_dir, process=proc, log_path=log_path, env=env
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None and not _status_ok(url, token):
            time.sleep(0.25)
        if proc.poll() is None and _status_ok(url, token):
            try:
                yield server
            finally:
                _stop_server(server)
                log_file.close()
            return
        last_error = f"exit code {proc.poll()}" if proc.poll() is not None else f"no answer in {timeout:.0f}s"
        tail = server.log_tail()
        _stop_server(server)
        log_file.close()
        last_error += f"; log tail:\n{tail}"
        if "address already in use" not in tail.lower():
            break
        del attempt
    raise RuntimeError(f"jupyter {app} did not start: {last_error}")


@pytest.fixture(scope="session")
def jupyter_server(tmp_path_factory: pytest.TempPathFactory, jupyter_env: JupyterEnv) -> Iterator[JupyterServer]:
    """A JupyterLab server for the whole session; ``root_dir`` is a fresh temporary directory."""
    with start_jupyter_server("lab", root_dir=tmp_path_factory.mktemp("lab-root"), env=jupyter_env) as s:
        yield s


@pytest.fixture(scope="session")
def notebook_server(tmp_path_factory: pytest.TempPathFactory, jupyter_env: JupyterEnv) -> Iterator[JupyterServer]:
    """A Notebook 7 server for the whole session; ``root_dir`` is a fresh temporary directory."""
    with start_jupyter_server("notebook", root_dir=tmp_path_factory.mktemp("nb7-root"), env=jupyter_env) as s:
        yield s


# --------------------------------------------------------------------------------------------
# Browser (Playwright sync API + Debian chromium)
# --------------------------------------------------------------------------------------------


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
    console: list[str] = []
    page.on("console", lambda msg: console.append(f"[{msg.type}] {msg.text}"))
    page.on("pageerror", lambda exc: console.append(f"[pageerror] {exc}"))
    page.gpumem_console = console  # type: ignore[attr-defined]
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


def console_messages(page: Page) -> list[str]:
    """Browser console lines collected so far for a ``browser_page``."""
    messages: list[str] = getattr(page, "gpumem_console", [])
    return messages


# --------------------------------------------------------------------------------------------
# Driving JupyterLab / Notebook 7
# --------------------------------------------------------------------------------------------

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
