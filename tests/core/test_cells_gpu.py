"""%%gpumem and automatic mode on a real CUDA GPU, with real torch, NVML and the real holders walk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from _harness import run_cell_capture
from gpumem.core.cells import CellRecord, DeviceChange
from gpumem.ipython import extension as _extension

pytestmark = pytest.mark.gpu

GIB = 1 << 30
MIB = 1 << 20
SRC = str(Path(__file__).resolve().parents[2] / "src")


def last() -> CellRecord:
    state = _extension.get_state()
    assert state is not None
    return state.tracker.history[-1]


def device0(record: CellRecord) -> DeviceChange:
    return next(change for change in record.devices if change.device == 0)


def test_one_gib_exactly(gpu: Any) -> None:
    result, cap = run_cell_capture(gpu, "%%gpumem\nx = torch.empty(1 << 30, dtype=torch.uint8, device='cuda:0')")
    assert result.success
    record = last()
    change = device0(record)
    assert change.allocated_delta_bytes == GIB
    assert change.peak_exact and change.peak_above_start_bytes == GIB
    assert change.reserved_delta_bytes >= GIB
    assert change.used_delta_bytes is not None  # NVML on a real GPU
    assert abs(change.used_delta_bytes - change.reserved_delta_bytes) < 64 * MIB
    assert [(v.name, v.nbytes) for v in record.variables] == [("x", GIB)]
    html = cap.outputs[-1].data["text/html"]
    assert "cuda:0" in html and "+1.0 GiB" in html


def test_transient_two_gib_is_the_peak_with_no_delta(gpu: Any) -> None:
    cell = "%%gpumem\ny = torch.empty(2 << 30, dtype=torch.uint8, device='cuda:0')\ny.fill_(1)\ndel y"
    assert run_cell_capture(gpu, cell)[0].success
    change = device0(last())
    assert change.allocated_delta_bytes == 0
    assert change.peak_exact and change.peak_above_start_bytes == 2 * GIB


def test_leak_warning_when_a_cell_appends_cuda_tensors(gpu: Any) -> None:
    gpu.user_ns["cache"] = []
    assert gpu.run_cell("%gpumem auto on").success
    cell = "cache.append(torch.empty(64 << 20, dtype=torch.uint8, device='cuda:0'))"
    outputs = [run_cell_capture(gpu, cell)[1].outputs for _ in range(3)]
    (line,) = [output.data["text/plain"] for output in outputs[2]]
    assert "possible leak on re-run" in line and "64.0 MiB" in line
    leak = [w for w in last().warnings if w.kind == "leak"]
    assert leak and "(+64.0 MiB, +64.0 MiB, +64.0 MiB)" in leak[0].message


def test_graph_warning_on_appending_the_loss(gpu: Any) -> None:
    setup = "w = torch.randn(1024, 1024, device='cuda:0', requires_grad=True)\nlosses = []"
    assert gpu.run_cell(setup).success
    result, cap = run_cell_capture(gpu, "%%gpumem\nloss = (w @ w).relu().sum()\nlosses.append(loss)")
    assert result.success
    graph = [w for w in last().warnings if w.kind == "graph"]
    assert graph and "`losses[0]`" in graph[0].message and ".item()" in graph[0].message
    assert ".detach()" in cap.outputs[-1].data["text/html"]
    # In automatic mode too, on the next run of the same cell.
    assert gpu.run_cell("%gpumem auto on").success
    _result, cap = run_cell_capture(gpu, "loss = (w @ w).relu().sum()\nlosses.append(loss)")
    assert any(w.kind == "graph" and "losses[1]" in w.message for w in last().warnings)
    assert any("autograd graph" in output.data["text/plain"] for output in cap.outputs)
    # With .item() nothing is kept alive.
    assert gpu.run_cell("losses = [l.item() for l in losses]\ndel loss").success
    assert run_cell_capture(gpu, "%%gpumem\nlosses.append((w @ w).relu().sum().item())")[0].success
    assert not [w for w in last().warnings if w.kind == "graph"]


def test_keep_peaks_leaves_the_users_counter_and_default_resets_it(gpu: Any) -> None:
    torch = gpu.user_ns["torch"]
    assert gpu.run_cell("t = torch.empty(1 << 30, dtype=torch.uint8, device='cuda:0'); del t").success
    user_peak = torch.cuda.max_memory_allocated(0)
    assert run_cell_capture(gpu, "%%gpumem --keep-peaks\ns = torch.ones(10, device='cuda:0')")[0].success
    assert torch.cuda.max_memory_allocated(0) == user_peak
    change = device0(last())
    assert not change.peak_exact and "lower bound" in change.peak_note
    assert run_cell_capture(gpu, "%%gpumem\ns2 = torch.ones(10, device='cuda:0')")[0].success
    assert torch.cuda.max_memory_allocated(0) < user_peak  # the documented cost of exact peaks
    assert device0(last()).peak_exact


def test_reset_inside_the_cell_is_reported(gpu: Any) -> None:
    assert gpu.run_cell("big = torch.empty(1 << 30, dtype=torch.uint8, device='cuda:0')").success
    cell = "%%gpumem\ndel big\ntorch.cuda.reset_peak_memory_stats(0)\nsmall = torch.ones(1 << 20, device='cuda:0')"
    result, cap = run_cell_capture(gpu, cell)
    assert result.success
    change = device0(last())
    assert not change.peak_exact
    assert change.peak_allocated_bytes >= change.allocated_before_bytes
    assert "peak counter was reset inside the cell" in cap.outputs[-1].data["text/html"]


def test_reset_after_an_unsampled_spike_is_reported(gpu: Any) -> None:
    assert gpu.run_cell("base = torch.empty(1 << 30, dtype=torch.uint8, device='cuda:0')").success
    cell = (
        "%%gpumem\n"
        "spike = torch.empty(4 << 30, dtype=torch.uint8, device='cuda:0'); del spike\n"
        "torch.cuda.reset_peak_memory_stats(0)\n"
        "more = torch.empty(2 << 30, dtype=torch.uint8, device='cuda:0')"
    )
    assert run_cell_capture(gpu, cell)[0].success
    change = device0(last())
    assert not change.peak_exact and "reset inside the cell" in change.peak_note
    assert change.peak_above_start_bytes >= 2 * GIB  # a lower bound; the true peak was 4 GiB above start


def test_measure_nested_in_a_measured_cell_keeps_the_cells_peak_exact(gpu: Any) -> None:
    """A gpumem.measure block inside a %%gpumem cell leaves the counters alone: both records are true."""
    cell = (
        "%%gpumem\n"
        "import gpumem\n"
        "spike = torch.empty(2 << 30, dtype=torch.uint8, device='cuda:0'); del spike\n"
        "with gpumem.measure('inner') as inner:\n"
        "    kept = torch.empty(1 << 30, dtype=torch.uint8, device='cuda:0')\n"
    )
    assert run_cell_capture(gpu, cell)[0].success
    outer = device0(last())
    assert outer.peak_exact and outer.peak_above_start_bytes == 2 * GIB and outer.allocated_delta_bytes == GIB
    inner = gpu.user_ns["inner"].record
    assert inner.keep_peaks and device0(inner).allocated_delta_bytes == GIB
    torch = gpu.user_ns["torch"]
    assert torch._C._cuda_resetPeakMemoryStats.__name__ != "counting_reset"  # unwrapped between cells


def test_a_device_past_the_last_is_refused(gpu: Any) -> None:
    torch = gpu.user_ns["torch"]
    missing = torch.cuda.device_count()
    result, cap = run_cell_capture(gpu, f"%%gpumem -d {missing}\nran = True")
    assert "no such device" in cap.stderr and "ran" not in gpu.user_ns
    assert not result.success


def test_out_of_memory_is_recorded(gpu: Any) -> None:
    result, _cap = run_cell_capture(gpu, "%%gpumem\nhuge = torch.empty(1 << 50, dtype=torch.uint8, device='cuda:0')")
    assert not result.success
    record = last()
    assert record.status == "out of memory" and record.error is not None
    assert record.error.startswith("OutOfMemoryError")


_FRESH = r"""
import json, sys
import torch
from IPython.core.interactiveshell import InteractiveShell
ip = InteractiveShell.instance()
ip.run_line_magic("load_ext", "gpumem")
ip.run_line_magic("gpumem", "auto on")
assert ip.run_cell("import torch\nx = 1").success
assert ip.run_cell("%%gpumem\ny = 2").success
initialized_before = torch.cuda.is_initialized()
assert ip.run_cell("%%gpumem\nz = torch.ones(256 << 20, dtype=torch.uint8, device='cuda:0')").success
from gpumem.ipython import extension as _extension
record = _extension.get_state().tracker.history[-1]
change = [c for c in record.devices if c.device == 0][0]
print(json.dumps({
    "initialized_before": initialized_before,
    "initialized_in_cell": change.initialized_in_cell,
    "allocated_delta": change.allocated_delta_bytes,
    "peak_exact": change.peak_exact,
    "peak_above_start": change.peak_above_start_bytes,
    "used_delta": change.used_delta_bytes,
    "reserved_delta": change.reserved_delta_bytes,
}))
"""


def test_cuda_first_used_inside_the_cell_and_never_by_the_extension() -> None:
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-c", _FRESH], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["initialized_before"] is False  # measuring cells never created a CUDA context
    assert data["initialized_in_cell"] is True
    assert data["allocated_delta"] == 256 * MIB
    assert data["peak_exact"] and data["peak_above_start"] == 256 * MIB
    assert data["used_delta"] is not None and data["used_delta"] > data["reserved_delta"]  # + the new context


# Fragmentation, measured from the allocator's segments ------------------------------------------------


def _texts(captured: Any) -> str:
    return "\n".join(output.data.get("text/plain", "") for output in captured.outputs) + captured.stdout


def _blocks(segment: dict[str, Any]) -> list[tuple[int, str]]:
    return [(block["size"], block["state"]) for block in segment["blocks"]]


@pytest.fixture
def no_expandable_segments() -> None:
    from gpumem.core.diagnoses.fragmentation import expandable_segments_on

    if expandable_segments_on():
        pytest.skip("expandable segments are on: the allocator does not fragment this way")


def _run_without_fragmentation_claims(shell: Any, cells: list[str]) -> None:
    """Each cell runs, and neither its output nor its record says anything about fragmentation."""
    for cell in cells:
        result, captured = run_cell_capture(shell, cell)
        assert result.success, cell
        assert "fragment" not in _texts(captured), cell
        assert not [w for w in last().warnings if w.kind == "fragmentation"], cell


@pytest.mark.usefixtures("no_expandable_segments")
def test_one_large_free_block_is_no_fragmentation(gpu: Any) -> None:
    """x = 1 GiB, a 2 GiB transient freed, two 64 MiB tensors: 1.875 GiB free in one block (the H200 report)."""
    from gpumem.core.diagnoses.fragmentation import free_reserve

    torch = gpu.user_ns["torch"]
    assert gpu.run_cell("%gpumem auto on").success
    cells = [
        "x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda:0')",
        "t = torch.empty(2 << 30, dtype=torch.uint8, device='cuda:0')\ndel t",
        "a = torch.empty(64 << 20, dtype=torch.uint8, device='cuda:0')\nb = torch.empty_like(a)",
        "y = 1",
        "%%gpumem\nz = 2",
        "%%gpumem\nc = torch.ones(1, device='cuda:0')",
    ]
    _run_without_fragmentation_claims(gpu, cells)
    segments = torch.cuda.memory_snapshot()
    (split,) = [s for s in segments if s["device"] == 0 and s["total_size"] == 2 * GIB]
    assert _blocks(split) == [
        (64 * MIB, "active_allocated"),
        (64 * MIB, "active_allocated"),
        (2 * GIB - 128 * MIB, "inactive"),
    ]
    assert torch.cuda.memory_stats(0)["inactive_split_bytes.all.current"] >= 2 * GIB - 128 * MIB  # the old "fragments"
    reserve = free_reserve(segments)[0]
    assert reserve.largest_free_bytes == 2 * GIB - 128 * MIB and not reserve.fragmented


@pytest.mark.usefixtures("no_expandable_segments")
def test_real_fragmentation_is_told_once_and_explains_the_oom(gpu: Any) -> None:
    """12 x 1 GiB freed, 12 x 600 MiB taken: each segment keeps 424 MiB free beside a live tensor."""
    from gpumem.core.diagnoses.fragmentation import free_reserve

    torch = gpu.user_ns["torch"]
    assert gpu.run_cell("%gpumem auto on").success
    made = "blocks = [torch.empty(1 << 30, dtype=torch.uint8, device='cuda:0') for _ in range(12)]"
    for cell in (made, "del blocks"):
        result, captured = run_cell_capture(gpu, cell)
        assert result.success and "fragment" not in _texts(captured), cell
    result, captured = run_cell_capture(
        gpu, "parts = [torch.empty(600 << 20, dtype=torch.uint8, device='cuda:0') for _ in range(12)]"
    )
    assert result.success
    (warning,) = [w for w in last().warnings if w.kind == "fragmentation"]
    assert "reserved is free but in" in warning.message and "the largest 424.0 MiB" in warning.message
    assert "would return none of it" in warning.message
    assert "`%env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` in the first cell" in warning.message
    assert "the largest 424.0 MiB" in _texts(captured)
    stranded = [s for s in torch.cuda.memory_snapshot() if s["device"] == 0 and s["total_size"] == GIB]
    assert [_blocks(s) for s in stranded] == [[(600 * MIB, "active_allocated"), (424 * MIB, "inactive")]] * 12
    reserve = free_reserve(torch.cuda.memory_snapshot())[0]
    assert reserve.fragmented and reserve.releasable_bytes == 0 and reserve.stranded_bytes >= 12 * 424 * MIB

    for cell in ("y = 1", "%%gpumem\nq = torch.ones(1, device='cuda:0')", "print('unrelated')"):
        result, captured = run_cell_capture(gpu, cell)
        assert result.success and "fragment" not in _texts(captured), cell  # standing: not repeated
    _result, captured = run_cell_capture(gpu, "%gpumem status")
    assert "  standing cuda:0: " in captured.stdout and "the largest 424.0 MiB" in captured.stdout

    limit = (torch.cuda.memory_reserved(0) + GIB) / torch.cuda.get_device_properties(0).total_memory
    try:
        torch.cuda.set_per_process_memory_fraction(limit, 0)
        failed, captured = run_cell_capture(
            gpu, "big = torch.empty(int(2.4 * 2**30), dtype=torch.uint8, device='cuda:0')"
        )
        assert isinstance(failed.error_in_exec, torch.OutOfMemoryError)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    text = _texts(captured)
    assert "requested 2.4 GiB" in text and "the largest 424.0 MiB (fragmentation)" in text
    assert "Fragmentation: PyTorch holds 5.0 GiB reserved but unallocated, more than the request" in text
    assert "expandable_segments:True" in text and "would return none of it" in text
    assert "return the cache with" not in text


@pytest.mark.usefixtures("no_expandable_segments")
def test_after_a_deep_free_with_little_allocated_no_fragmentation_claim(gpu: Any) -> None:
    """A 32 MiB tensor left in a freed 2 GiB block: empty_cache cannot return the segment, but the rest is one
    free block, usable by any request up to its size."""
    from gpumem.core.diagnoses.fragmentation import free_reserve

    torch = gpu.user_ns["torch"]
    assert gpu.run_cell("%gpumem auto on").success
    cells = [
        "t = torch.empty(2 << 30, dtype=torch.uint8, device='cuda:0')",
        "del t\nk = torch.empty(32 << 20, dtype=torch.uint8, device='cuda:0')",
        "%gpumem free --deep",
        "y = 1",
        "%%gpumem\nz = 1",
    ]
    _run_without_fragmentation_claims(gpu, cells)
    segments = torch.cuda.memory_snapshot()
    (kept,) = [s for s in segments if s["device"] == 0 and s["total_size"] == 2 * GIB]
    assert _blocks(kept) == [(32 * MIB, "active_allocated"), (2 * GIB - 32 * MIB, "inactive")]
    assert torch.cuda.memory_stats(0)["inactive_split_bytes.all.current"] >= 2 * GIB - 32 * MIB
    assert not free_reserve(segments)[0].fragmented
    _result, captured = run_cell_capture(gpu, "%gpumem status")
    assert "  standing none" in captured.stdout


# -- by kind, staircases, kept activations and gradients -------------------------------------------------


def _kind_deltas(record: CellRecord) -> dict[str, int]:
    """The kinds that changed in the cell, with their exact byte changes."""
    return {change.kind: change.delta_bytes for change in record.kinds if change.delta_bytes}


def test_a_loop_that_keeps_64_mib_per_step_is_a_staircase(gpu: Any) -> None:
    """30 steps of 64 MiB, 0.15 s apart: the 10 Hz sampler sees each (a late sample may merge two)."""
    import re

    cell = (
        "%%gpumem\n"
        "import time\n"
        "acc = []\n"
        "for _ in range(30):\n"
        "    acc.append(torch.empty(64 << 20, dtype=torch.uint8, device='cuda:0'))\n"
        "    time.sleep(0.15)"
    )
    result, cap = run_cell_capture(gpu, cell)
    assert result.success
    record = last()
    assert device0(record).allocated_delta_bytes == 30 * 64 * MIB
    (staircase,) = [w for w in record.warnings if w.kind == "staircase"]
    found = re.match(
        r"cuda:0 allocated memory rose in (\d+) steps of ~64\.0 MiB \(\+1\.9 GiB\) over ", staircase.message
    )
    assert found is not None and 27 <= int(found.group(1)) <= 30, staircase.message
    assert "never fell: something accumulates per iteration; `acc` grew most (+1.9 GiB)" in staircase.message
    assert _kind_deltas(record) == {"other tensors": 30 * 64 * MIB}
    assert "by kind (since the start of the cell): other tensors +1.9 GiB" in cap.outputs[-1].data["text/plain"]
    # The same loop keeping only the last step's tensor: one rise of 64 MiB, no staircase.
    assert gpu.run_cell("del acc").success
    cell = cell.replace("acc.append(", "step = (").replace("acc = []\n", "")
    assert run_cell_capture(gpu, cell)[0].success
    assert device0(last()).allocated_delta_bytes == 64 * MIB
    assert not [w for w in last().warnings if w.kind == "staircase"]


def test_validation_without_no_grad_keeps_activations(gpu: Any) -> None:
    """Each 256x1024 batch keeps its graph: the input (the first addmm's mat1) and the ReLU's result (the
    second addmm's mat1), 1 MiB each, plus the 1 MiB output that the list names."""
    setup = (
        "model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))\n"
        "model = model.to('cuda:0')\n"
        "with torch.no_grad():\n"
        "    _warm = model(torch.randn(256, 1024, device='cuda:0'))  # the cuBLAS workspace, before the cell\n"
        "del _warm\n"
        "torch.cuda.synchronize(0)"
    )
    assert gpu.run_cell(setup).success
    cell = "%%gpumem\noutputs = [model(torch.randn(256, 1024, device='cuda:0')) for _ in range(8)]"
    result, cap = run_cell_capture(gpu, cell)
    assert result.success
    record = last()
    assert device0(record).allocated_delta_bytes == 8 * 3 * MIB
    assert _kind_deltas(record) == {"activations (saved by autograd graphs)": 16 * MIB, "other tensors": 8 * MIB}
    text = cap.outputs[-1].data["text/plain"]
    assert "by kind (since the start of the cell): other tensors +8.0 MiB, activations +16.0 MiB" in text
    (graph,) = [w for w in record.warnings if w.kind == "graph"]
    assert "`outputs[0]` … `outputs[7]` (8 elements)" in graph.message
    assert "16.0 MiB of saved activations: store `.item()`" in graph.message
    # Under no_grad nothing is saved.
    cell = (
        "%%gpumem\nwith torch.no_grad():\n    kept = [model(torch.randn(256, 1024, device='cuda:0')) for _ in range(8)]"
    )
    assert run_cell_capture(gpu, cell)[0].success
    assert _kind_deltas(last()) == {"other tensors": 8 * MIB}
    assert not [w for w in last().warnings if w.kind == "graph"]


def test_a_model_and_adamw_by_kind_and_the_gradients_note(gpu: Any) -> None:
    cell = (
        "%%gpumem\n"
        "model = torch.nn.Linear(4096, 4096, device='cuda:0')\n"
        "opt = torch.optim.AdamW(model.parameters())\n"
        "model(torch.randn(64, 4096, device='cuda:0')).sum().backward()\n"
        "opt.step()\n"
        "torch.cuda.synchronize(0)"
    )
    torch = gpu.user_ns["torch"]
    torch._C._cuda_clearCublasWorkspaces()  # every workspace this cell needs is then made by it
    torch.cuda.empty_cache()
    result, cap = run_cell_capture(gpu, cell)
    assert result.success
    record = last()
    params = (4096 * 4096 + 4096) * 4
    deltas = _kind_deltas(record)
    # exp_avg + exp_avg_sq on the GPU; AdamW's `step` lives on the CPU.
    assert {kind: deltas.get(kind) for kind in ("parameters", "gradients", "optimizer state")} == {
        "parameters": params,
        "gradients": params,
        "optimizer state": 2 * params,
    }
    # The forward's matmul makes a cuBLAS workspace for the main thread's handle, backward another for
    # autograd's device thread (workspaces are kept per handle and stream; handles per thread). Both are
    # named from the allocator's blocks: nothing is left unattributed.
    assert set(deltas) == {"parameters", "gradients", "optimizer state", "cuBLAS workspaces"}, deltas
    assert deltas["cuBLAS workspaces"] == device0(record).allocated_delta_bytes - 4 * params
    if torch.cuda.get_device_capability(0) == (9, 0) and "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        # Two 32 MiB cuBLAS workspaces (this thread's and autograd's) and at most one 1 MiB cuBLASLt one each:
        # 65 MiB on an H200 with torch 2.11.
        assert 2 * 32 * MIB <= deltas["cuBLAS workspaces"] <= 2 * 33 * MIB
    text = cap.outputs[-1].data["text/plain"]
    assert (
        "by kind (since the start of the cell): parameters +64.0 MiB, gradients +64.0 MiB, optimizer state +128.0 MiB"
        in (text)
    )
    (note,) = record.notes
    assert note.startswith("gradients are kept after the cell (64.0 MiB: `model` 64.0 MiB); optimizer.zero_grad(")
    assert not [w for w in record.warnings if "gradient" in w.message]
    # Gradients freed after the step: nothing more to say about them.
    step = "%%gpumem\nmodel(torch.randn(64, 4096, device='cuda:0')).sum().backward()\nopt.step()\nopt.zero_grad()"
    assert run_cell_capture(gpu, step)[0].success
    assert last().notes == ()
    assert _kind_deltas(last()).get("gradients") == -params


def test_automatic_mode_names_the_kinds_of_backward_and_step_cells(gpu: Any) -> None:
    torch = gpu.user_ns["torch"]
    params = (4096 * 4096 + 4096) * 4
    setup = "model = torch.nn.Linear(4096, 4096, device='cuda:0')\nopt = torch.optim.AdamW(model.parameters())"
    assert gpu.run_cell(setup).success
    torch._C._cuda_clearCublasWorkspaces()  # the backward cell then makes both of its workspaces
    torch.cuda.empty_cache()
    assert gpu.run_cell("%config GpuMem.threshold = 1048576").success
    assert gpu.run_cell("%gpumem auto on").success
    first = "warm = torch.empty(1 << 20, dtype=torch.uint8, device='cuda:0')"  # 1 MiB: a first walk to compare with
    assert run_cell_capture(gpu, first)[0].success
    assert _kind_deltas(last()) == {}  # the first walk has nothing to compare with: no kinds, no guess
    result, cap = run_cell_capture(gpu, "model(torch.randn(64, 4096, device='cuda:0')).sum().backward()")
    assert result.success
    deltas = {kind: delta for kind, delta in _kind_deltas(last()).items() if delta}
    # Gradients, and the cuBLAS workspaces of the main thread (forward) and of autograd's thread (backward).
    assert set(deltas) == {"gradients", "cuBLAS workspaces"}, deltas
    assert deltas["gradients"] == params
    assert deltas["cuBLAS workspaces"] == device0(last()).allocated_delta_bytes - params
    if torch.cuda.get_device_capability(0) == (9, 0) and "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        # Two 32 MiB cuBLAS workspaces (this thread's and autograd's) and at most one 1 MiB cuBLASLt one each:
        # 65 MiB on an H200 with torch 2.11.
        assert 2 * 32 * MIB <= deltas["cuBLAS workspaces"] <= 2 * 33 * MIB
    line = cap.outputs[-1].data["text/plain"]
    assert "; by kind " in line and "gradients +64.0 MiB" in line.split("; by kind ")[1]  # largest kinds first
    result, cap = run_cell_capture(gpu, "opt.step()")  # rebinds nothing: the whole namespace is walked
    assert result.success
    deltas = {kind: delta for kind, delta in _kind_deltas(last()).items() if delta}
    assert deltas == {"optimizer state": 2 * params}  # exp_avg, exp_avg_sq; AdamW's `step` is on the CPU
    assert last().kinds_since.startswith("since cell [")
    assert "; by kind optimizer state +128.0 MiB" in cap.outputs[-1].data["text/plain"]
    walks = dict(_extension.get_state().tracker.walks)  # type: ignore[union-attr]
    assert run_cell_capture(gpu, "n = 1")[0].success  # memory unchanged: no walk at all
    assert _extension.get_state().tracker.walks == walks  # type: ignore[union-attr]
    assert gpu.run_cell("%gpumem auto off").success


def test_status_rows_say_what_they_are_and_history_shows_kinds_on_a_gpu(gpu: Any) -> None:
    """The small words where CUDA is in use: a row per device labelled cuda:N, the host's labelled host RAM;
    the history's "by kind" column is there once a cell's CUDA tensors were sorted into kinds."""
    assert gpu.run_cell("%gpumem auto on --vars always").success
    assert gpu.run_cell("first = torch.empty(1 << 20, dtype=torch.uint8, device='cuda:0')").success  # a baseline
    assert run_cell_capture(gpu, "kept = torch.empty(64 << 20, dtype=torch.uint8, device='cuda:0')")[0].success
    lines = run_cell_capture(gpu, "%gpumem status")[1].stdout.splitlines()
    assert lines[1].startswith("  cuda:0   allocated ") and "(all processes)" in lines[1], lines
    assert any(line.startswith("  host RAM RSS ") for line in lines), lines
    assert not any(line.startswith("  now") for line in lines), lines
    (output,) = run_cell_capture(gpu, "%gpumem history")[1].outputs
    assert "by kind" in output.data["text/plain"] and "by kind" in output.data["text/html"]
    assert gpu.run_cell("del kept, first\n%gpumem auto off").success
