"""JupyterLab and Notebook 7 servers on a free local port, stopped with every kernel they started."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from _harness.config import SERVER_START_TIMEOUT
from _harness.notebooks import JupyterEnv, make_notebook


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


def _server_command(app: str, port: int, token: str, root_dir: Path, extra_args: Sequence[str]) -> list[str]:
    """The command line of a quiet local server that never shuts itself down or culls kernels."""
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab" if app == "lab" else "notebook",
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
    return cmd


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
    root_dir.mkdir(parents=True, exist_ok=True)
    last_error = ""
    for attempt in range(3):
        port, token = _free_port(), secrets.token_hex(24)
        url = f"http://127.0.0.1:{port}/"
        log_path = env.base / f"{app}-server-{port}.log"
        cmd = _server_command(app, port, token, root_dir, extra_args)
        log_file = log_path.open("wb")  # kept open for the server's lifetime
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
