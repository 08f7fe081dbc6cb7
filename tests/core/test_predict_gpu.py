"""Dry runs against the real CUDA caching allocator: each workload of benchmarks/predict_workloads.py is set
up, dry-run and then run for real in a fresh process (benchmarks/bench_predict.py's children), so every
workload starts from the same allocator state; the batch search's answer is run for real under a capped
allocator. bench_predict.py writes the same figures as a table."""

from __future__ import annotations

from typing import Any

import pytest

from _harness import run_cell_capture
from _harness.benchmarks import load_benchmark

pytestmark = pytest.mark.gpu

bench = load_benchmark("bench_predict")
workloads = load_benchmark("predict_workloads")
GIB = 1 << 30


@pytest.mark.parametrize("name", [workload.name for workload in workloads.WORKLOADS])
def test_predicted_peaks_match_the_allocator(name: str) -> None:
    row = bench._child("accuracy", name)
    assert "error" not in row, row.get("error")
    assert "refused" not in row, row
    real, predicted = row["real_peak_allocated"], row["predicted_peak_allocated"]
    assert abs(predicted - real) <= 0.01 * real, row
    real_reserved, predicted_reserved = row["real_peak_reserved"], row["predicted_peak_reserved"]
    if name == "conv_batchnorm":
        # cuDNN's run-time workspaces (hundreds of MiB each on the H200) are not seen: a lower bound, said so.
        assert row["reserved_at_least"] is True, row
        assert predicted_reserved <= real_reserved, row
        return
    assert row["reserved_at_least"] is False, row
    assert abs(predicted_reserved - real_reserved) <= 0.05 * real_reserved, row


def test_the_largest_batch_runs_and_a_quarter_more_does_not() -> None:
    low, high, capacity = bench.SEARCH["mlp_adamw_first_step"]
    found = bench._child("search", "mlp_adamw_first_step", str(low), str(high), str(capacity))
    assert "error" not in found, found.get("error")
    largest = found["largest"]
    assert isinstance(largest, int), found
    assert found["runs"] < 10
    limit = capacity - (found["context_bytes"] or 0)
    at = bench._child("real", "mlp_adamw_first_step", str(largest), str(limit))
    over = bench._child("real", "mlp_adamw_first_step", str(int(largest * 1.25) + 1), str(limit))
    assert at.get("oom") is False, at
    assert over.get("oom") is True, over


def test_a_dry_run_takes_no_gpu_memory_and_changes_nothing(gpu: Any) -> None:
    setup = (
        "model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024))\n"
        "model = model.cuda()\n"
        "opt = torch.optim.AdamW(model.parameters())\n"
        "model(torch.randn(64, 1024, device='cuda')).sum().backward(); opt.step()\n"
        "weights = [p.detach().clone() for p in model.parameters()]\n"
        "grads = [p.grad.detach().clone() for p in model.parameters()]\n"
        "moments = [opt.state[p]['exp_avg'].clone() for p in model.parameters()]\n"
        "rng = torch.cuda.get_rng_state()\n"
        "torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); before = torch.cuda.memory_allocated()\n"
    )
    assert run_cell_capture(gpu, setup)[0].success
    cell = (
        "%%gpumem --predict\nx = torch.randn(256, 1024, device='cuda')\n"
        "model(x).pow(2).mean().backward()\nopt.step()\nopt.zero_grad()\n"
    )
    result, cap = run_cell_capture(gpu, cell)
    assert result.success, cap.stderr
    text = "\n".join(output.data.get("text/plain", "") for output in cap.outputs)
    assert "cuda:0:" in text and "the memory free on the device now" in text, text
    assert "CUDA context" in text or "NVML cannot tell this process's share" in text, text
    check = (
        "peaks = (torch.cuda.max_memory_allocated(), before, torch.cuda.memory_allocated())\n"
        "assert peaks[0] == peaks[1] == peaks[2], ('memory', peaks)\n"
        "assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights)), 'weights'\n"
        "assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads)), 'grads'\n"
        "assert all(torch.equal(opt.state[p]['exp_avg'], m) for p, m in zip(model.parameters(), moments)), 'adam'\n"
        "assert torch.equal(torch.cuda.get_rng_state(), rng), 'rng'\n"
        "assert 'x' not in dir(), 'x'\n"
    )
    result, cap = run_cell_capture(gpu, check)
    assert result.success, (cap.stderr, repr(result.error_in_exec))


def test_the_cublas_workspace_is_counted_once(gpu: Any) -> None:
    """A fresh process-state (workspaces cleared): the first matmul's workspace is in the prediction; after
    a real matmul it is not counted again."""
    from gpumem.core.predict import predict_source

    torch = gpu.user_ns["torch"]
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    namespace = {"torch": torch, "a": torch.randn(1024, 1024, device="cuda")}
    first = predict_source("b = a @ a\n", namespace).device("cuda:0")
    assert first is not None and first.workspace_bytes > 0
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    b = namespace["a"] @ namespace["a"]
    torch.cuda.synchronize()
    assert first.peak_allocated - start == torch.cuda.max_memory_allocated() - start
    second = predict_source("c = a @ a\n", namespace).device("cuda:0")
    assert second is not None and second.workspace_bytes == 0
    del b


_FRESH = """
import json, torch
from gpumem.core.predict import predict_source
cell = "model = torch.nn.Linear(256, 256).cuda()\\nmodel(torch.randn(64, 256, device='cuda')).sum().backward()\\n"
prediction = predict_source(cell, {"torch": torch})
device = prediction.device("cuda:0")
print(json.dumps({
    "refusal": None if prediction.refusal is None else prediction.refusal.reason,
    "started": list(prediction.started_contexts),
    "context": None if device is None else device.context_bytes,
    "text": str(prediction),
    "max_allocated": torch.cuda.max_memory_allocated(0),
    "reserved": torch.cuda.memory_reserved(0),
}))
"""


def test_a_dry_run_in_a_process_without_cuda_makes_the_context_alone() -> None:
    """PyTorch's fakes need a CUDA context for a backward; in a process that has none, the dry run makes the
    context and nothing else (no tensor, no cached segment), measures it and says so."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, check=False, timeout=200)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.splitlines()[-1])
    assert row["refusal"] is None, row
    assert row["started"] == ["cuda:0"], row
    assert row["max_allocated"] == 0 and row["reserved"] == 0, row
    assert isinstance(row["context"], int) and row["context"] > 0, row
    assert "the dry run started CUDA here" in row["text"], row["text"]
