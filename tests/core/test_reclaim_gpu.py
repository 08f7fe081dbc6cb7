"""On a real CUDA GPU: each reclaim action's promised bytes equal the bytes it freed, to the byte.

Promised: before the action, from the storages only its targets hold and the allocator's blocks and
segments. Freed: ``memory_allocated`` and ``memory_reserved`` right before and after the action.
"""

from __future__ import annotations

from typing import Any

import pytest

from _harness import run_cell_capture

pytestmark = pytest.mark.gpu

MIB = 1 << 20


def cell(ip: Any, code: str) -> None:
    result, captured = run_cell_capture(ip, code)
    assert result.success or code.endswith("step()"), captured.stdout + captured.stderr


def check(action: str, ip: Any, allocated_at_least: int) -> Any:
    """Promise, act, and compare to the byte (also against torch's own counters, read here)."""
    import torch

    from gpumem.core.reclaim import ShellReferences, perform, promise

    held = ShellReferences(ip)
    promised = promise(action, held)
    assert promised.exact, promised
    assert promised.allocated_bytes >= allocated_at_least, promised.describe()
    allocated, reserved = torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)
    outcome = perform(action, held)
    assert outcome.kept, outcome.describe()
    assert outcome.promise.allocated_bytes == promised.allocated_bytes, (promised.describe(), outcome.describe())
    assert outcome.allocated_freed_bytes == promised.allocated_bytes
    assert outcome.reserved_freed_bytes == promised.reserved_bytes
    assert allocated - torch.cuda.memory_allocated(0) == promised.allocated_bytes
    assert reserved - torch.cuda.memory_reserved(0) == promised.reserved_bytes
    return outcome


def test_an_out_tensor(gpu: Any) -> None:
    cell(gpu, "torch.ones(2**26 + 100, device='cuda:0')")  # 256 MiB + 400 B: a block rounded to 512 B
    outcome = check("outputs", gpu, 256 * MIB + 512)
    assert outcome.promise.reserved_bytes >= 256 * MIB


def test_an_out_tensor_also_named_is_not_promised(gpu: Any) -> None:
    from gpumem.core.reclaim import ShellReferences, perform

    cell(gpu, "torch.ones(2**26, device='cuda:0')")
    cell(gpu, "kept = _")
    outcome = perform("outputs", ShellReferences(gpu))
    assert outcome.kept, outcome.describe()
    assert outcome.promise.kept_bytes == 256 * MIB and "kept" in outcome.promise.kept_by
    assert outcome.allocated_freed_bytes < 256 * MIB


def test_an_exceptions_frames(gpu: Any) -> None:
    cell(gpu, "def step():\n    activations = torch.ones(2**26, device='cuda:0')\n    raise ValueError('bad')")
    cell(gpu, "step()")
    check("exception", gpu, 256 * MIB)


def test_a_models_gradients(gpu: Any) -> None:
    cell(gpu, "model = torch.nn.Linear(4096, 4096).cuda()")
    cell(gpu, "model(torch.ones(8, 4096, device='cuda:0')).sum().backward()")
    outcome = check("gradients:model", gpu, 4096 * 4096 * 4)
    assert gpu.user_ns["model"].weight.grad is None
    assert outcome.storages_freed == 2


def test_the_cublas_workspaces(gpu: Any) -> None:
    cell(gpu, "a = torch.ones(256, 256, device='cuda:0')\nb = a @ a\ntorch.cuda.synchronize()")
    outcome = check("workspaces", gpu, 1)
    assert "workspace block" in outcome.promise.note


def test_the_cache(gpu: Any) -> None:
    cell(gpu, "x = torch.ones(2**26, device='cuda:0')\ndel x")
    outcome = check("cache", gpu, 0)
    assert outcome.promise.allocated_bytes == 0 and outcome.promise.reserved_bytes >= 256 * MIB
