"""In a real kernel: tracebacks of a %%gpumem cell show the user's header line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _harness import JupyterEnv, cell_text, make_notebook, run_notebook

pytestmark = pytest.mark.kernel

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_a_traceback_in_a_kernel_shows_the_users_header_line(tmp_path: Path, jupyter_env: JupyterEnv) -> None:
    cells = [
        "%load_ext gpumem",
        "%%gpumem --top 3\ndef divide(x):\n    return x / 0\ndivide(1)",
        "%%time\n%%gpumem -q\nmeasured = 1",
        "import gpumem\nprint(list(gpumem.history()['first_line']))",
    ]
    nb = run_notebook(
        make_notebook(tmp_path / "header.ipynb", cells), jupyter_env=jupyter_env, timeout=180, allow_errors=True
    )
    (error,) = [out for out in nb.cells[1].outputs if out.output_type == "error"]
    shown = _ANSI.sub("", "\n".join(error.traceback))
    assert "1 %%gpumem --top 3" in shown and "----> 4 divide(1)" in shown, shown
    assert "run_line_magic" not in shown, shown
    assert any(out.output_type == "display_data" for out in nb.cells[1].outputs)  # still measured
    assert "['def divide(x):', 'measured = 1']" in cell_text(nb.cells[3])
