"""The shipped notebooks run top to bottom in a real kernel: the demo anywhere, the GPU tour on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from _harness import JupyterEnv, cuda_status, notebook_text, run_notebook

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


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
    assert "weights = torch.randn" in text  # the history names the cell by its first line
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
