"""``%gpumem monitor`` / ``%gpumem sidebar`` in a real kernel: outputs, options, errors, closing."""

from __future__ import annotations

from pathlib import Path

import pytest

from _harness import JupyterEnv, cell_text, make_notebook, run_notebook

pytestmark = pytest.mark.kernel

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
SIDEBAR = "application/vnd.gpumem.sidebar+json"


def _mimes(cell: dict) -> set[str]:
    return {mime for out in cell.get("outputs", []) for mime in out.get("data", {})}


def test_monitor_and_sidebar_magics_in_a_kernel(tmp_path: Path, jupyter_env: JupyterEnv) -> None:
    cells = [
        "%load_ext gpumem",
        "%gpumem",
        "%gpumem monitor --window 1min --threshold 80% --host --refresh 4",
        (
            "import threading, gpumem.panel.writer as gw\n"
            "p = gw.open_panels()[-1]\n"
            "print('options', p.options.window_s, round(p.options.threshold.fraction, 2), p.options.show_host,"
            " p.options.refresh_hz)\n"
            "print('panels', len(gw.open_panels()))"
        ),
        "%gpumem monitor --window soon",
        "%gpumem monitor --threshold 120%",
        "%gpumem sidebar",
        "print('panels', len(gw.open_panels()))",
        "%gpumem monitor --close",
        "print('writer', any(t.name == 'gpumem-panel-writer' for t in threading.enumerate()))",
        "%gpumem monitor\n%unload_ext gpumem",
        (
            "print('after unload', len(gw.open_panels()),"
            " any(t.name == 'gpumem-panel-writer' for t in threading.enumerate()))"
        ),
    ]
    nb = run_notebook(make_notebook(tmp_path / "magics.ipynb", cells), jupyter_env=jupyter_env, timeout=180,
                      allow_errors=True)  # fmt: skip
    out = [cell_text(cell) for cell in nb.cells]
    # Both panels were shown (bare %gpumem too), then closed: where each was, the note says so.
    for shown in (1, 2):
        assert WIDGET_VIEW not in _mimes(nb.cells[shown]), out[shown]
        assert out[shown].strip() == "gpumem panel closed (%gpumem monitor to open it again)", out[shown]
    assert "options 60.0 0.8 True 4.0" in out[3]
    assert "panels 2" in out[3]
    assert "window must be a duration such as 1min, 10min, 1h or all, not 'soon'" in out[4]
    assert "Traceback" not in out[4]
    assert "threshold: a share of capacity is between 0 and 100%, not '120%'" in out[5]
    assert SIDEBAR in _mimes(nb.cells[6]) or "inline" in out[6], out[6]
    assert "panels 3" in out[7]
    assert "Closed 3 panels." in out[8]
    assert "writer False" in out[9]
    assert "after unload 0 False" in out[11]
