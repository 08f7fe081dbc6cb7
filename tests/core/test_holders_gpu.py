"""On a real CUDA GPU: an OOM cell, `%gpumem free --deep` back to baseline, and holders against memory_allocated."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from _harness import run_cell_capture

pytestmark = pytest.mark.gpu

MIB = 1 << 20
GIB = 1 << 30


def text_of(captured: Any) -> str:
    return "\n".join(output.data.get("text/plain", "") for output in captured.outputs) + captured.stdout


@pytest.fixture
def cuda_ip(ip: Any) -> Iterator[Any]:
    """A shell with torch imported, CUDA initialized on device 0, and gpumem loaded."""
    import torch

    run_cell_capture(ip, "import torch, gc, weakref\ntorch.cuda.init()", raise_on_error=True)
    result, captured = run_cell_capture(ip, "%load_ext gpumem")
    assert result.success, text_of(captured)
    yield ip
    run_cell_capture(ip, "%unload_ext gpumem")
    gc.collect()
    torch.cuda.empty_cache()


def allocated() -> int:
    import torch

    gc.collect()
    return int(torch.cuda.memory_allocated(0))


def test_oom_cell_then_deep_free_returns_to_baseline(cuda_ip: Any) -> None:
    import torch

    ip = cuda_ip
    baseline = allocated()
    run_cell_capture(ip, "torch.ones(2**28, device='cuda:0')", raise_on_error=True)  # 1 GiB kept by Out / _N / _
    failed, captured = run_cell_capture(
        ip,
        "def step():\n"
        "    activations = torch.empty(2**29, device='cuda:0')  # 2 GiB kept by the traceback's frame\n"
        "    return torch.empty(10**13, device='cuda:0')\n"
        "step()",
    )
    assert isinstance(failed.error_in_exec, torch.OutOfMemoryError)
    text = text_of(captured)
    assert "gpumem: CUDA out of memory on cuda:0" in text
    assert "requested 37252.9 GiB" in text or "requested 36.4 TiB" in text
    assert "last exception (OutOfMemoryError)" in text and "2.0 GiB" in text
    assert "Out[" in text and "1.0 GiB" in text
    assert "larger than the whole device" in text
    assert "%gpumem free --deep" in text
    assert allocated() - baseline >= 3 * GIB

    still, _ = run_cell_capture(ip, "1 + 1")
    assert still.success and still.result == 2  # the kernel stays usable

    freed, captured_free = run_cell_capture(ip, "%gpumem free --deep")
    assert freed.success, text_of(captured_free)
    assert "cuda:0" in text_of(captured_free)
    assert abs(allocated() - baseline) <= 1 * MIB
    assert torch.cuda.memory_reserved(0) - torch.cuda.memory_allocated(0) < 64 * MIB  # the cache went back too


def test_observer_figures_on_a_real_oom(cuda_ip: Any) -> None:
    import torch

    from gpumem.core import oom

    if not hasattr(torch._C, "_cuda_attach_out_of_memory_observer"):
        pytest.skip("this torch has no out-of-memory observer")
    run_cell_capture(cuda_ip, "x = 1")  # pre_run_cell attaches the observer once CUDA is initialized
    failed, _ = run_cell_capture(cuda_ip, "torch.empty(10**13, device='cuda:0')")
    assert isinstance(failed.error_in_exec, torch.OutOfMemoryError)
    observation = oom._state.last_observation
    assert observation is not None
    assert observation.device == 0
    assert observation.requested_bytes >= 4 * 10**13
    total = torch.cuda.get_device_properties(0).total_memory
    assert abs(observation.device_total_bytes - total) <= 64 * MIB
    report = oom.explain(failed.error_in_exec, observation=observation, shell=cuda_ip)
    assert report.source_of_figures == "observer+message"
    run_cell_capture(cuda_ip, "%gpumem free --deep")


def test_model_and_adamw_add_up_to_memory_allocated(cuda_ip: Any) -> None:

    from gpumem.core.holders import GRADIENTS, OPTIMIZER_STATE, PARAMETERS, find_holders

    ip = cuda_ip
    baseline = allocated()
    run_cell_capture(
        ip,
        "model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).to('cuda:0')\n"
        "opt = torch.optim.AdamW(model.parameters())\n"
        "x = torch.randn(512, 2048, device='cuda:0')\n"
        "for _ in range(2):\n"
        "    opt.zero_grad(set_to_none=False)\n"
        "    model(x).square().mean().backward()\n"
        "    opt.step()\n"
        "kept_graph = model(x).sum()\n"
        "torch.cuda.synchronize()",
        raise_on_error=True,
    )
    params = sum(p.numel() * p.element_size() for p in ip.user_ns["model"].parameters())
    report = find_holders(ip.user_ns, device="cuda:0", shell=ip)
    rows = {row.name: row for row in report.holders}
    model_row = rows["model"]
    assert model_row.breakdown[PARAMETERS] == params
    assert model_row.breakdown[GRADIENTS] == params
    assert model_row.breakdown[OPTIMIZER_STATE] == 2 * params  # exp_avg + exp_avg_sq; `step` lives on the CPU
    assert rows["opt"].nbytes == 0 and rows["opt"].shared_bytes > 0
    assert rows["x"].nbytes == 512 * 2048 * 4
    assert rows["kept_graph"].graph_paths == ("kept_graph",)
    assert report.allocated_bytes is not None and report.unattributed_bytes is not None
    named = report.total_bytes + report.hidden_bytes
    assert report.allocated_bytes == named + report.unattributed_bytes
    # What the walk cannot name: the graph kept by kept_graph (8 saved inputs of 4 MiB), cuBLAS workspaces,
    # allocator rounding, and whatever earlier tests left behind (the baseline).
    saved_activations = 8 * 512 * 2048 * 4
    remainder = report.unattributed_bytes - baseline
    assert saved_activations <= remainder <= saved_activations + 256 * MIB, report.unattributed
    assert "autograd graphs" in report.unattributed
    run_cell_capture(ip, "del model, opt, x, kept_graph")


def test_device_filter_and_storage_sharing_on_the_gpu(cuda_ip: Any) -> None:
    from gpumem.core.holders import find_holders

    run_cell_capture(
        cuda_ip,
        "g = torch.zeros(MIB_COUNT, device='cuda:0')\nview = g[: MIB_COUNT // 2]\nc = torch.zeros(1000)".replace(
            "MIB_COUNT", str(MIB // 4)
        ),
        raise_on_error=True,
    )
    on_gpu = find_holders(cuda_ip.user_ns, device="cuda", shell=cuda_ip)
    rows = {row.name: row for row in on_gpu.holders}
    assert rows["g"].nbytes == MIB and rows["g"].device == "cuda:0"
    assert rows["view"].nbytes == 0 and rows["view"].shared_bytes == MIB
    assert "c" not in rows
    on_cpu = find_holders(cuda_ip.user_ns, device="cpu", shell=cuda_ip)
    assert [row.name for row in on_cpu.holders] == ["c"]
    everything = find_holders(cuda_ip.user_ns, device="all", shell=cuda_ip)
    assert everything.total_bytes == MIB + 4000
    run_cell_capture(cuda_ip, "del g, view, c")


def test_fragmentation_oom_advises_expandable_segments(cuda_ip: Any) -> None:
    import torch

    ip = cuda_ip
    run_cell_capture(
        ip,
        "small = [torch.empty(512 * 1024, dtype=torch.uint8, device='cuda:0') for _ in range(20_000)]\n"
        "del small[1::2], small[1::2]  # 2 MiB small-pool segments left a quarter used: nothing releasable",
        raise_on_error=True,
    )
    run_cell_capture(
        ip,
        "filler = torch.empty(int(torch.cuda.mem_get_info(0)[0] - 2**28), dtype=torch.uint8, device='cuda:0')",
        raise_on_error=True,
    )
    failed, captured = run_cell_capture(ip, "big = torch.empty(2**30, dtype=torch.uint8, device='cuda:0')")
    assert isinstance(failed.error_in_exec, torch.OutOfMemoryError)
    text = text_of(captured)
    assert "(fragmentation)" in text
    assert "expandable_segments:True" in text
    assert "filler" in text and "small" in text
    freed, _ = run_cell_capture(ip, "del filler, small\n%gpumem free --deep")
    assert freed.success
    assert torch.cuda.memory_reserved(0) < 1 * GIB


def test_a_module_attribute_cache_is_named_with_its_exact_size(cuda_ip: Any) -> None:
    from gpumem.core.holders import OTHER, PARAMETERS, find_holders

    ip = cuda_ip
    run_cell_capture(
        ip,
        "class BadAttention(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.proj = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB\n"
        "    def forward(self, x):\n"
        "        h = self.proj(x)\n"
        "        self.cache = h @ h.T  # 8192 x 8192 float32: 256 MiB kept after forward returns\n"
        "        return h\n"
        "att = BadAttention().to('cuda:0')\n"
        "with torch.no_grad():\n"
        "    out = att(torch.randn(8192, 1024, device='cuda:0'))\n"
        "del out\n"
        "torch.cuda.synchronize()",
        raise_on_error=True,
    )
    report = find_holders(ip.user_ns, device="cuda:0", shell=ip)
    att = next(row for row in report.holders if row.name == "att")
    assert att.nbytes == 260 * MIB
    assert att.breakdown == {PARAMETERS: 4 * MIB, OTHER: 256 * MIB}
    assert att.note == "att.cache 256.0 MiB (tensor attribute of a module, not a parameter or buffer)"
    _, captured = run_cell_capture(ip, "%gpumem who")
    assert "att.cache 256.0 MiB (tensor attribute of a module, not a parameter or buffer)" in text_of(captured)
    run_cell_capture(ip, "del att, BadAttention")


def test_a_tensor_kept_by_a_closure_is_named(cuda_ip: Any) -> None:
    from gpumem.core.holders import find_holders

    ip = cuda_ip
    baseline = allocated()
    run_cell_capture(
        ip,
        "def make():\n"
        "    t = torch.empty(300 * 2**20, dtype=torch.uint8, device='cuda:0')\n"
        "    return lambda: t.shape\n"
        "f = make()",
        raise_on_error=True,
    )
    assert allocated() - baseline == 300 * MIB
    report = find_holders(ip.user_ns, device="cuda:0", shell=ip)
    assert [(row.name, row.nbytes) for row in report.holders] == [("f", 300 * MIB)]
    assert report.holders[0].complete
    _, captured = run_cell_capture(ip, "%gpumem who")
    assert "300.0 MiB" in text_of(captured)
    run_cell_capture(ip, "del f, make")
    assert allocated() == baseline


def test_a_deleted_model_is_named_under_its_optimizer(cuda_ip: Any) -> None:
    from gpumem.core.holders import GRADIENTS, OPTIMIZER_STATE, PARAMETERS, find_holders

    ip = cuda_ip
    run_cell_capture(
        ip,
        "model = torch.nn.Linear(2048, 2048).to('cuda:0')\n"
        "opt = torch.optim.AdamW(model.parameters())\n"
        "model(torch.randn(64, 2048, device='cuda:0')).sum().backward()\n"
        "opt.step()\n"
        "del model  # the optimizer still keeps the parameters, their gradients and its state\n"
        "torch.cuda.synchronize()",
        raise_on_error=True,
    )
    params = (2048 * 2048 + 2048) * 4
    report = find_holders(ip.user_ns, device="cuda:0", shell=ip)
    assert [row.name for row in report.holders] == ["opt"]
    opt = report.holders[0]
    assert opt.breakdown == {PARAMETERS: params, GRADIENTS: params, OPTIMIZER_STATE: 2 * params}
    assert opt.nbytes == 4 * params
    run_cell_capture(ip, "del opt")
