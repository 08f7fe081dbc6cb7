"""Smoke tests of the harness's real-kernel helpers and its isolated Jupyter environment."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from _harness import JupyterEnv, make_notebook, notebook_text, run_notebook

pytestmark = pytest.mark.kernel


def test_run_notebook_in_a_real_kernel(tmp_path: Path, jupyter_env: JupyterEnv) -> None:
    path = make_notebook(
        tmp_path / "smoke.ipynb",
        [
            "print(6*7)",
            "import sys, os\nprint(sys.executable)\nprint(os.getcwd())",
            {"cell_type": "markdown", "source": "# a heading"},
            "get_ipython().__class__.__name__",
        ],
    )
    nb = run_notebook(path, jupyter_env=jupyter_env, timeout=120)
    text = notebook_text(nb)
    assert "42" in nb.cells[0].outputs[0]["text"]
    assert sys.executable in text  # the kernel runs this interpreter
    assert str(tmp_path) in text  # and starts in the notebook's directory
    assert "ZMQInteractiveShell" in text


def test_kernelspec_points_at_this_python(jupyter_env: JupyterEnv) -> None:
    spec = json.loads((jupyter_env.kernels_dir / "python3" / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable
    assert str(Path(__file__).resolve().parents[2] / "src") in spec["env"]["PYTHONPATH"]
