"""The shipped notebooks run top to bottom in a real kernel: the demo anywhere, the GPU tour on a GPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from _harness import JupyterEnv, artifacts_path, cuda_status, notebook_text, run_notebook
from gpumem.ipython.panel_magics import CLOSED_NOTE

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def notebook_text_of(cell) -> str:
    """Every text output of one cell (stdout, text/plain, text/html, an error's name and message)."""
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", ""))
        parts.append(f"{out.get('ename', '')}: {out.get('evalue', '')}" if "ename" in out else "")
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
    (predict_cell,) = [cell for cell in nb.cells if cell.source.startswith("%%gpumem --predict")]
    assert "gpumem --predict: dry run on fake tensors" in notebook_text_of(predict_cell)
    assert "fits? yes" in notebook_text_of(predict_cell)
    (batch_cell,) = [cell for cell in nb.cells if cell.source.startswith("%%gpumem --batch")]
    assert "largest bs that fits:" in notebook_text_of(batch_cell)
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


MIB = 2**20
GIB = 2**30
# "before fix [loss graph]: allocated 1,234.5 MiB (1,294,467,072 bytes)", printed by the tour's figure()
_FIGURE = re.compile(r"^(before|after) fix \[([^\]]+)\]: .* \(([\d,]+) bytes\)$", re.MULTILINE)
_END = re.compile(r"^end of the tour: allocated .* \(([\d,]+) bytes\)$", re.MULTILINE)
# The tour's model: 6 x Linear(2048, 2048), float32; its gradients are one tensor per parameter.
_GRADIENT_BYTES = 6 * (2048 * 2048 + 2048) * 4


def _sections(nb) -> dict[str, list]:
    """The tour's code cells by section, keyed by the number of their "## N." heading."""
    sections: dict[str, list] = {}
    current = "0"
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("## "):
            current = cell.source[3:].split(".", 1)[0]
        elif cell.cell_type == "code":
            sections.setdefault(current, []).append(cell)
    return sections


def _figures(nb) -> dict[tuple[str, str], int]:
    """(before|after, section label) -> bytes, from the stream outputs of every cell."""
    figures: dict[tuple[str, str], int] = {}
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            for phase, label, nbytes in _FIGURE.findall(out.get("text", "")):
                assert (phase, label) not in figures, f"{phase} fix [{label}] printed twice"
                figures[phase, label] = int(nbytes.replace(",", ""))
    return figures


@pytest.mark.gpu
def test_gpu_tour_finds_each_leak(tmp_path: Path, jupyter_env: JupyterEnv) -> None:
    nb = run_notebook(NOTEBOOKS / "gpu_tour.ipynb", jupyter_env=jupyter_env, cwd=tmp_path, timeout=600)
    # What the tour printed, kept for reading when an assertion below fails on the GPU machine.
    (artifacts_path() / "gpu_tour_outputs.txt").write_text(notebook_text(nb), encoding="utf-8")
    assert _errors(nb) == []
    figures = _figures(nb)
    drop = {label: figures["before", label] - figures["after", label] for _phase, label in figures}
    assert len(drop) == 8, sorted(figures)
    sections = {number: [notebook_text_of(cell) for cell in cells] for number, cells in _sections(nb).items()}
    found = {number: "\n".join(texts) for number, texts in sections.items()}

    # 1. 20 retained graphs of 7 saved 4 MiB activations each, and the 20 losses (512-byte blocks).
    assert 20 * 28 * MIB <= drop["loss graph"] <= 20 * (28 * MIB + 512), drop
    assert "losses[0]" in found["1"] and "autograd graph" in found["1"], found["1"]
    # 2. Three runs of a cell that keeps 512 MiB, recognised on the third.
    assert drop["leak on re-run"] == 3 * 512 * MIB, drop
    leak_runs = sections["2"][:3]
    assert "possible leak on re-run" not in leak_runs[0] + leak_runs[1]
    assert "possible leak on re-run: this cell has run 3 times" in leak_runs[2], leak_runs[2]
    assert "cuda:0 allocated memory" in leak_runs[2]
    # 3. A 2 GiB temporary against eight 256 MiB ones (the reductions add a few KiB to both).
    assert figures["before", "transient peak"] >= 2 * GIB
    assert figures["after", "transient peak"] <= 256 * MIB + MIB
    assert re.search(r"peak\s+\+2\.0 GiB", sections["3"][0]), sections["3"][0]
    # 4. The module's cached x @ x.T, named by who.
    assert drop["module cache"] == 256 * MIB, drop
    assert "att.cache 256.0 MiB (tensor attribute of a module, not a parameter or buffer)" in found["4"]
    # 5. The closure's 300 MiB, named by who under the function's name.
    assert drop["closure"] == 300 * MIB, drop
    assert re.search(r"report\s+function\s+\S+\s+300\.0 MiB", found["5"]), found["5"]
    # 6. Every .grad of the model, and the report's note naming the fix.
    assert drop["gradients"] == _GRADIENT_BYTES, drop
    assert "zero_grad(set_to_none=True)" in sections["6"][0], sections["6"][0]
    # 7. Eight batches' graphs: six saved 8 MiB layer inputs each; the 8 MiB outputs stay.
    assert drop["validation"] == 8 * 6 * 8 * MIB, drop
    graphs_kept = "keep their whole autograd graphs alive"  # the warning, not the by-kind label
    assert graphs_kept in sections["7"][0] and "val_outputs" in sections["7"][0], sections["7"][0]
    assert graphs_kept not in sections["7"][1], sections["7"][1]
    predicted, _, searched = sections["10"]
    assert "gpumem --predict: dry run on fake tensors" in predicted and "cuda:0:" in predicted, predicted
    assert "3 forward passes" in predicted and "the memory free on the device now" in predicted, predicted
    assert "largest bs that fits:" in searched, searched
    # 8. `big` and the copy IPython keeps in Out, explained after the error and released by free --deep.
    assert drop["out of memory"] == 4 * GIB, drop
    assert "OutOfMemoryError" in found["8"] and "gpumem: CUDA out of memory on cuda:0" in found["8"]
    assert "Held by IPython" in found["8"] and "%gpumem free --deep" in found["8"]
    # 9. The panel was shown, and once closed its output says so.
    (panel_cell,) = [cell for cell in _sections(nb)["9"] if cell.source == "%gpumem monitor"]
    assert notebook_text_of(panel_cell).strip() == CLOSED_NOTE
    # The tour leaves the GPU as it found it: nothing allocated (workspaces released too).
    (end,) = _END.findall(notebook_text(nb))
    assert int(end.replace(",", "")) <= MIB, end


RECORD_SESSION = Path(__file__).resolve().parents[2] / "benchmarks" / "record_session.py"


@pytest.mark.kernel
def test_the_session_recording_runs_and_exports(tmp_path: Path, jupyter_env: JupyterEnv) -> None:
    """benchmarks/record_session.py (what made docs/sessions/h200-training.json) runs notebooks/gpu_session.ipynb
    in a real kernel and exports it: here with host memory only; on a GPU with cuda:0's curves, the leak named
    by %gpumem who and the out-of-memory error explained."""
    import nbformat

    from gpumem.core.sessions.session_file import read_session

    done = subprocess.run(
        [sys.executable, str(RECORD_SESSION), "--out", str(tmp_path), "--name", "session.json"],
        env=jupyter_env.env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = read_session(tmp_path / "session.json")
    assert len(data.cells) >= 7
    assert any(mark.label.startswith("free") for mark in data.marks)
    nb = nbformat.read(tmp_path / "gpu_session.executed.ipynb", as_version=4)
    (artifacts_path() / "gpu_session_outputs.txt").write_text(notebook_text(nb), encoding="utf-8")
    assert _errors(nb) == []  # the out-of-memory cell is tagged raises-exception: it must raise
    failed = [cell for cell in nb.cells if "raises-exception" in cell.get("metadata", {}).get("tags", [])]
    assert [out.get("output_type") for out in failed[0].outputs].count("error") == 1
    if not cuda_status()["available"]:
        assert "host/rss" in data.timeline.values
        return
    assert {"cuda:0/allocated", "cuda:0/reserved", "cuda:0/used"} <= set(data.timeline.values)
    who = next(cell for cell in nb.cells if cell.source.strip() == "%gpumem who")
    assert "predictions" in notebook_text_of(who) and "saved by its autograd graphs" in notebook_text_of(who)
    assert "CUDA out of memory on cuda:0" in notebook_text_of(failed[0])
