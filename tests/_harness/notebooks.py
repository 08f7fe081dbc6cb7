"""Isolated Jupyter directories with a kernelspec on this interpreter; notebooks written and run in real kernels."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from _harness.config import SRC_DIR


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


def _nbformat() -> Any:
    """nbformat (untyped), imported only where notebooks are made or read: the GPU machine may lack it."""
    import nbformat

    return nbformat


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
    v4 = _nbformat().v4
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
    _nbformat().write(nb, str(out))
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
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = _nbformat().read(str(nb_or_path), as_version=4) if isinstance(nb_or_path, (str, os.PathLike)) else nb_or_path
    if cwd is None:
        cwd = Path(nb_or_path).parent if isinstance(nb_or_path, (str, os.PathLike)) else Path.cwd()
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
