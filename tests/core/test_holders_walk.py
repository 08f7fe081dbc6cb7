"""The holders a walk used to miss, on real CPU tensors: module tensor attributes, user code, reference cycles."""

from __future__ import annotations

import asyncio
import functools
import gc
import time
from collections.abc import Iterator
from typing import Any

import pytest

from _harness import run_cell_capture

torch = pytest.importorskip("torch")

from gpumem.core.holders import OTHER, PARAMETERS, HolderReport, find_holders, render_html, render_text  # noqa: E402
from gpumem.core.holders.callables import is_library_module  # noqa: E402
from gpumem.core.holders.hints import CYCLE_HINT_MIN_BYTES, cycle_hint, module_attribute_note  # noqa: E402
from gpumem.core.holders.tensors import DeviceFilter  # noqa: E402
from gpumem.core.holders.walk import Root, Walker, walk_root  # noqa: E402

MIB = 1 << 20


def cpu(namespace: dict[str, Any], **options: Any) -> HolderReport:
    return find_holders(namespace, device="cpu", include_hidden=False, **options)


def sizes(report: HolderReport) -> dict[str, int]:
    return {row.name: row.nbytes for row in report.holders}


def reached(name: str, obj: Any, max_depth: int = 5) -> tuple[dict[str, int], Walker]:
    """Every path one root reaches a storage by, with the storage's bytes."""
    walker = Walker(torch, DeviceFilter("cpu", None), max_depth, 10_000, time.perf_counter() + 10)
    root = Root(name, "", 0, hidden=False)
    walk_root(walker, root, (obj,), 0)
    return {edge.path: walker.sizes[key] for key, edge in root.reach.items()}, walker


class BadAttention(torch.nn.Module):  # type: ignore[misc]
    """The classic leak: forward keeps an intermediate as a plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 32, bias=False)  # 4 KiB of parameters

    def forward(self, x: Any) -> Any:
        h = self.proj(x)
        self.cache = h @ h.T  # 64 x 64 float32: 16 KiB
        return h


def bad_attention() -> BadAttention:
    att = BadAttention()
    with torch.no_grad():
        att(torch.randn(64, 32))
    return att


# -- module tensor attributes -------------------------------------------------------------------


def test_a_module_tensor_attribute_is_named_under_its_row() -> None:
    report = cpu({"att": bad_attention()})
    row = report.holders[0]
    assert (row.name, row.nbytes) == ("att", 4096 + 16384)
    assert row.breakdown == {PARAMETERS: 4096, OTHER: 16384}
    assert row.note == "att.cache 16.0 KiB (tensor attribute of a module, not a parameter or buffer)"
    assert "att.cache 16.0 KiB (tensor attribute of a module" in render_text(report)
    assert "att.cache 16.0 KiB (tensor attribute of a module" in render_html(report)


def test_module_attributes_are_grouped_by_attribute_and_ranked() -> None:
    model = torch.nn.Sequential(*[bad_attention() for _ in range(4)])
    model[0].history = [torch.zeros(1000), {"k": torch.zeros(500)}]  # 6,000 bytes under one attribute
    model[1].weight_t = model[1].proj.weight.T  # a view of a parameter: counted as the parameter
    report = cpu({"model": model})
    row = report.holders[0]
    assert row.breakdown == {PARAMETERS: 4 * 4096, OTHER: 4 * 16384 + 6000}
    assert row.note == (
        "model.0.cache 16.0 KiB, model.1.cache 16.0 KiB, model.2.cache 16.0 KiB and 2 more (21.9 KiB) "
        "(tensor attributes of modules, not parameters or buffers)"
    )
    assert "weight_t" not in row.note


def test_a_module_attribute_also_named_elsewhere_is_still_named() -> None:
    att = bad_attention()
    report = cpu({"att": att, "cache": att.cache})
    assert sizes(report) == {"cache": 16384, "att": 4096}
    assert "att.cache 16.0 KiB (tensor attribute" in report.holders[1].note  # att reaches it, cache owns it


def test_the_attribute_note_text() -> None:
    assert module_attribute_note({}, {}) == ""
    keys = {("cpu", 1, 10): "m.a", ("cpu", 2, 20): "m.a", ("cpu", 3, 5): "m.b"}
    note = module_attribute_note(keys, {("cpu", 1, 10): 10, ("cpu", 2, 20): 20, ("cpu", 3, 5): 5})
    assert note == "m.a 30 B, m.b 5 B (tensor attributes of modules, not parameters or buffers)"


# -- user code ----------------------------------------------------------------------------------


def make_closure() -> Any:
    t = torch.empty(3000, dtype=torch.uint8)
    return lambda: t.shape


def test_a_closure_cell_is_walked() -> None:
    paths, _ = reached("f", make_closure())
    assert paths == {"f.<closure t>": 3000}
    assert sizes(cpu({"f": make_closure()})) == {"f": 3000}


def test_a_partial_keeps_its_arguments() -> None:
    p = functools.partial(torch.add, torch.zeros(10), alpha=torch.zeros(20))
    paths, _ = reached("p", p)
    assert paths == {"p.args[0]": 40, "p.keywords['alpha']": 80}


def test_bound_methods_keep_their_object() -> None:
    class Holder:
        def __init__(self) -> None:
            self.t = torch.zeros(25)

        def run(self) -> None:
            pass

    x = torch.zeros(40)
    cache: list[Any] = [torch.zeros(5)]
    assert reached("m", Holder().run)[0] == {"m.__self__.t": 100}
    assert reached("m", x.add_)[0] == {"m.__self__": 160}
    assert reached("m", cache.append)[0] == {"m.__self__[0]": 20}
    assert reached("m", torch.zeros)[0] == {}  # a library function: its module is not walked


def test_suspended_generators_and_coroutines_keep_their_locals() -> None:
    def produce(seed: Any) -> Iterator[int]:
        buffer = torch.zeros(30)
        yield buffer.numel()

    async def work(argument: Any) -> None:
        await asyncio.sleep(0)

    async def stream(argument: Any) -> Any:
        yield argument

    started = produce(torch.zeros(1))
    next(started)
    coroutine = work(torch.zeros(2))
    async_gen = stream(torch.zeros(3))
    try:
        assert reached("g", started)[0] == {"g.<local seed>": 4, "g.<local buffer>": 120}
        assert reached("g", produce(torch.zeros(7)))[0] == {"g.<local seed>": 28}  # arguments bind at creation
        assert reached("c", coroutine)[0] == {"c.<local argument>": 8}
        assert reached("a", async_gen)[0] == {"a.<local argument>": 12}
    finally:
        coroutine.close()
    finished = produce(torch.zeros(1))
    list(finished)
    assert reached("g", finished)[0] == {}


def test_a_running_generator_is_not_read_and_says_so() -> None:
    seen: list[tuple[dict[str, int], Walker]] = []

    def introspect() -> Iterator[Any]:
        local = torch.zeros(10)
        seen.append(reached("g", generator))
        yield local

    generator = introspect()
    next(generator)
    paths, walker = seen[0]
    assert paths == {}
    assert walker.truncation == ["g was running during the walk; its locals were not read"]
    assert walker.incomplete


def test_class_attributes_are_walked_but_not_library_classes() -> None:
    class Config:
        table = torch.zeros(20)
        __private_dunder__ = torch.zeros(1000)  # dunders are the class machinery: skipped

        def method(self, scale: Any = torch.zeros(3)) -> None:  # noqa: B008 (the leak under test)
            pass

    class Library:
        table = torch.zeros(20)

    Library.__module__ = "torch.nn.fake"
    assert reached("Config", Config)[0] == {"Config.table": 80, "Config.method.<default scale>": 12}
    assert reached("Library", Library)[0] == {}


def test_default_arguments_are_walked() -> None:
    positional = lambda x, cache=torch.zeros(50): cache  # noqa: E731, B008
    keyword = lambda *, scale=torch.zeros(5): scale  # noqa: E731, B008

    def decorated(first: Any, second: Any = torch.zeros(2)) -> None:  # noqa: B008
        pass

    decorated.memo = torch.zeros(4)  # type: ignore[attr-defined]
    assert reached("d", positional)[0] == {"d.<default cache>": 200}
    assert reached("k", keyword)[0] == {"k.<default scale>": 20}
    assert reached("f", decorated)[0] == {"f.<default second>": 8, "f.memo": 16}


def test_library_functions_stay_opaque() -> None:
    def helper(cache: Any = torch.zeros(9)) -> None:  # noqa: B008
        pass

    helper.__module__ = "IPython.core.fake"
    assert reached("h", helper)[0] == {}
    assert is_library_module("torch.nn.functional")
    assert is_library_module("numpy")
    assert is_library_module("builtins")
    assert not is_library_module("__main__")
    assert not is_library_module("torchy_experiments")  # only the package torch itself
    assert not is_library_module(None)


def test_user_code_is_never_run() -> None:
    calls: list[str] = []

    class Meta(type):
        def __getattribute__(cls, name: str) -> Any:
            calls.append(f"getattribute {name}")
            return super().__getattribute__(name)

        def __getattr__(cls, name: str) -> Any:
            calls.append(f"getattr {name}")
            raise AttributeError(name)

    class Guarded(metaclass=Meta):
        table = torch.zeros(10)

        @property
        def prop(self) -> Any:
            calls.append("property")
            return torch.zeros(1000)

    class Bound:
        def __init__(self) -> None:
            self.t = torch.zeros(5)

        def __getattr__(self, name: str) -> Any:
            calls.append(f"instance getattr {name}")
            raise AttributeError(name)

        def run(self) -> None:
            calls.append("run")

    def produce(value: Any) -> Iterator[Any]:
        calls.append("generator body")
        yield value

    calls.clear()  # defining the metaclass's classes looked attributes up
    ns = {"Guarded": Guarded, "bound": Bound().run, "gen": produce(Guarded), "f": lambda: Guarded}
    report = cpu(ns)
    assert calls == []
    assert sizes(report) == {"Guarded": 40, "bound": 20, "gen": 0, "f": 0}
    assert row_of(report, "gen").shared_bytes == 40  # the generator's argument is the class
    assert row_of(report, "f").shared_bytes == 40  # the lambda's closure cell is the class


def row_of(report: HolderReport, name: str) -> Any:
    return next(row for row in report.holders if row.name == name)


def test_a_big_closure_graph_is_bounded() -> None:
    functions: list[Any] = []
    for _ in range(20_000):
        functions.append(lambda functions=functions: functions)  # every function reaches every other
    ns: dict[str, Any] = {f"f{index}": function for index, function in enumerate(functions[:2000])}
    began = time.perf_counter()
    report = cpu(ns, time_budget_s=0.2)
    elapsed = time.perf_counter() - began
    assert elapsed < 5.0  # the budget is read every 256 steps: the walk stops soon after it, even on a busy machine
    assert any("time budget 0.2 s used up" in text for text in report.truncation)
    assert not report.holders  # nothing but code: no row


def test_a_deep_closure_chain_stops_at_the_depth_limit() -> None:
    def chain(inner: Any) -> Any:
        return lambda: inner

    link: Any = torch.zeros(100)
    for _ in range(10):
        link = chain(link)
    paths, walker = reached("c", link, max_depth=5)
    assert paths == {}
    assert walker.truncation == ["depth limit 5 reached (first at c" + ".<closure inner>" * 5 + ")"]
    assert reached("c", link, max_depth=11)[0] == {"c" + ".<closure inner>" * 10: 400}


def test_a_closure_in_a_real_shell(ip: Any) -> None:
    run_cell_capture(
        ip,
        "import torch, functools\n"
        "def make():\n"
        "    t = torch.empty(3000, dtype=torch.uint8)\n"
        "    return lambda: t.shape\n"
        "f = make()\n"
        "class Cfg:\n"
        "    table = torch.zeros(20)",
        raise_on_error=True,
    )
    report = find_holders(ip.user_ns, device="cpu", shell=ip)
    assert sizes(report) == {"f": 3000, "Cfg": 80}
    run_cell_capture(ip, "del f, Cfg, make")


# -- reference cycles ---------------------------------------------------------------------------


def test_the_cycle_hint_is_a_may_and_only_for_large_remainders() -> None:
    assert cycle_hint(None) == ""
    assert cycle_hint(CYCLE_HINT_MIN_BYTES - 1) == ""
    assert not gc.garbage
    hint = cycle_hint(CYCLE_HINT_MIN_BYTES)
    assert hint.startswith("some of it may be tensors kept only by reference cycles")
    assert "`%gpumem who --cycles`" in hint


def test_the_cycle_hint_says_when_the_collector_is_off_or_gc_garbage_keeps_objects() -> None:
    gc.disable()
    try:
        assert cycle_hint(100 * MIB).startswith("the garbage collector is off (gc.disable())")
    finally:
        gc.enable()
    gc.garbage.append(torch.zeros(1))
    try:
        assert cycle_hint(100 * MIB).startswith("gc.garbage keeps 1 unreachable objects alive")
    finally:
        gc.garbage.clear()
