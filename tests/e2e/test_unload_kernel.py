"""In a real kernel: unloading leaves nothing of gpumem running."""

from __future__ import annotations

from pathlib import Path

import pytest

from _harness import JupyterEnv, cell_text, make_notebook, run_notebook

pytestmark = pytest.mark.kernel

_THREADS = "sorted({t.name for t in threading.enumerate() if t.name.startswith('gpumem') and t.is_alive()})"


def test_unload_closes_every_panel_and_thread_gpumem_made(tmp_path: Path, jupyter_env: JupyterEnv) -> None:
    cells = [
        "%load_ext gpumem",
        "import threading, gpumem\np = gpumem.Panel()\np",  # made through the API, not a magic
        "%reload_ext gpumem",
        "print('first closed', p.closed)\np = gpumem.Panel()\np",
        "%gpumem auto on",
        "with gpumem.measure('a block'):\n    pass",
        f"print('running', {_THREADS})",
        "%unload_ext gpumem",
        (
            "import gpumem.panel.widget as w\n"
            "print('open', len(w.open_panels()), p.closed)\n"
            f"print('left', {_THREADS})"
        ),
    ]
    nb = run_notebook(make_notebook(tmp_path / "unload.ipynb", cells), jupyter_env=jupyter_env, timeout=180)
    out = [cell_text(cell) for cell in nb.cells]
    assert "first closed True" in out[3], out  # a reload is an unload: it closed the first panel
    assert "'gpumem-panel-writer'" in out[6] and "'gpumem-sampler'" in out[6], out[6]
    assert "open 0 True" in out[8], out[8]
    assert "left []" in out[8], out[8]
    assert all("Traceback" not in text for text in out), out
