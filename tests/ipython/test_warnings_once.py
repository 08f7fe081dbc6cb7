"""A warning appears under the cell that caused it, in a real IPython shell: not under the unrelated cells
after it, again when the condition worsens; what still holds is listed by ``%gpumem status``.

The CUDA side is a fake allocator that places blocks in segments as PyTorch's does (the cells drive
it as ``src``); the hooks, reports and magics are the real ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from _harness import gpumem_loaded, run_cell_capture, walk_cpu_tensors
from gpumem.ipython import extension as _extension
from gpumem.testing import GIB, MIB, FakeSource


@pytest.fixture
def shell(ip: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    source = FakeSource(segments=True)
    with gpumem_loaded(ip, source) as loaded:
        loaded.user_ns.update(src=source, GIB=GIB, MIB=MIB)
        yield loaded


def texts(cap: Any) -> list[str]:
    return [output.data.get("text/plain", "") for output in cap.outputs]


def report_html(cap: Any) -> str:
    (html,) = [o.data["text/html"] for o in cap.outputs if "gpumem-report" in o.data.get("text/html", "")]
    return html


FRAGMENT = (
    "for h in [src.allocate(GIB) for _ in range(12)]:\n"
    "    src.free(h)\n"
    "parts = [src.allocate(600 * MIB) for _ in range(12)]"
)
FRAGMENTED = "cuda:0: 5.0 GiB of the 12.0 GiB reserved is free but in 12 pieces, the largest 424.0 MiB"


def test_automatic_mode_tells_fragmentation_once(shell: Any) -> None:
    run_cell_capture(shell, "%gpumem auto on")
    _result, cap = run_cell_capture(shell, FRAGMENT)
    (line,) = texts(cap)
    assert FRAGMENTED in line and "would return none of it" in line
    assert "%env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in line
    for cell in ("x = 1", "y = src.allocate(MIB)", "print('unrelated')"):
        _result, cap = run_cell_capture(shell, cell)
        assert not [text for text in texts(cap) if "gpumem" in text], cell  # standing: not repeated
    _result, cap = run_cell_capture(shell, "%gpumem status")
    (standing,) = [line for line in cap.stdout.splitlines() if line.startswith("  standing ")]
    assert "5.0 GiB of the 12.0 GiB reserved is free but in 13 pieces" in standing  # + the 1 MiB's small segment
    _result, cap = run_cell_capture(shell, FRAGMENT.replace("range(12)", "range(6)").replace("parts", "more"))
    (line,) = texts(cap)
    assert "7.5 GiB of the 18.0 GiB reserved is free but in 19 pieces" in line  # worse: told again
    _result, cap = run_cell_capture(shell, "for h in parts + more:\n    src.free(h)\n%gpumem free")
    assert "fragment" not in cap.stdout + "".join(texts(cap))
    _result, cap = run_cell_capture(shell, "%gpumem status")
    assert "  standing none" in cap.stdout


def test_the_transient_and_two_small_tensors_get_no_warning(shell: Any) -> None:
    """x = 1 GiB, a 2 GiB transient freed, two 64 MiB tensors: 1.9 GiB free in one block (seen on an H200)."""
    run_cell_capture(shell, "%gpumem auto on")
    for cell in (
        "x = src.allocate(GIB)",
        "src.transient(2 * GIB)",
        "a = src.allocate(64 * MIB)\nb = src.allocate(64 * MIB)",
        "z = 1",
        "%%gpumem\nw = 2",
    ):
        _result, cap = run_cell_capture(shell, cell)
        assert not [text for text in texts(cap) if "fragment" in text or "⚠" in text], cell
    state = _extension.get_state()
    assert state is not None
    assert all(not record.warnings for record in state.tracker.history)


def test_graph_warning_under_the_cell_that_made_the_graphs_only(shell: Any) -> None:
    torch = pytest.importorskip("torch")
    walk_cpu_tensors()
    shell.user_ns.update(torch=torch, w=torch.randn(32, 32, requires_grad=True))
    _result, cap = run_cell_capture(shell, "%%gpumem\nouts = [(w @ w).sum() for _ in range(4)]\nh = src.allocate(MIB)")
    assert "<code>outs[0]</code> … <code>outs[3]</code> (4 elements) keep their whole autograd" in report_html(cap)
    for cell in ("%%gpumem\nh2 = src.allocate(8 * MIB)", "%%gpumem\nprint('unrelated')"):
        _result, cap = run_cell_capture(shell, cell)
        assert "autograd" not in report_html(cap), cell
    _result, cap = run_cell_capture(shell, "%gpumem status")
    assert "  standing `outs[0]` … `outs[3]` (4 elements) keep their whole autograd graphs alive" in cap.stdout
    _result, cap = run_cell_capture(shell, "%%gpumem\nouts.append((w @ w).sum())")
    assert "<code>outs[4]</code> (5 elements) keep their whole autograd" in report_html(cap)
    run_cell_capture(shell, "outs = [o.item() for o in outs]")
    _result, cap = run_cell_capture(shell, "%gpumem status")
    assert "  standing none" in cap.stdout
