"""The holder walk over real CPU tensors (device filter "cpu"), in plain namespaces and a real IPython shell."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections import OrderedDict, deque
from typing import Any

import pytest

from _harness import run_cell_capture

torch = pytest.importorskip("torch")

from gpumem.core.holders import (  # noqa: E402
    BUFFERS,
    GRADIENTS,
    OPTIMIZER_STATE,
    PARAMETERS,
    HolderReport,
    find_cycles,
    find_holders,
    parse_device,
    render_html,
    render_text,
)
from gpumem.ipython.memory_magics import magic_who  # noqa: E402
from gpumem.testing import FakeSource  # noqa: E402

MIB = 1 << 20


def cpu(namespace: dict[str, Any], **options: Any) -> HolderReport:
    return find_holders(namespace, device="cpu", include_hidden=False, **options)


def row(report: HolderReport, name: str) -> Any:
    matches = [r for r in [*report.holders, *report.hidden] if r.name == name]
    assert matches, f"{name} not in {[r.name for r in report.holders]} / {[r.name for r in report.hidden]}"
    return matches[0]


def test_plain_tensors_sorted_by_bytes_with_exact_sizes() -> None:
    ns = {"small": torch.zeros(10), "big": torch.zeros(1000, dtype=torch.float64), "n": 3, "s": "text"}
    report = cpu(ns)
    assert [r.name for r in report.holders] == ["big", "small"]
    assert row(report, "big").nbytes == 8000
    assert row(report, "small").nbytes == 40
    assert report.total_bytes == 8040
    assert row(report, "big").device == "cpu"
    assert row(report, "big").type_name == "Tensor"
    assert not report.truncated


def test_views_share_one_storage_counted_once_and_noted() -> None:
    x = torch.zeros(1000)
    ns = {"x": x, "y": x[:10], "z": x.view(10, 100)}
    report = cpu(ns)
    assert report.total_bytes == 4000
    assert row(report, "x").nbytes == 4000
    for name in ("y", "z"):
        r = row(report, name)
        assert r.nbytes == 0
        assert r.shared_bytes == 4000
        assert r.shared_with == ("x",)
        assert "counted under x" in r.note
    assert set(row(report, "x").shared_with) == {"y", "z"}


def test_containers_and_objects_are_walked() -> None:
    @dataclasses.dataclass
    class Batch:
        inputs: Any
        labels: Any

    class Plain:
        def __init__(self) -> None:
            self.cache = {"k": [torch.zeros(100)]}

    class Slotted:
        __slots__ = ("tensor", "unset")

        def __init__(self) -> None:
            self.tensor = torch.zeros(50)

    ns = {
        "batch": Batch(torch.zeros(25), torch.zeros(25)),
        "plain": Plain(),
        "slotted": Slotted(),
        "tup": (torch.zeros(1), [torch.zeros(2)]),
        "st": {torch.zeros(3)},
        "od": OrderedDict(a=torch.zeros(4)),
        "dq": deque([torch.zeros(5)]),
        "keyed": {torch.zeros(6): "tensor as a key"},
    }
    report = cpu(ns)
    sizes = {r.name: r.nbytes for r in report.holders}
    assert sizes == {
        "batch": 200,
        "plain": 400,
        "slotted": 200,
        "tup": 12,
        "st": 12,
        "od": 16,
        "dq": 20,
        "keyed": 24,
    }
    assert row(report, "batch").tensor_count == 2


def test_module_breakdown_and_optimizer_state_attributed_without_double_counting() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    params = sum(p.numel() * 4 for p in model.parameters())
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    state = sum(
        v.untyped_storage().nbytes() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    ns = {"model": model, "opt": optimizer}
    report = cpu(ns)
    m = row(report, "model")
    assert m.breakdown[PARAMETERS] == params
    assert m.breakdown[GRADIENTS] == params
    assert m.breakdown[BUFFERS] == buffers
    assert m.breakdown[OPTIMIZER_STATE] == state
    assert m.nbytes == 2 * params + buffers + state
    assert "optimizer state held by opt" in m.note
    o = row(report, "opt")
    assert o.nbytes == 0 and o.shared_bytes > 0
    assert report.total_bytes == m.nbytes  # nothing counted twice


def test_optimizer_alone_owns_its_parameters_and_state() -> None:
    optimizer = torch.optim.SGD(torch.nn.Linear(10, 10).parameters(), lr=0.1, momentum=0.9)
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    optimizer.step()
    report = cpu({"opt": optimizer})
    o = row(report, "opt")
    assert o.breakdown[PARAMETERS] == 440
    assert o.breakdown[GRADIENTS] == 440
    assert o.breakdown[OPTIMIZER_STATE] == 440


def test_scheduler_does_not_take_the_model_or_optimizer_rows() -> None:
    model = torch.nn.Linear(10, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    report = cpu({"sched": scheduler, "model": model, "opt": optimizer})
    assert row(report, "model").nbytes == 440
    assert row(report, "sched").nbytes == 0


def test_graph_paths_name_tensors_with_grad_fn() -> None:
    w = torch.ones(3, requires_grad=True)
    losses = [(w * w).sum() for _ in range(3)]  # each graph saves w for backward
    report = cpu({"losses": losses, "w": w})
    assert row(report, "losses").graph_paths == ("losses[0]", "losses[1]", "losses[2]")
    assert row(report, "w").graph_paths == ()


def test_a_graph_backward_freed_or_that_saved_nothing_is_not_said_to_be_kept() -> None:
    w = torch.ones(1000, requires_grad=True)
    loss = (w.exp() * w).sum()  # saves exp(w), an activation no name holds
    kept = (w + 1).sum()  # saves no tensor: only the leaf w, named anyway
    report = cpu({"loss": loss, "kept": kept, "w": w})
    assert row(report, "loss").graph_paths == ("loss",)
    assert row(report, "loss").graph_saved_bytes == 4000
    assert row(report, "kept").graph_paths == ()
    loss.backward()  # frees what the graph saved; loss keeps its grad_fn
    report = cpu({"loss": loss, "w": w})
    assert loss.grad_fn is not None
    assert row(report, "loss").graph_paths == ()
    assert row(report, "loss").graph_saved_bytes == 0


def test_a_graph_that_keeps_a_deleted_models_parameters_is_named() -> None:
    model = torch.nn.Linear(10, 10)
    out = model(torch.ones(1, 10)).sum()
    del model  # only the graph's AccumulateGrad nodes keep the parameters now
    report = cpu({"out": out})
    assert row(report, "out").graph_paths == ("out",)
    assert row(report, "out").graph_saved_bytes >= 440


def test_leaf_gradient_counted_and_non_leaf_grad_never_read() -> None:
    w = torch.ones(100, requires_grad=True)
    (w * 2).sum().backward()
    y = w * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reading .grad of a non-leaf would warn
        report = cpu({"w": w, "y": y})
    assert row(report, "w").breakdown == {"tensors": 400, GRADIENTS: 400}


def test_hostile_objects_never_run_user_code() -> None:
    calls: list[str] = []

    class Hostile:
        def __init__(self) -> None:
            self.t = torch.zeros(10)

        @property
        def prop(self) -> Any:
            calls.append("property")
            return torch.zeros(1000)

        def __getattr__(self, name: str) -> Any:
            calls.append(f"getattr {name}")
            raise AttributeError(name)

        def __eq__(self, other: object) -> bool:
            calls.append("eq")
            raise RuntimeError("eq")

        def __hash__(self) -> int:
            calls.append("hash")
            raise RuntimeError("hash")

        def __len__(self) -> int:
            calls.append("len")
            raise RuntimeError("len")

    class WeirdList(list):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            calls.append("iter")
            raise RuntimeError("iter")

        def __len__(self) -> int:
            calls.append("len")
            return -1  # noqa: PLE0303 (a broken __len__ on purpose: the walk must never call it)

    class WeirdDict(dict):  # type: ignore[type-arg]
        def items(self) -> Any:
            calls.append("items")
            raise RuntimeError("items")

    class DictProperty:
        @property
        def __dict__(self) -> Any:  # type: ignore[override]
            calls.append("__dict__")
            return {"t": torch.zeros(1)}

    def generator() -> Any:
        calls.append("generator")
        yield torch.zeros(1)

    ns = {
        "hostile": Hostile(),
        "wl": WeirdList([torch.zeros(20)]),
        "wd": WeirdDict(a=torch.zeros(30)),
        "dp": DictProperty(),
        "gen": generator(),
    }
    report = cpu(ns)
    assert calls == []
    assert {r.name: r.nbytes for r in report.holders} == {"hostile": 40, "wl": 80, "wd": 120}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_proxies_and_exception_properties_never_run() -> None:
    calls: list[str] = []

    class LazyProxy:
        @property  # type: ignore[misc]
        def __class__(self) -> type:
            calls.append("__class__")
            return torch.Tensor

    class OddError(Exception):
        @property
        def args(self) -> Any:  # type: ignore[override]
            calls.append("args")
            return (torch.zeros(1000),)

    error = OddError()
    BaseException.__dict__["args"].__set__(error, (torch.zeros(7),))
    report = cpu({"proxy": LazyProxy(), "error": error})
    assert calls == []
    assert {r.name: r.nbytes for r in report.holders} == {"error": 28}


def test_a_failing_root_costs_only_its_own_completeness(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumem.core.holders.walk import Walker

    class Fragile:
        def __init__(self) -> None:
            self.t = torch.zeros(5)

    original = Walker.attributes

    def attributes(self: Any, obj: Any, *args: Any) -> None:
        if type(obj) is Fragile:
            raise RuntimeError("dictionary changed size during iteration")
        original(self, obj, *args)

    monkeypatch.setattr(Walker, "attributes", attributes)
    report = cpu({"a": torch.zeros(10), "fragile": Fragile(), "c": torch.zeros(20)})
    assert {r.name for r in report.holders} == {"a", "c"}
    assert report.truncated
    assert report.truncation == ("fragile not fully walked (RuntimeError: dictionary changed size during iteration)",)


def test_a_namespace_and_a_container_another_thread_changes_are_walked_whole() -> None:
    growing: dict[str, Any] = {}
    ns: dict[str, Any] = {f"n{index}": index for index in range(20_000)}
    ns.update(stable=torch.zeros(100), growing=growing)
    stop = threading.Event()

    def churn() -> None:  # adds 500 names one by one, then removes them: both sizes change at every step
        index = 0
        while not stop.is_set():
            name = f"churn_{index % 500}"
            for target in (ns, growing):
                if index // 500 % 2:
                    target.pop(name, None)
                else:
                    target[name] = torch.zeros(1)
            index += 1

    mutator = threading.Thread(target=churn)
    mutator.start()
    reports: list[HolderReport] = []
    try:
        deadline = time.monotonic() + 3.0
        while len(reports) < 100 and time.monotonic() < deadline:
            reports.append(cpu(ns))
    finally:
        stop.set()
        mutator.join()
    assert reports
    assert [note for report in reports for note in report.truncation] == []
    assert all(row(report, "stable").nbytes == 400 for report in reports)


def test_a_copy_that_fails_is_taken_again_then_given_up() -> None:
    from gpumem.core.holders.objects import READ_ATTEMPTS, stable_list

    failures = iter(range(READ_ATTEMPTS - 1))

    def changing() -> Any:
        if next(failures, None) is not None:
            raise RuntimeError("dictionary changed size during iteration")
        return iter([1, 2, 3])

    assert stable_list(changing) == [1, 2, 3]
    assert stable_list(iter(range(100)).__iter__, limit=2) == [0, 1]

    def always_changing() -> Any:
        raise RuntimeError("dictionary changed size during iteration")

    with pytest.raises(RuntimeError):
        stable_list(always_changing)


def test_meta_sparse_quantized_nested_and_subclasses_do_not_crash() -> None:
    dense = torch.randn(20, 20)
    sparse = dense.to_sparse()
    ns: dict[str, Any] = {
        "meta": torch.empty(10**9, device="meta"),
        "sparse": sparse,
        "csr": dense.to_sparse_csr(),
        "nested": torch.nested.nested_tensor([torch.randn(3), torch.randn(4)]),
        "jagged": torch.nested.nested_tensor([torch.randn(3), torch.randn(4)], layout=torch.jagged),
        "param": torch.nn.Parameter(torch.zeros(5)),
        "quantized": torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8),
    }
    report = cpu(ns)
    names = {r.name for r in report.holders}
    assert "meta" not in names
    expected_sparse = sparse._indices().untyped_storage().nbytes() + sparse._values().untyped_storage().nbytes()
    assert row(report, "sparse").nbytes == expected_sparse
    assert row(report, "jagged").nbytes > 0
    assert row(report, "nested").nbytes > 0
    assert row(report, "param").breakdown == {"tensors": 20}
    assert row(report, "quantized").nbytes == 400


def test_device_filter_excludes_other_devices() -> None:
    ns = {"x": torch.zeros(10)}
    assert find_holders(ns, device="cuda", include_hidden=False).holders == []
    assert find_holders(ns, device="all", include_hidden=False).total_bytes == 40
    assert parse_device("cuda:1") == ("cuda", 1)
    assert parse_device(2) == ("cuda", 2)
    assert parse_device("all") == (None, None)
    for bad in ("gpu", "cuda:x", "all:1", -1):
        with pytest.raises(ValueError):
            parse_device(bad)


def test_depth_items_and_time_limits_are_reported() -> None:
    deep: Any = torch.zeros(1)
    for _ in range(10):
        deep = [deep]
    report = cpu({"deep": deep}, max_depth=4)
    assert report.truncated and any("depth limit 4" in note for note in report.truncation)
    assert report.total_bytes == 0
    assert cpu({"deep": deep}, max_depth=12).total_bytes == 4

    many = [torch.zeros(1) for _ in range(50)]
    capped = cpu({"many": many}, max_items=10)
    assert capped.truncated and "only the first 10" in capped.truncation[0]
    assert capped.total_bytes == 40

    lots = {f"v{i}": [torch.zeros(1)] for i in range(2000)}
    timed = cpu(lots, time_budget_s=0.0)
    assert timed.truncated and any("time budget" in note for note in timed.truncation)


def test_a_row_the_walk_stopped_inside_shows_a_lower_bound() -> None:
    many = [torch.zeros(1) for _ in range(50)]
    report = cpu({"many": many, "whole": torch.zeros(4)}, max_items=10)
    assert not row(report, "many").complete and row(report, "whole").complete
    text = render_text(report)
    assert any(line.lstrip().startswith("many") and line.endswith("\u2265 40 B") for line in text.splitlines())
    assert "  16 B" in text and "\u2265 16 B" not in text  # the complete row stays exact
    assert text.count("\u2265") == 2  # the row and the total
    assert "\u2265 40 B" in render_html(report)
    assert "\u2265" not in render_text(cpu({"whole": torch.zeros(4)}))


def test_an_empty_result_of_a_cut_short_walk_does_not_claim_there_is_nothing() -> None:
    ints = list(range(50))
    complete = find_holders({"ints": ints}, device="all", include_hidden=False)
    assert "no name holds tensor memory on any device" in render_text(complete)
    cut = find_holders({"ints": ints}, device="all", include_hidden=False, max_items=10)
    assert "no name was found holding tensor memory on any device (the walk stopped early" in render_text(cut)
    assert "no name holds" not in render_html(cut)


def test_cycles_found_and_collected() -> None:
    import gc
    import weakref

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # type: ignore[attr-defined]
    a.tensor = torch.zeros(256)  # type: ignore[attr-defined]
    ref = weakref.ref(a.tensor)  # type: ignore[attr-defined]
    gc.collect()  # earlier tests' unreachable cycles would be counted too, and may outnumber these two
    gc.disable()
    try:
        del a, b
        report = find_cycles("cpu")
    finally:
        gc.enable()
    assert report.nbytes == 1024
    assert report.tensor_count == 1
    assert dict(report.member_types)["Node"] == 2
    assert ref() is None
    assert gc.garbage == []


def test_remainder_against_memory_allocated_from_a_source() -> None:
    source = FakeSource()
    source.allocate(10 * MIB)
    report = find_holders({"x": torch.zeros(10)}, device="cuda", include_hidden=False, source=source)
    assert report.allocated_bytes == 10 * MIB
    assert report.unattributed_bytes == 10 * MIB
    assert "held by no name" in report.unattributed and "unexplained 10.0 MiB" in report.unattributed
    cpu_report = cpu({"x": torch.zeros(10)})
    assert cpu_report.allocated_bytes is None and "n/a" in cpu_report.unattributed


def test_without_torch_says_so() -> None:
    code = textwrap.dedent(
        """
        import sys
        from gpumem.core.holders import find_holders
        report = find_holders({"x": [1, 2]})
        assert "torch" not in sys.modules
        print(report.torch_loaded, report.unattributed)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_env())
    assert out.stdout.startswith("False torch is installed but not imported")


def _env() -> dict[str, str]:
    import os
    from pathlib import Path

    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src")
    return env


def test_render_text_and_html() -> None:
    model = torch.nn.Linear(100, 100)
    ns = {"model": model, "x": torch.zeros(10), "y": torch.zeros(10)}
    ns["alias"] = ns["x"]
    report = cpu(ns)
    text = render_text(report)
    assert "model" in text and "parameters 39.5 KiB" in text and "counted under x" in text
    html = render_html(report)
    assert "<table>" in html and "<code>model</code>" in html


# ------------------------------------------------------------------------------------------
# In a real IPython shell
# ------------------------------------------------------------------------------------------


def test_ipython_output_cache_and_exception_are_hidden_rows(ip: Any) -> None:
    run_cell_capture(ip, "import torch")
    first, _ = run_cell_capture(ip, "torch.zeros(1000)")
    second, _ = run_cell_capture(ip, "x = torch.zeros(500)\nx")
    run_cell_capture(ip, "def fail():\n    local = torch.zeros(2000)\n    raise ValueError('boom')\nfail()")
    report = find_holders(ip.user_ns, device="cpu")
    assert [r.name for r in report.holders] == ["x"]
    hidden = {r.name: r for r in report.hidden}
    out_first = hidden[f"Out[{first.execution_count}]"]
    assert out_first.nbytes == 4000
    assert f"_{first.execution_count}" in out_first.note
    out_3 = hidden[f"Out[{second.execution_count}]"]
    assert out_3.nbytes == 0 and "still held by x" in out_3.note
    error_rows = [r for r in report.hidden if r.name.startswith("last exception")]
    assert len(error_rows) == 1 and error_rows[0].nbytes == 8000
    assert "ValueError" in error_rows[0].name
    assert report.hidden_bytes == 12000
    assert report.total_bytes == 2000


def test_ipython_names_are_not_user_rows(ip: Any) -> None:
    run_cell_capture(ip, "import torch\ntorch.ones(10)")
    run_cell_capture(ip, "_private = torch.ones(20)\n_ = torch.ones(30)")
    report = find_holders(ip.user_ns, device="cpu")
    names = [r.name for r in report.holders]
    assert "_private" in names and "_" in names  # the user's own assignments are theirs
    assert "Out" not in names and "_oh" not in names and "_1" not in names


def test_magic_who_renders_and_rejects_bad_input(ip: Any) -> None:
    from IPython.core.error import UsageError

    run_cell_capture(ip, "import torch\nweights = torch.zeros(256)\ntorch.zeros(64)")
    from IPython.utils.capture import capture_output

    with capture_output(display=True) as cap:
        magic_who(ip, "--device cpu --all")
    data = cap.outputs[0].data
    assert "weights" in data["text/plain"] and "1.0 KiB" in data["text/plain"]
    assert "Held by IPython" in data["text/html"] and "%gpumem free --deep" in data["text/html"]
    for bad in ("--device gpu", "--depth 0", "--depth x", "--bogus"):
        with pytest.raises(UsageError):
            magic_who(ip, bad)


def test_gpumem_holders_callable_from_the_package(ip: Any) -> None:
    run_cell_capture(ip, "import torch, gpumem\nt = torch.zeros(3)\nreport = gpumem.holders(device='cpu')")
    report = ip.user_ns["report"]
    assert [r.name for r in report.holders] == ["t"]


def test_a_large_unexplained_remainder_points_to_cycles_unless_they_were_looked_for() -> None:
    source = FakeSource()
    source.allocate(100 * MIB)
    report = find_holders({}, device="cuda", include_hidden=False, source=source)
    assert "unexplained 100.0 MiB" in report.unattributed
    assert "%gpumem who --cycles" in report.unattributed
    small = FakeSource()
    small.allocate(10 * MIB)
    assert "--cycles" not in find_holders({}, device="cuda", include_hidden=False, source=small).unattributed
    looked = find_holders({}, device="cuda", include_hidden=False, source=source, cycles=True)
    assert "--cycles" not in looked.unattributed


def test_graph_paths_keep_one_past_the_cap_to_say_there_are_more() -> None:
    from gpumem.core.holders.model import MAX_GRAPH_PATHS

    w = torch.ones(3, requires_grad=True)
    report = cpu({"outs": [(w * w).sum() for _ in range(20)], "w": w})
    assert row(report, "outs").graph_paths == tuple(f"outs[{i}]" for i in range(MAX_GRAPH_PATHS + 1))
