"""The shipped notebooks run top to bottom in a real kernel: the demo anywhere, the GPU tour on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from _harness import JupyterEnv, cuda_status, notebook_text, run_notebook

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def notebook_text_of(cell) -> str:
    """Every text output of one cell (stdout, text/plain, text/html)."""
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", ""))
        data = out.get("data", {})
        parts.extend(str(data.get(kind, "")) for kind in ("text/plain", "text/html"))
    return "\n".join(parts)


def _errors(nb) -> list[str]:
    return [
        f"{out.get('ename')}: {out.get('evalue')}"
        for cell in nb.cells
        if "raises-exception" not in cell.get("metadata", {}).get("tags", [])
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]


@pytest.mark.kernel
def test_demo_runs_without_errors_and_tells_the_truth(tmp_path: Path, jupyter_env: JupyterEnv) -> None:
    nb = run_notebook(NOTEBOOKS / "demo.ipynb", jupyter_env=jupyter_env, cwd=tmp_path, timeout=300)
    assert _errors(nb) == []
    text = notebook_text(nb)
    assert "gpumem status" in text
    assert "torch unavailable" not in text  # status runs after `import torch`, so it reads the allocator
    assert "weights = torch.randn" in text  # the history names the cell by its first line
    leak_cells = [cell for cell in nb.cells if cell.source.startswith('kept = globals().get("kept"')]
    assert len(leak_cells) == 3  # "as if you had run one cell three times"
    leak_texts = [notebook_text_of(cell) for cell in leak_cells]
    assert "possible leak on re-run" not in leak_texts[0] + leak_texts[1]
    assert "possible leak on re-run: this cell has run 3 times" in leak_texts[2], leak_texts[2]
    what = "cuda:0 allocated memory" if cuda_status()["available"] else "host memory (RSS)"
    assert what in leak_texts[2]
    (history_cell,) = [cell for cell in nb.cells if cell.source.strip() == "%gpumem history"]
    history_text = notebook_text_of(history_cell)
    assert "kept = globals()" in history_text and "auto on --threshold" not in history_text  # own commands left out
    assert "Held by IPython" in text and "Out[" in text
    assert "released IPython references" in text
    panel_outputs = [
        out
        for cell in nb.cells
        if cell.source.startswith("%gpumem monitor")
        for out in cell.outputs
        if "application/vnd.jupyter.widget-view+json" in out.get("data", {})
    ]
    assert panel_outputs, "the panel is displayed as a widget"
    if not cuda_status()["available"]:
        assert "CUDA is not in use" in text


@pytest.mark.gpu
def test_gpu_tour_finds_each_leak(tmp_path: Path, jupyter_env: JupyterEnv) -> None:
    nb = run_notebook(NOTEBOOKS / "gpu_tour.ipynb", jupyter_env=jupyter_env, cwd=tmp_path, timeout=600)
    assert _errors(nb) == []
    text = notebook_text(nb)
    assert "losses" in text and "autograd graph" in text
    assert "possible leak on re-run" in text
    assert "OutOfMemoryError" in text
    assert "%gpumem free --deep" in text
