"""The remainder named: autograd-saved tensors (real CPU graphs), workspace sizes, the split, by-kind, device split."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from gpumem.core.diagnoses.device_split import DeviceSplit, device_split, device_split_text, split_of  # noqa: E402
from gpumem.core.holders import HolderReport, find_holders, render_html, render_text  # noqa: E402
from gpumem.core.holders.kinds import kind_totals  # noqa: E402
from gpumem.core.holders.model import (  # noqa: E402
    ACTIVATIONS,
    IPYTHON_HELD,
    PARAMETERS,
    ROUNDING,
    UNATTRIBUTED,
    WORKSPACES,
    Holder,
)
from gpumem.core.holders.remainder import block_size, split_remainder  # noqa: E402
from gpumem.core.readers.workspaces import (  # noqa: E402
    WorkspaceSizes,
    clear_cublas_workspaces,
    cublas_workspace_bytes,
    cublaslt_workspace_bytes,
    workspace_sizes,
)
from gpumem.testing import FakeSource  # noqa: E402

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
H200 = {"cuda:0": WorkspaceSizes(32 * MIB, 1 * MIB, "default for sm 9.0")}


def cpu(namespace: dict[str, Any]) -> HolderReport:
    return find_holders(namespace, device="cpu", include_hidden=False)


def row(report: HolderReport, name: str) -> Holder:
    return next(r for r in report.holders if r.name == name)


# -- tensors saved by autograd graphs (real torch graphs on CPU) --------------------------------------


def test_mul_by_a_python_number_saves_only_the_wrapped_number() -> None:
    x = torch.randn(1000, requires_grad=True)
    y = (x * 2).sum()  # MulBackward0 saves `other` (2, a 0-d float64 tensor); x*2 itself is not saved
    report = cpu({"x": x, "y": y})
    assert report.graph_saved_bytes == 8
    assert row(report, "y").graph_saved_bytes == 8


def test_exp_saves_its_result_and_a_deleted_leaf_is_kept_by_accumulate_grad() -> None:
    x = torch.randn(1000, requires_grad=True)
    z = (x * 2).exp().sum()
    assert cpu({"x": x, "z": z}).graph_saved_bytes == 4000 + 8  # exp's result, the wrapped 2
    assert cpu({"z": z}).graph_saved_bytes == 4000 + 8 + 4000  # x too: AccumulateGrad holds the leaf


def test_model_activations_kept_by_a_loss_then_freed_by_backward() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.ReLU(), torch.nn.Linear(50, 10))
    inputs = torch.randn(32, 100)
    loss = model(inputs).sum()
    report = cpu({"model": model, "inputs": inputs, "loss": loss})
    # ReLU saves its 32x50 float32 result (the second Linear's input: the same storage, counted once);
    # the addmm nodes save `inputs` and the weights, which rows already count.
    assert report.graph_saved_bytes == 32 * 50 * 4
    assert row(report, "loss").graph_saved_bytes == 32 * 50 * 4
    assert row(report, "loss").nbytes == 4
    kinds = {total.kind: total.nbytes for total in report.kinds}
    assert kinds[ACTIVATIONS] == 6400
    assert kinds[PARAMETERS] == (100 * 50 + 50 + 50 * 10 + 10) * 4
    text = render_text(report)
    assert "4 B own + 6.2 KiB saved by its autograd graphs" in text
    assert "By kind:" in text and "activations (saved by autograd graphs)" in text
    loss.backward()
    assert cpu({"model": model, "inputs": inputs, "loss": loss}).graph_saved_bytes == 0


def test_saved_tensor_hooks_are_not_run_and_custom_functions_are_read() -> None:
    calls: list[str] = []

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: Any) -> Any:
            ctx.save_for_backward(a * 2)
            ctx.mask = torch.ones(10)  # a tensor kept as a plain context attribute
            return a * 3

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return grad

    x = torch.randn(100, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: calls.append("unpack") or t):
        y = Double.apply(x).exp().sum()
    report = cpu({"x": x, "y": y})
    assert calls == []
    assert report.graph_saved_bytes == 400 + 40 + 400  # a*2, the mask, exp's result


def test_a_storage_saved_by_two_graphs_is_counted_once() -> None:
    x = torch.randn(1000, requires_grad=True)
    shared = x.exp()
    first, second = shared.exp().sum(), (shared * shared).sum()
    report = cpu({"x": x, "first": first, "second": second})
    # shared (4000) is saved by exp and mul; first's exp result (4000); the other ops save nothing new.
    assert report.graph_saved_bytes == 4000 + 4000
    assert row(report, "first").graph_saved_bytes + row(report, "second").graph_saved_bytes == 8000


def test_the_graph_walk_is_bounded_by_nodes() -> None:
    from gpumem.core.holders.graphs import GraphWalker, saved_by_graphs
    from gpumem.core.holders.tensors import DeviceFilter
    from gpumem.core.holders.walk import Root, walk_root

    x = torch.randn(10, requires_grad=True)
    y = x
    for _ in range(50):
        y = y.exp()
    walker = GraphWalker(torch, DeviceFilter("cpu", None), 5, 10_000, float("inf"))
    root = Root("y", "Tensor", 0, hidden=False)
    walk_root(walker, root, (y,), 0)
    per_root, total, notes = saved_by_graphs(torch, walker, [root], max_nodes=10)
    assert total == 10 * 40 - 40  # nine exp results besides y's own storage (counted under the row)
    assert per_root[id(root)] == total
    assert notes and "lower bound" in notes[0]


# -- workspace sizes as torch chooses them ------------------------------------------------------------


def test_cublas_workspace_sizes_from_environment_and_capability() -> None:
    assert cublas_workspace_bytes({}, (9, 0)) == 32 * MIB
    assert cublas_workspace_bytes({}, (8, 0)) == 8 * MIB + 128 * KIB
    assert cublas_workspace_bytes({}, None) == 8 * MIB + 128 * KIB
    assert cublas_workspace_bytes({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, (8, 0)) == 32 * MIB
    assert cublas_workspace_bytes({"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, (9, 0)) == 128 * KIB
    assert cublas_workspace_bytes({"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}, (9, 0)) == 8 * MIB + 128 * KIB
    assert cublas_workspace_bytes({"CUBLAS_WORKSPACE_CONFIG": "nonsense"}, (9, 0)) == 32 * MIB


def test_cublaslt_workspace_size_is_capped_unless_not_unified() -> None:
    assert cublaslt_workspace_bytes({}, 32 * MIB) == 1 * MIB
    assert cublaslt_workspace_bytes({"CUBLASLT_WORKSPACE_SIZE": "65536"}, 32 * MIB) == 32 * MIB
    assert (
        cublaslt_workspace_bytes(
            {"CUBLASLT_WORKSPACE_SIZE": "65536", "TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}, 32 * MIB
        )
        == 64 * MIB
    )
    assert cublaslt_workspace_bytes({"CUBLASLT_WORKSPACE_SIZE": "bad"}, 32 * MIB) == 1 * MIB


def test_without_cuda_no_size_is_guessed_and_nothing_is_cleared() -> None:
    assert workspace_sizes(0) is None
    assert clear_cublas_workspaces(torch) is False


# -- the split arithmetic -----------------------------------------------------------------------------


def test_block_size_rounds_to_512() -> None:
    assert [block_size(n) for n in (1, 511, 512, 513, 4_000_000)] == [512, 512, 512, 1024, 4_000_256]


def test_split_with_blocks_names_the_workspace_and_the_rounding_exactly() -> None:
    # w and v (1000x1000 float32, 4,000,000 B each, blocks of 4,000,256 B) and one cuBLAS workspace.
    counted = {("cuda:0", 0x1000, 4_000_000): 4_000_000, ("cuda:0", 0x9000000, 4_000_000): 4_000_000}
    blocks = [("cuda:0", 0x1000, 4_000_256), ("cuda:0", 0x9000000, 4_000_256), ("cuda:0", 0x20000000, 32 * MIB)]
    allocated = 2 * 4_000_256 + 32 * MIB
    split = split_remainder(allocated, counted, {}, sizes=H200, blocks=blocks)
    assert (split.workspace_bytes, split.workspace_count, split.workspaces_confirmed) == (32 * MIB, 1, True)
    assert split.rounding_bytes == 512
    assert split.unexplained_bytes == 0 and split.unexplained_blocks == 0


def test_split_with_blocks_leaves_an_unknown_block_unexplained() -> None:
    saved = {("cuda:0", 0x5000, 1000): 1000}
    blocks = [("cuda:0", 0x5000, 1024), ("cuda:0", 0x8000, 3 * MIB), ("cuda:1", 0x0, 32 * MIB)]
    split = split_remainder(1024 + 3 * MIB + 32 * MIB, {}, saved, sizes=H200, blocks=blocks)
    assert split.graph_saved_bytes == 1000 and split.rounding_bytes == 24
    assert split.workspace_bytes == 0  # cuda:1's size is not known: its 32 MiB block is not called a workspace
    assert split.unexplained_bytes == 3 * MIB + 32 * MIB and split.unexplained_blocks == 2


def test_split_without_blocks_estimates_whole_workspaces() -> None:
    counted = {("cuda:0", 1, 4_000_000): 4_000_000}
    split = split_remainder(4_000_256 + 32 * MIB + 5000, counted, {}, sizes=H200, blocks=None)
    assert split.rounding_bytes == 256 and not split.workspaces_confirmed
    assert (split.workspace_bytes, split.workspace_count) == (32 * MIB, 1)
    assert split.unexplained_bytes == 5000
    none_known = split_remainder(32 * MIB, {}, {}, sizes={}, blocks=None)
    assert none_known.workspace_bytes == 0 and none_known.unexplained_bytes == 32 * MIB


def test_no_rounding_is_claimed_under_cuda_malloc_async(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's pool counts the bytes asked for: the 256 B left over is unexplained, not rounding."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")  # CPU torch: read from here
    counted = {("cuda:0", 1, 4_000_000): 4_000_000}
    split = split_remainder(4_000_256 + 32 * MIB, counted, {}, sizes=H200, blocks=None)
    assert split.rounding_bytes == 0 and split.unexplained_bytes == 256
    assert (split.workspace_bytes, split.workspace_count) == (32 * MIB, 1)


def test_kinds_add_up_to_allocated_and_say_how_to_release_workspaces() -> None:
    rows = [Holder("m", "Linear", "cuda:0", 3000, 0, 2, (), {PARAMETERS: 3000})]
    split = split_remainder(
        3072 + 1024 + 512 + 32 * MIB, {("cuda:0", 1, 3000): 3000}, {("cuda:0", 9, 1000): 1000}, sizes=H200, blocks=None
    )
    kinds = kind_totals(rows, 512, 1000, split)
    by_kind = {total.kind: total for total in kinds}
    assert (
        sum(total.nbytes for total in kinds) == split.allocated_bytes + 512
    )  # hidden 512 is outside the counted dict here
    assert by_kind[WORKSPACES].nbytes == 32 * MIB
    assert "torch._C._cuda_clearCublasWorkspaces()" in by_kind[WORKSPACES].note
    assert "estimate" in by_kind[WORKSPACES].note
    assert by_kind[IPYTHON_HELD].nbytes == 512 and by_kind[ROUNDING].nbytes == 72 + 24
    assert UNATTRIBUTED not in by_kind or by_kind[UNATTRIBUTED].nbytes == split.unexplained_bytes


# -- through find_holders with a fake source ----------------------------------------------------------


def test_fake_source_remainder_is_unexplained_and_the_device_split_is_in_the_footer() -> None:
    source = FakeSource(context_bytes=500 * MIB, other_processes_bytes=64 * MIB)
    source.allocate(10 * MIB)
    report = find_holders({"x": torch.zeros(10)}, device="cuda", include_hidden=False, source=source)
    assert report.remainder is not None and report.remainder.unexplained_bytes == 10 * MIB
    assert "unexplained 10.0 MiB" in report.unattributed
    assert report.device_splits == (
        DeviceSplit(0, 10 * MIB + 500 * MIB + 64 * MIB, 10 * MIB, 500 * MIB, 64 * MIB, 510 * MIB, 0, 0),
    )
    text = render_text(report)
    assert (
        "device used 574.0 MiB = PyTorch reserved 10.0 MiB + this process outside PyTorch 500.0 MiB "
        "(CUDA context, libraries) + other processes 64.0 MiB"
    ) in text
    assert "unattributed" in text and "10.0 MiB" in text
    html = render_html(report)
    assert "gpumem-kinds" in html and "other processes 64.0 MiB" in html


def test_device_split_without_the_per_process_figure() -> None:
    source = FakeSource(context_bytes=300 * MIB)
    source.allocate(3 * MIB)
    snapshot = source.snapshot(process_memory=False)
    split = device_split(snapshot, 0)
    assert split is not None and split.outside_torch_bytes is None
    assert device_split_text(split) == (
        "device used 304.0 MiB = PyTorch reserved 4.0 MiB + 300.0 MiB outside PyTorch "
        "(CUDA contexts, libraries, other processes, the driver)"
    )
    assert device_split(FakeSource(nvml=False).snapshot(process_memory=True), 0) is None


def test_device_split_names_the_drivers_reservation_apart_from_other_processes() -> None:
    # NVML's "used" counts what the driver keeps for itself; a device with no other process on it must not
    # show that as "other processes".
    source = FakeSource(context_bytes=500 * MIB, driver_bytes=624 * MIB)
    source.allocate(10 * MIB)
    split = device_split(source.snapshot(process_memory=True), 0)
    assert split == DeviceSplit(0, 10 * MIB + 500 * MIB + 624 * MIB, 10 * MIB, 500 * MIB, 0, 510 * MIB, 624 * MIB, 0)
    assert device_split_text(split).endswith(
        "+ this process outside PyTorch 500.0 MiB (CUDA context, libraries) + driver and firmware 624.0 MiB"
        " + other processes 0 B"
    )
    busy = FakeSource(context_bytes=500 * MIB, driver_bytes=624 * MIB, other_processes_bytes=3 * GIB)
    shared = device_split(busy.snapshot(process_memory=True), 0)
    assert shared is not None and (shared.driver_bytes, shared.other_bytes) == (624 * MIB, 3 * GIB)
    assert shared.used_bytes == shared.reserved_bytes + 500 * MIB + 624 * MIB + 3 * GIB


def test_device_split_where_the_driver_does_not_say_labels_the_rest_as_both() -> None:
    split = split_of(0, used=2 * GIB, reserved=GIB, process=GIB + 500 * MIB, driver=None)
    assert (split.driver_bytes, split.other_bytes) == (None, 524 * MIB)
    assert device_split_text(split).endswith("+ other processes (and the driver) 524.0 MiB")
    # A driver figure larger than what is left (read a moment apart) never makes another part negative.
    late = split_of(0, used=2 * GIB, reserved=GIB, process=GIB + 500 * MIB, driver=600 * MIB)
    assert (late.driver_bytes, late.other_bytes) == (524 * MIB, 0)
    # Without the driver's figure the listed processes are not told apart from it either.
    listed = split_of(0, used=2 * GIB, reserved=GIB, process=GIB + 500 * MIB, driver=None, others=100 * MIB)
    assert (listed.other_bytes, listed.unlisted_bytes) == (524 * MIB, None)


def test_device_split_names_what_no_listed_process_holds() -> None:
    # An H200 with only this process on it (2026-12-04): used 1,465,778,176 B; NVML's figure for this process
    # 811,597,824 B; the driver's 644,939,776 B; no other process listed. The 8.8 MiB left is no other process's.
    split = split_of(0, 1_465_778_176, 256 * MIB, 811_597_824, driver=644_939_776, others=0)
    assert (split.other_bytes, split.unlisted_bytes) == (0, 9_240_576)
    assert device_split_text(split).endswith(
        "+ driver and firmware 615.1 MiB + other processes 0 B + held by no process NVML lists 8.8 MiB"
    )
    parts = [
        split.reserved_bytes,
        split.outside_torch_bytes,
        split.driver_bytes,
        split.other_bytes,
        split.unlisted_bytes,
    ]
    assert sum(parts) == split.used_bytes  # type: ignore[arg-type]
    busy = split_of(0, 10 * GIB, GIB, 2 * GIB, driver=600 * MIB, others=3 * GIB)
    assert (busy.other_bytes, busy.unlisted_bytes) == (3 * GIB, 10 * GIB - 2 * GIB - 600 * MIB - 3 * GIB)
    # Listed processes read a moment after "used" and larger than what is left never make a part negative.
    late = split_of(0, 4 * GIB, GIB, 2 * GIB, driver=GIB, others=3 * GIB)
    assert (late.other_bytes, late.unlisted_bytes) == (GIB, 0)
    assert device_split_text(late).endswith("+ driver and firmware 1.0 GiB + other processes 1.0 GiB")


# -- the cell report's device line, and free --workspaces ---------------------------------------------


def test_cell_report_splits_device_used_under_the_device() -> None:
    from gpumem.core.cells import CellOptions, CellTracker
    from gpumem.core.cells.report import CellReport
    from gpumem.core.monitoring.monitor import Monitor

    fake = FakeSource(context_bytes=520 * MIB, other_processes_bytes=64 * MIB)
    tracker = CellTracker(Monitor(fake), start_sampler=False)
    try:
        cell = tracker.begin("x = torch.ones(...)", options=CellOptions(mode="magic"))
        fake.allocate(1536 * MIB)
        record = tracker.end(cell, error=None)
        quiet = tracker.begin("y = 1", options=CellOptions())  # automatic mode: no split, no per-process read
        assert tracker.end(quiet, error=None).devices[0].process_used_after_bytes is None
    finally:
        tracker.close()
    (change,) = record.devices
    assert change.process_used_after_bytes == 1536 * MIB + 520 * MIB
    expected = (
        "device used 2.1 GiB = PyTorch reserved 1.5 GiB + this process outside PyTorch 520.0 MiB "
        "(CUDA context, libraries) + other processes 64.0 MiB"
    )
    assert expected in repr(CellReport(record))
    assert expected in CellReport(record)._repr_html_()


def test_cell_report_has_no_split_line_without_nvml() -> None:
    from gpumem.core.cells import CellOptions, CellTracker
    from gpumem.core.cells.report import CellReport
    from gpumem.core.monitoring.monitor import Monitor

    fake = FakeSource(nvml=False)
    tracker = CellTracker(Monitor(fake), start_sampler=False)
    try:
        cell = tracker.begin("y = 1", options=CellOptions())
        fake.allocate(2 * MIB)
        record = tracker.end(cell, error=None)
    finally:
        tracker.close()
    assert "PyTorch reserved" not in repr(CellReport(record))


def test_free_workspaces_without_cuda_says_there_was_none() -> None:
    from gpumem.core.cleanup import free

    result = free(source=FakeSource(), workspaces=True)
    assert result.workspaces is False
    assert "no cuBLAS workspace to release (CUDA is not initialized)" in result.describe()
    assert free(source=FakeSource()).note == ""


def test_free_magic_accepts_workspaces(ip: Any) -> None:
    from _harness import run_cell_capture

    result, captured = run_cell_capture(ip, "%load_ext gpumem\n%gpumem free --workspaces")
    text = "\n".join(o.data.get("text/plain", "") for o in captured.outputs) + captured.stdout
    assert result.success, text
    assert "no cuBLAS workspace to release" in text
    run_cell_capture(ip, "%unload_ext gpumem")


def test_saved_tensors_are_read_as_torch_2_11_exposes_them() -> None:
    """torch 2.11's SavedTensor has ``data`` and ``register_hooks`` but no ``unpack``: still read through ``data``."""
    from gpumem.core.holders.graphs import _saved_data

    tensor = torch.zeros(3)

    class SavedTensor211:
        data = property(lambda self: tensor)

        def register_hooks(self, *hooks: object) -> None:
            raise AssertionError("never called")

    assert _saved_data(SavedTensor211()) is tensor
    assert _saved_data(tensor) is tensor


def test_node_wrappers_made_afresh_at_each_access_are_all_walked() -> None:
    """torch 2.11 can hand out a new Python wrapper per access: a freed wrapper's id() must not hide a later node."""
    from gpumem.core.holders.graphs import GraphWalker, saved_by_graphs
    from gpumem.core.holders.tensors import DeviceFilter
    from gpumem.core.holders.walk import Root

    saved = [torch.zeros(25 * (index + 1)) for index in range(8)]

    class Node:
        def __init__(self, index: int) -> None:
            self.index = index

        @property
        def _raw_saved_input(self) -> Any:
            return saved[self.index]

        @property
        def next_functions(self) -> tuple[tuple[Any, int], ...]:  # a new wrapper each time, as from C++
            return ((Node(self.index + 1), 0),) if self.index + 1 < len(saved) else ()

    walker = GraphWalker(torch, DeviceFilter("cpu", None), 5, 10_000, float("inf"))
    root = Root("loss", "Tensor", 0, hidden=False)
    walker.graph_starts[id(root)] = {0: Node(0)}
    _, total, notes = saved_by_graphs(torch, walker, [root])
    assert notes == []
    assert total == sum(tensor.nbytes for tensor in saved)


def test_a_heap_of_many_segments_is_split_from_sizes_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """memory_snapshot() costs ~3 us a segment: past MAX_SEGMENTS_READ it is not called at all."""
    import sys
    from types import SimpleNamespace

    from gpumem.core.holders import remainder

    def snapshot() -> list[Any]:
        raise AssertionError("memory_snapshot must not be read for a heap this large")

    segments = {"segment": {"all": {"current": remainder.MAX_SEGMENTS_READ + 1}}}
    fake = SimpleNamespace(
        cuda=SimpleNamespace(is_initialized=lambda: True, memory_snapshot=snapshot),
        _C=SimpleNamespace(_cuda_memoryStats=lambda _number: segments),
    )
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert remainder.allocator_blocks((0,)) is None
    segments["segment"]["all"]["current"] = 3
    block = {"size": 512, "state": "active_allocated"}
    fake.cuda.memory_snapshot = lambda: [{"device": 0, "address": 4096, "blocks": [block]}]
    assert remainder.allocator_blocks((0,)) == [("cuda:0", 4096, 512)]


def test_a_cell_line_labels_unattributed_an_estimate_when_the_workspaces_were_estimated() -> None:
    """Past 1,000 segments the split is from sizes: 40 MiB no storage starts at become a 32 MiB "workspace"
    (estimate) and 8 MiB unattributed. Compared with a walk that read the blocks, the cell's line must not
    say unattributed memory fell by 32 MiB as a fact: that figure is the estimate's other side."""
    from types import SimpleNamespace

    from gpumem.core.cells.kind_changes import kind_changes, kinds_line, read_kinds

    leaked = ("cuda:0", 7 << 20, 40 * MIB)  # a block no storage starts at, not a workspace's size
    read = split_remainder(40 * MIB, {}, {}, sizes=H200, blocks=[leaked])
    estimated = split_remainder(40 * MIB, {}, {}, sizes=H200, blocks=None)
    assert read.unexplained_bytes == 40 * MIB and estimated.workspace_bytes == 32 * MIB
    before = read_kinds(SimpleNamespace(kinds=kind_totals([], 0, 0, read)))
    after = read_kinds(SimpleNamespace(kinds=kind_totals([], 0, 0, estimated)))
    line = kinds_line(kind_changes(before, after), "since cell [3]")
    assert line == "by kind (since cell [3]): cuBLAS workspaces (estimate) +32.0 MiB, unattributed (estimate) -32.0 MiB"
