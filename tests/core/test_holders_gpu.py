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

    from gpumem.core.diagnoses import oom

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
    saved_activations = 7 * 512 * 2048 * 4  # each layer saves its input; x, the first, is named
    remainder = report.unattributed_bytes - baseline
    assert saved_activations <= remainder <= saved_activations + 256 * MIB, report.unattributed
    assert "autograd graphs" in report.unattributed
    # The graph saves each layer's input (addmm's mat1): x is named, the 7 others only the graph keeps.
    assert report.graph_saved_bytes == 7 * 512 * 2048 * 4
    assert rows["kept_graph"].graph_saved_bytes == 7 * 512 * 2048 * 4
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


# -- the remainder named: cuBLAS workspaces, rounding, activations (H200: compute capability 9.0) ---------

WORKSPACE = 32 * MIB  # one cuBLAS workspace on compute capability 9.0 with CUBLAS_WORKSPACE_CONFIG unset
BLOCK_1000X1000 = 4_000_256  # 4,000,000 bytes rounded up to a multiple of 512


def fresh_allocator() -> None:
    """No workspace and no cached block left from earlier tests: the figures below are then exact."""
    import torch

    torch.cuda.synchronize(0)
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()


def requires_hopper_defaults() -> None:
    import os

    import torch

    if torch.cuda.get_device_capability(0) != (9, 0) or "CUBLAS_WORKSPACE_CONFIG" in os.environ:
        pytest.skip("the exact figures assume compute capability 9.0 and no CUBLAS_WORKSPACE_CONFIG")


def test_matmul_workspace_is_named_and_the_rest_is_rounding() -> None:
    import torch

    from gpumem.core.holders import find_holders

    requires_hopper_defaults()
    fresh_allocator()
    before = find_holders({}, device="cuda:0", include_hidden=False)
    w = torch.randn(1000, 1000, device="cuda:0")
    v = w @ w
    torch.cuda.synchronize(0)
    assert torch.cuda.memory_allocated(0) - (before.allocated_bytes or 0) == 2 * BLOCK_1000X1000 + WORKSPACE
    report = find_holders({"w": w, "v": v}, device="cuda:0", include_hidden=False)
    remainder, earlier = report.remainder, before.remainder
    assert remainder is not None and earlier is not None
    assert report.total_bytes == 2 * 4_000_000
    assert remainder.blocks_read and remainder.workspaces_confirmed
    assert remainder.workspace_bytes - earlier.workspace_bytes == WORKSPACE
    assert remainder.rounding_bytes - earlier.rounding_bytes == 2 * 256
    assert remainder.unexplained_bytes == earlier.unexplained_bytes  # only what earlier tests left behind
    text = render(report)
    assert "cuBLAS workspaces" in text and "32.0 MiB" in text
    assert "torch._C._cuda_clearCublasWorkspaces()" in text
    assert "matched to allocator blocks" in text
    del w, v


def test_three_workspaces_main_thread_side_stream_and_autograd_thread_are_all_named() -> None:
    import torch

    from gpumem.core.holders import find_holders

    requires_hopper_defaults()
    fresh_allocator()
    before = find_holders({}, device="cuda:0", include_hidden=False).remainder
    a = torch.randn(256, 256, device="cuda:0", requires_grad=True)  # 262,144 bytes: a multiple of 512
    b = a @ a  # the main thread's cuBLAS handle on the default stream: workspace 1
    side = torch.cuda.Stream(0)
    with torch.cuda.stream(side):
        c = a.detach() @ a.detach()  # the same handle on another stream: workspace 2
    side.synchronize()
    b.sum().backward()  # autograd's device thread has its own handle: workspace 3
    torch.cuda.synchronize(0)
    report = find_holders({"a": a, "b": b, "c": c}, device="cuda:0", include_hidden=False)
    remainder = report.remainder
    assert remainder is not None and before is not None and remainder.blocks_read
    assert remainder.workspaces_confirmed
    assert remainder.workspace_count - before.workspace_count == 3
    assert remainder.workspace_bytes - before.workspace_bytes == 3 * WORKSPACE
    assert remainder.unexplained_bytes == before.unexplained_bytes
    assert report.total_bytes == 4 * 256 * 256 * 4  # a, a.grad, b, c
    assert "3 x kept by PyTorch for matmuls, matched to allocator blocks" in render(report)
    del a, b, c


def render(report: Any) -> str:
    from gpumem.core.holders import render_text

    return render_text(report)


def test_after_del_and_deep_free_who_names_the_workspace_and_free_workspaces_returns_it(cuda_ip: Any) -> None:
    import torch

    from gpumem.core.cleanup import free
    from gpumem.core.holders import find_holders

    requires_hopper_defaults()
    ip = cuda_ip
    fresh_allocator()
    before = find_holders(ip.user_ns, device="cuda:0", shell=ip).remainder
    run_cell_capture(ip, "w = torch.randn(1000, 1000, device='cuda'); v = w @ w", raise_on_error=True)
    run_cell_capture(ip, "del w, v", raise_on_error=True)
    freed, _ = run_cell_capture(ip, "%gpumem free --deep")
    assert freed.success
    result, captured = run_cell_capture(ip, "%gpumem who")
    assert result.success
    text = text_of(captured)
    assert "cuBLAS workspaces" in text and "32.0 MiB" in text, text
    assert "torch._C._cuda_clearCublasWorkspaces()" in text
    after = find_holders(ip.user_ns, device="cuda:0", shell=ip).remainder
    assert after is not None and before is not None
    assert after.workspace_bytes - before.workspace_bytes == WORKSPACE
    assert after.unexplained_bytes - before.unexplained_bytes == 0
    assert after.graph_saved_bytes == 0
    reclaimed = free(workspaces=True, shell=ip)
    assert reclaimed.workspaces
    assert reclaimed.allocated_reclaimed_bytes == WORKSPACE
    assert "the next matmul on each stream allocates its workspace again" in reclaimed.describe()
    assert find_holders(ip.user_ns, device="cuda:0", shell=ip).remainder.workspace_bytes == 0  # type: ignore[union-attr]
    run_cell_capture(ip, "_ = torch.ones(4, 4, device='cuda') @ torch.ones(4, 4, device='cuda')")
    assert torch.cuda.memory_allocated(0) >= WORKSPACE  # the next matmul allocated it again


def test_activations_kept_by_a_loss_are_named_exactly() -> None:
    import torch

    from gpumem.core.holders import find_holders
    from gpumem.core.holders.model import ACTIVATIONS

    requires_hopper_defaults()
    fresh_allocator()
    layers = [torch.nn.Linear(1024, 1024, bias=False), torch.nn.ReLU(), torch.nn.Linear(1024, 1024, bias=False)]
    model = torch.nn.Sequential(*layers).to("cuda:0")
    x = torch.randn(64, 1024, device="cuda:0")
    before = find_holders({"model": model, "x": x}, device="cuda:0", include_hidden=False).remainder
    loss = model(x).sum()
    torch.cuda.synchronize(0)
    report = find_holders({"model": model, "x": x, "loss": loss}, device="cuda:0", include_hidden=False)
    rows = {row.name: row for row in report.holders}
    # ReLU saves its 64x1024 float32 result (the second mm's saved input: the same storage); the mm nodes
    # also save x and the weights, which rows count; the first mm's output and the last output are freed.
    assert report.graph_saved_bytes == 64 * 1024 * 4
    assert rows["loss"].nbytes == 4 and rows["loss"].graph_saved_bytes == 64 * 1024 * 4
    assert {kind.kind: kind.nbytes for kind in report.kinds}[ACTIVATIONS] == 64 * 1024 * 4
    remainder = report.remainder
    assert remainder is not None and before is not None and remainder.blocks_read
    assert remainder.graph_saved_bytes == 64 * 1024 * 4
    assert remainder.workspace_bytes - before.workspace_bytes == WORKSPACE  # the first matmul on this stream
    assert remainder.rounding_bytes - before.rounding_bytes == 512 - 4  # the loss scalar's block
    assert remainder.unexplained_bytes == before.unexplained_bytes
    assert "4 B own + 256.0 KiB saved by its autograd graphs" in render(report)
    loss.backward()
    assert find_holders({"model": model, "x": x, "loss": loss}, device="cuda:0").graph_saved_bytes == 0


def test_device_used_split_reconciles_with_nvml() -> None:
    import os

    import torch

    from gpumem.core.diagnoses.device_split import device_split
    from gpumem.core.monitoring.monitor import default_monitor

    keep = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda:0")
    snapshot = default_monitor().source.snapshot(process_memory=True)
    split = device_split(snapshot, 0)
    if split is None or split.process_bytes is None:
        pytest.skip(f"NVML reports no per-process figure here (pid {os.getpid()})")
    assert split.reserved_bytes >= 256 * MIB
    driver = split.driver_bytes or 0  # NVML's v2 figure: the driver's own reservation, counted in "used"
    unlisted = split.unlisted_bytes or 0  # what no process NVML lists holds
    parts = split.reserved_bytes + split.outside_torch_bytes + driver + split.other_bytes + unlisted  # type: ignore[operator]
    assert split.used_bytes == parts
    reading = snapshot.device_for(0)
    assert reading is not None
    if reading.others_used_bytes is not None and split.driver_bytes is not None:
        # "Other processes" is what NVML lists for them, never more (0 where this process is alone).
        assert split.other_bytes == min(reading.others_used_bytes, split.used_bytes - split.process_bytes - driver)
    assert split.outside_torch_bytes is not None and 100 * MIB <= split.outside_torch_bytes <= 4 * GIB  # a CUDA context
    del keep


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
