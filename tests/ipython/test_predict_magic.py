"""``%%gpumem --predict`` / ``--capacity`` / ``--batch`` in a real IPython shell with real (CPU) torch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from IPython.core.error import UsageError

from _harness import gpumem_loaded, run_cell_capture

torch = pytest.importorskip("torch")

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512))
opt = torch.optim.AdamW(model.parameters())
bs = 16
"""

STEP = """x = torch.randn(bs, 512)
loss = model(x).pow(2).mean()
loss.backward()
opt.step()
opt.zero_grad()
"""


@pytest.fixture
def shell(ip: Any) -> Iterator[Any]:
    with gpumem_loaded(ip) as loaded:
        run_cell_capture(loaded, SETUP, raise_on_error=True)
        yield loaded


def _text(cap: Any) -> str:
    return "\n".join(output.data.get("text/plain", "") for output in cap.outputs) + cap.stdout


def test_predict_shows_the_figures_and_runs_nothing(shell: Any) -> None:
    weight = shell.user_ns["model"][0].weight.detach().clone()
    result, cap = run_cell_capture(shell, "%%gpumem --predict --capacity 24GiB\n" + STEP)
    assert result.success
    text = _text(cap)
    assert "gpumem --predict: dry run on fake tensors in" in text
    assert "cpu:" in text and "optimizer state" in text
    assert "fits? yes" in text and "(--capacity)" in text
    assert "copied as fakes: " in text and "model" in text
    assert any("text/html" in output.data for output in cap.outputs)
    assert "x" not in shell.user_ns and "loss" not in shell.user_ns
    assert not shell.user_ns["opt"].state
    assert shell.user_ns["model"][0].weight.grad is None
    assert torch.equal(shell.user_ns["model"][0].weight, weight)


def test_a_capacity_too_small_says_no(shell: Any) -> None:
    _, cap = run_cell_capture(shell, "%%gpumem --predict --capacity 1MiB\n" + STEP)
    assert "fits? NO" in _text(cap) and "short" in _text(cap)


def test_a_refusal_names_the_cell_line(shell: Any) -> None:
    result, cap = run_cell_capture(shell, "%%gpumem --predict\ny = model(torch.randn(2, 512))\nprint(y.sum().item())\n")
    assert result.success
    assert "stopped at line 3" in _text(cap) and ".item()" in _text(cap)
    assert "y" not in shell.user_ns


def test_without_a_gpu_or_capacity_fits_is_not_answered(shell: Any) -> None:
    _, cap = run_cell_capture(shell, "%%gpumem --predict\n" + STEP)
    assert "fits? not answered" in _text(cap) and "--capacity" in _text(cap)


def test_batch_search_with_capacity(shell: Any) -> None:
    result, cap = run_cell_capture(shell, "%%gpumem --batch bs=1..100000 --capacity 64MiB\n" + STEP)
    assert result.success
    text = _text(cap)
    assert "largest bs that fits:" in text
    assert "memory per extra bs: about" in text
    runs = int(text.split(": ", 1)[1].split(" dry runs")[0])
    assert runs < 10
    assert shell.user_ns["bs"] == 16


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--batch bs=0..10", "LOW must be at least 1"),
        ("--batch bs", "NAME=LOW..HIGH"),
        ("--capacity 24GiB", "goes with --predict"),
        ("--predict --capacity lots", "expected a size"),
        ("--predict --trace", "cannot be combined"),
    ],
)
def test_bad_options_are_one_line_errors(shell: Any, line: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        shell.run_cell_magic("gpumem", line, STEP)


def test_a_batch_name_the_cell_sets_is_refused(shell: Any) -> None:
    _, cap = run_cell_capture(shell, "%%gpumem --batch bs=1..8 --capacity 1GiB\nbs = 4\n" + STEP)
    assert "the cell sets bs itself" in cap.stderr + _text(cap)


def test_predict_is_not_measured_as_a_cell(shell: Any) -> None:
    from gpumem.ipython import extension

    state = extension.get_state()
    assert state is not None
    before = len(state.tracker.history)
    run_cell_capture(shell, "%%gpumem --predict --capacity 1GiB\n" + STEP)
    assert len(state.tracker.history) == before


def test_magics_inside_the_cell_are_refused_by_line(shell: Any) -> None:
    """``%time`` would run its statement for real, on the user's objects."""
    _, cap = run_cell_capture(shell, "%%gpumem --predict\nx = torch.randn(2, 512)\n%time y = model(x)\n")
    assert "stopped at line 3" in _text(cap) and "magics" in _text(cap)
    assert "y" not in shell.user_ns and "x" not in shell.user_ns


def test_a_syntax_error_is_named_by_line(shell: Any) -> None:
    _, cap = run_cell_capture(shell, "%%gpumem --predict\nx = 1\ny = (\n")
    assert "stopped at line 3" in _text(cap) and "not valid Python" in _text(cap)


def test_the_python_api_prints_the_same_report(shell: Any) -> None:
    cell = (
        "import gpumem\n"
        "def step(n):\n    model(torch.randn(n, 512)).sum().backward()\n"
        "print(gpumem.predict(step, 8))\n"
        "print(gpumem.search_batch(step, 1, 4096, capacity='32MiB'))\n"
    )
    result, cap = run_cell_capture(shell, cell)
    assert result.success, cap.stderr
    assert "gpumem --predict: dry run on fake tensors" in cap.stdout
    assert "largest n that fits:" in cap.stdout
    assert shell.user_ns["model"][0].weight.grad is None
