"""The tracker's by-kind change, staircase, host leak and kept-gradient findings: a fake allocator for the
CUDA figures, real torch CPU tensors and the real holders walk (on the CPU) for the kinds."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from _harness import cpu_holders
from gpumem.core.cells import CellOptions, CellTracker
from gpumem.core.cells.report import CellReport, CellSummary, HistoryTable, record_to_dict
from gpumem.core.monitoring.monitor import Monitor
from gpumem.core.sampling.sampler import channels_of
from gpumem.testing import MIB, FakeSource

ACTIVATIONS = "activations (saved by autograd graphs)"


@pytest.fixture
def fake() -> FakeSource:
    return FakeSource()


@pytest.fixture
def tracker(fake: FakeSource) -> Iterator[CellTracker]:
    tracker = CellTracker(Monitor(fake), start_sampler=False, holder_finder=cpu_holders)
    yield tracker
    tracker.close()


def kinds_of(record: Any) -> dict[str, int]:
    return {change.kind: change.delta_bytes for change in record.kinds}


def test_a_model_and_adamw_cell_by_kind(tracker: CellTracker, fake: FakeSource) -> None:
    torch = pytest.importorskip("torch")
    ns: dict[str, Any] = {"torch": torch}
    cell = tracker.begin("train", options=CellOptions(attribute=True, mode="magic"), namespace=ns)
    model = torch.nn.Linear(512, 512)  # 512 * 512 + 512 float32: 1,050,624 bytes
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    optimizer.step()
    ns.update(model=model, optimizer=optimizer)
    fake.allocate(8 * MIB)
    record = tracker.end(cell, namespace=ns)
    params = 512 * 512 * 4 + 512 * 4
    assert kinds_of(record) == {"parameters": params, "gradients": params, "optimizer state": 2 * params + 8}
    assert record.kinds_since == "since the start of the cell"
    text = repr(CellReport(record))
    line = "by kind (since the start of the cell): parameters +1.0 MiB, gradients +1.0 MiB, optimizer state +2.0 MiB"
    assert f"  {line}" in text
    assert f'<div class="kinds">{line}</div>' in CellReport(record)._repr_html_()
    exported = record_to_dict(record)
    assert {"kind": "gradients", "before_bytes": 0, "after_bytes": params, "delta_bytes": params} in exported["kinds"]
    assert exported["kinds_since"] == "since the start of the cell" and exported["notes"] == []
    assert record.notes == ()  # 1 MiB of gradients is below the 64 MiB worth a note


def test_kept_gradients_are_a_note_when_an_optimizer_exists(fake: FakeSource) -> None:
    torch = pytest.importorskip("torch")
    tracker = CellTracker(Monitor(fake), start_sampler=False, holder_finder=cpu_holders, pattern_min_bytes=MIB)
    model = torch.nn.Linear(512, 512)
    ns: dict[str, Any] = {"model": model}
    cell = tracker.begin("step", options=CellOptions(attribute=True, mode="magic"), namespace=ns)
    model(torch.randn(4, 512)).sum().backward()
    fake.allocate(8 * MIB)
    record = tracker.end(cell, namespace=ns)
    assert record.notes == ()  # no optimizer: the gradients may be wanted (inspection, accumulation)
    model.zero_grad(set_to_none=True)
    ns["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
    cell = tracker.begin("step", options=CellOptions(attribute=True, mode="magic"), namespace=ns)
    model(torch.randn(4, 512)).sum().backward()
    ns["optimizer"].step()
    fake.allocate(8 * MIB)
    record = tracker.end(cell, namespace=ns)
    (note,) = record.notes
    assert note.startswith("gradients are kept after the cell (1.0 MiB: `model` 1.0 MiB); optimizer.zero_grad(")
    assert not [w for w in record.warnings if "gradient" in w.message]  # information, not a warning
    assert "\u2139 gradients are kept" in repr(CellReport(record))
    summary = repr(CellSummary(record))  # one line: the kinds, and the note's first clause
    assert "; by kind gradients +1.0 MiB" in summary
    assert summary.endswith(" \u2139 gradients are kept after the cell (1.0 MiB: `model` 1.0 MiB)"), summary
    history = repr(HistoryTable([record]))
    assert "by kind" in history and "gradients +1.0 MiB" in history and "\u2139 1 note" in history
    tracker.close()


def test_automatic_mode_compares_with_the_last_whole_walk_and_says_nothing_otherwise(
    tracker: CellTracker, fake: FakeSource
) -> None:
    torch = pytest.importorskip("torch")
    ns: dict[str, Any] = {}
    cell = tracker.begin("first")
    ns["a"] = torch.zeros(2 * MIB // 4)
    fake.allocate(8 * MIB)
    first = tracker.end(cell, namespace=ns, execution_count=1)
    assert first.kinds == () and first.kinds_since == ""  # nothing to compare with: no guess
    assert "by kind" not in repr(CellReport(first))

    tracker.incremental = False  # every walk covers the whole namespace
    cell = tracker.begin("second")
    ns["b"] = torch.zeros(3 * MIB // 4)
    fake.allocate(8 * MIB)
    second = tracker.end(cell, namespace=ns, execution_count=2)
    assert kinds_of(second) == {"other tensors": 3 * MIB}
    assert second.kinds_since == "since cell [1]"

    tracker.incremental = True  # walks only the changed names, unless allocated memory changed by 1 MiB or more
    cell = tracker.begin("third", options=CellOptions(attribute=True))
    ns["c"] = torch.zeros(1000)
    fake.allocate(4000)  # too little for a by-kind line: only the changed names are walked, no kind is summed
    third = tracker.end(cell, namespace=ns, execution_count=3)
    assert [v.name for v in third.variables] == ["c"]
    assert third.kinds == () and third.kinds_since == ""
    cell = tracker.begin("fourth")  # compared with the last whole walk, two cells back
    ns["d"] = torch.zeros(MIB)
    fake.allocate(8 * MIB)
    fourth = tracker.end(cell, namespace=ns, execution_count=4)
    assert kinds_of(fourth) == {"other tensors": 4 * MIB + 4000}
    assert fourth.kinds_since == "since cell [2]"


def test_automatic_mode_names_kinds_of_a_cell_that_rebinds_nothing(tracker: CellTracker, fake: FakeSource) -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(1024, 1024)
    ns: dict[str, Any] = {"model": model, "opt": torch.optim.Adam(model.parameters())}
    params = (1024 * 1024 + 1024) * 4
    cell = tracker.begin("first")
    fake.allocate(2 * MIB)
    tracker.end(cell, namespace=ns, execution_count=1)
    cell = tracker.begin("x = ...; model(x).sum().backward()")  # `x` explains the growth; only a whole walk
    ns["x"] = torch.zeros(2 * MIB // 4)  # sees the gradients of the model, which was not rebound
    model(torch.randn(8, 1024)).sum().backward()
    fake.allocate(2 * MIB)
    record = tracker.end(cell, namespace=ns, execution_count=2)
    assert {k: v for k, v in kinds_of(record).items() if v} == {"gradients": params, "other tensors": 2 * MIB}
    assert record.kinds_since == "since cell [1]"
    cell = tracker.begin("opt.step()")
    ns["opt"].step()
    fake.allocate(2 * MIB)
    record = tracker.end(cell, namespace=ns, execution_count=3)
    assert {k: v for k, v in kinds_of(record).items() if v} == {"optimizer state": 2 * params + 2 * 4}  # + steps
    assert "by kind (since cell [2]): optimizer state +8.0 MiB" in repr(CellReport(record))
    walks = dict(tracker.walks)
    cell = tracker.begin("trivial")  # memory did not change: no walk at all
    tracker.end(cell, namespace=ns, execution_count=4)
    assert tracker.walks == walks


def test_activations_kept_by_a_list_of_losses(tracker: CellTracker, fake: FakeSource) -> None:
    torch = pytest.importorskip("torch")
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(256, 256)
    ns: dict[str, Any] = {"w": w, "x": x, "losses": []}
    cell = tracker.begin("losses", options=CellOptions(attribute=True, mode="magic"), namespace=ns)
    for _ in range(4):
        ns["losses"].append(torch.relu(x @ w).sum())  # relu saves its 256 KiB result
    fake.allocate(8 * MIB)
    record = tracker.end(cell, namespace=ns)
    assert kinds_of(record)[ACTIVATIONS] == 4 * 256 * 256 * 4
    (graph,) = [w for w in record.warnings if w.kind == "graph"]
    assert "keep their whole autograd graphs alive (CUDA tensors with a grad_fn), 1.0 MiB of saved activations" in (
        graph.message
    )
    assert "by kind (since the start of the cell): activations +1.0 MiB" in repr(CellReport(record))


def _step(monitor: Monitor, fake: FakeSource, handles: list[int], nbytes: int) -> None:
    """One iteration as the sampler sees it: a sample, an allocation, a sample."""
    monitor.timeline.append(time.monotonic(), channels_of(fake.snapshot()))
    handles.append(fake.allocate(nbytes))
    monitor.timeline.append(time.monotonic(), channels_of(fake.snapshot()))
    monitor.timeline.append(time.monotonic(), channels_of(fake.snapshot()))


def test_a_staircase_inside_the_cell_is_a_warning_naming_the_variable(fake: FakeSource) -> None:
    monitor = Monitor(fake)
    tracker = CellTracker(monitor, start_sampler=False, holder_finder=lambda ns, device, names: _acc_report(ns))
    handles: list[int] = []
    cell = tracker.begin("for batch in loader: acc.append(out)", options=CellOptions(attribute=True, mode="magic"))
    for _ in range(30):
        _step(monitor, fake, handles, 64 * MIB)
    record = tracker.end(cell, namespace={"acc": handles})
    (warning,) = [w for w in record.warnings if w.kind == "staircase"]
    assert warning.message.startswith("cuda:0 allocated memory rose in 30 steps of ~64.0 MiB (+1.9 GiB) over ")
    assert "never fell: something accumulates per iteration; `acc` grew most (+1.9 GiB)" in warning.message

    # The same loop that frees what each iteration made: nothing to say.
    cell = tracker.begin("for batch in loader: step()")
    for _ in range(30):
        _step(monitor, fake, handles, 64 * MIB)
        fake.free(handles.pop())
        monitor.timeline.append(time.monotonic(), channels_of(fake.snapshot()))
    record = tracker.end(cell, namespace={"acc": handles})
    assert not [w for w in record.warnings if w.kind == "staircase"]
    tracker.close()


def _acc_report(ns: Mapping[str, Any]) -> Any:
    """A holders report in which ``acc`` holds 64 MiB per handle (the fake allocator has no tensors)."""

    class Row:
        name, type_name, device, graph_paths = "acc", "list", "cuda:0", ()
        nbytes = 64 * MIB * len(ns.get("acc", ()))

    return type("Report", (), {"holders": [Row()], "hidden": [], "truncated": False})()


def test_host_memory_growing_alike_on_three_reruns_is_a_leak(fake: FakeSource) -> None:
    fake.cuda_initialized = False  # no CUDA at all: host memory is still watched
    tracker = CellTracker(Monitor(fake), start_sampler=False)
    rss = fake.host_rss_bytes
    records = []
    for run in range(3):
        cell = tracker.begin("kept.append(np.ones(...))")
        rss += (96 + run) * MIB
        fake.set_host_rss(rss)
        records.append(tracker.end(cell))
    assert [w for r in records[:2] for w in r.warnings] == []
    (leak,) = records[2].warnings
    assert leak.kind == "leak"
    assert leak.message == (
        "possible leak on re-run: this cell has run 3 times and each of the last 3 runs left host memory (RSS) "
        "higher by about 97.0 MiB (+96.0 MiB, +97.0 MiB, +98.0 MiB); something it creates outlives the cell "
        "(a list it appends to, a cache, or IPython's Out history)"
    )
    # Growth below the host threshold (32 MiB), or unlike from run to run, is not a leak.
    for grow in (8, 8, 8, 40, 120, 40):
        cell = tracker.begin("other cell" if grow != 8 else "small")
        rss += grow * MIB
        fake.set_host_rss(rss)
        assert not tracker.end(cell).warnings
    tracker.close()


def test_a_workspace_estimate_stays_labelled_one_in_the_kinds_line() -> None:
    from gpumem.core.cells.kind_changes import kind_changes, kinds_brief, kinds_line, read_kinds
    from gpumem.core.holders.model import KindTotal

    before = read_kinds(type("R", (), {"kinds": (KindTotal("cuBLAS workspaces", 32 * MIB, "", estimate=False),)})())
    after = read_kinds(type("R", (), {"kinds": (KindTotal("cuBLAS workspaces", 64 * MIB, "", estimate=True),)})())
    assert after == (("cuBLAS workspaces (estimate)", 64 * MIB),)
    (change,) = kind_changes(before, after)  # one kind, compared across the two walks
    assert (change.kind, change.delta_bytes) == ("cuBLAS workspaces (estimate)", 32 * MIB)
    assert kinds_line((change,), "since cell [1]") == "by kind (since cell [1]): cuBLAS workspaces (estimate) +32.0 MiB"
    assert kinds_brief((change,)) == "cuBLAS workspaces (estimate) +32.0 MiB"


# A loop that keeps what it makes, faster than the sampler: told from the allocator's counters ---------------


def _loop(fake: FakeSource, handles: list[int], steps: int, nbytes: int, *, keep: bool, transient: int = 0) -> None:
    """``steps`` iterations over about 1.5 s, with no sample in between (the 1 Hz sampler's view of it)."""
    for _ in range(steps):
        handle = fake.allocate(nbytes)
        if transient:
            fake.transient(transient)
        if keep:
            handles.append(handle)
        else:
            fake.free(handle)
        time.sleep(1.5 / steps)


def test_a_short_loop_that_keeps_what_it_makes_is_called_out_from_the_counters(fake: FakeSource) -> None:
    monitor = Monitor(fake)
    tracker = CellTracker(monitor, start_sampler=False, holder_finder=lambda ns, device, names: _acc_report(ns))
    handles: list[int] = []
    cell = tracker.begin("for i in range(30): acc.append(x * 2)", options=CellOptions(attribute=True, mode="magic"))
    _loop(fake, handles, 30, 64 * MIB, keep=True, transient=64 * MIB)
    record = tracker.end(cell, namespace={"acc": handles})
    (warning,) = [w for w in record.warnings if w.kind == "staircase"]
    assert warning.message.startswith(
        "cuda:0 allocated memory rose step by step, +1.9 GiB in 30 allocations of ~64.0 MiB kept to the end of "
        "the cell, over 1."
    )
    assert "and never fell back: a loop keeps what it makes; `acc` grew most (+1.9 GiB) (keep numbers with" in (
        warning.message
    )
    assert warning.message.count("staircase") == 0 and warning.message in repr(CellReport(record))

    # The same loop freeing what each iteration made: nothing to say, however long it runs.
    cell = tracker.begin("for i in range(30): step()", options=CellOptions(attribute=True, mode="magic"))
    _loop(fake, handles, 30, 64 * MIB, keep=False)
    record = tracker.end(cell, namespace={"acc": handles})
    assert not [w for w in record.warnings if w.kind == "staircase"]
    tracker.close()


def test_counted_growth_that_is_no_loop_keeping_results_is_not_called_out(fake: FakeSource) -> None:
    torch = pytest.importorskip("torch")
    tracker = CellTracker(Monitor(fake), start_sampler=False, holder_finder=cpu_holders)
    handles: list[int] = []
    # A training loop's first run: what it keeps is small beside what each step makes and frees.
    cell = tracker.begin("train 30 steps", options=CellOptions(mode="magic"))
    _loop(fake, handles, 30, 4 * MIB, keep=True, transient=512 * MIB)
    assert not [w for w in tracker.end(cell).warnings if w.kind == "staircase"]
    # Four allocations, however large: not a loop of at least five steps.
    cell = tracker.begin("four", options=CellOptions(mode="magic"))
    _loop(fake, handles, 4, 256 * MIB, keep=True)
    assert not [w for w in tracker.end(cell).warnings if w.kind == "staircase"]
    # Thirty, all within half a second: too short to be told from the counters.
    cell = tracker.begin("quick", options=CellOptions(mode="magic"))
    handles.extend(fake.allocate(64 * MIB) for _ in range(30))
    time.sleep(0.4)
    assert not [w for w in tracker.end(cell).warnings if w.kind == "staircase"]
    # A model built layer by layer: its parameters are most of the rise.
    ns: dict[str, Any] = {}
    cell = tracker.begin("model = build()", options=CellOptions(attribute=True, mode="magic"), namespace=ns)
    layers = []
    for _ in range(30):
        layers.append(torch.nn.Linear(1024, 1024))
        handles.append(fake.allocate(4 * MIB + 4096))
        time.sleep(0.05)
    ns["model"] = torch.nn.Sequential(*layers)
    record = tracker.end(cell, namespace=ns)
    assert kinds_of(record)["parameters"] >= 120 * MIB
    assert not [w for w in record.warnings if w.kind == "staircase"]
    tracker.close()


def test_samples_that_fell_or_ran_ahead_rule_a_counted_staircase_out() -> None:
    from gpumem.core.cells.patterns import counted_staircase
    from gpumem.core.cells.record import DeviceChange
    from gpumem.core.readers.readings import AllocatorReading

    def reading(allocated: int, live: int) -> AllocatorReading:
        return AllocatorReading(0, allocated, allocated, allocated, 0, allocated, allocated, 0, 0, live)

    rise = 30 * 64 * MIB
    change = DeviceChange(0, 0, rise, 0, rise, rise, True, "", rise, None, None, None, False)
    start, end = reading(0, 10), reading(30 * 64 * MIB, 40)
    steady = [(0.5, 10.0 * 64 * MIB), (1.0, 20.0 * 64 * MIB)]
    found = counted_staircase(change, start, end, 0.0, 1.5, steady)
    assert found is not None and (found.steps, found.step_bytes, found.counted) == (30, 64 * MIB, True)
    assert counted_staircase(change, start, end, 0.0, 1.5, [(0.5, 20.0 * 64 * MIB), (1.0, 2.0 * 64 * MIB)]) is None
    assert counted_staircase(change, start, end, 0.0, 1.5, [(0.1, 30.0 * 64 * MIB)]) is None  # all at once
    assert counted_staircase(change, start, end, 0.0, 0.9, steady) is None  # under a second
    assert counted_staircase(change, start, reading(30 * 64 * MIB, -1), 0.0, 1.5, steady) is None  # not counted
    sampled_peak = change._replace(peak_exact=False)
    assert counted_staircase(sampled_peak, start, end, 0.0, 1.5, steady) is None


def test_a_short_loop_in_automatic_mode_at_the_idle_rate(ip: Any) -> None:
    from _harness import run_cell_capture
    from gpumem.core.monitoring.monitor import set_default_monitor
    from gpumem.ipython import extension

    fake = FakeSource()
    set_default_monitor(Monitor(fake))  # the default 1 Hz: the loop is at most two samples
    ip.user_ns.update(src=fake, MIB=MIB, acc=[])
    try:
        assert ip.run_cell("%load_ext gpumem").success
        state = extension.get_state()
        assert state is not None
        state.tracker.holder_finder = lambda ns, device, names: _acc_report(ns)
        assert ip.run_cell("%gpumem auto on").success
        code = "import time\nfor i in range(30):\n    acc.append(src.allocate(64 * MIB))\n    time.sleep(0.05)"
        _, cap = run_cell_capture(ip, code)
        (line,) = [o.data["text/plain"] for o in cap.outputs if "gpumem" in o.data["text/plain"]]
        assert "cuda:0 allocated memory rose step by step, +1.9 GiB in 30 allocations of ~64.0 MiB" in line
        assert "`acc` grew most (+1.9 GiB)" in line
        code = "for i in range(30):\n    src.free(src.allocate(64 * MIB))\n    time.sleep(0.05)"
        _, cap = run_cell_capture(ip, code)
        assert not [o for o in cap.outputs if "step by step" in o.data.get("text/plain", "")]
    finally:
        ip.run_cell("%unload_ext gpumem")
        set_default_monitor(None)


def test_a_short_loop_sampled_at_a_measured_cells_rate_is_told_from_the_counters() -> None:
    """At 10 Hz every interval of a 50 ms-per-step loop rose (by one to three steps): the samples cannot say
    the step, the counters can. The real sampler thread, a fake allocator."""
    fake = FakeSource()
    monitor = Monitor(fake, rate_hz=10)
    tracker = CellTracker(monitor)
    try:
        cell = tracker.begin("for i in range(30): acc.append(x)", options=CellOptions(mode="magic"))
        handles = [fake.allocate(64 * MIB) for _ in range(1)]
        for _ in range(29):
            time.sleep(0.05)
            handles.append(fake.allocate(64 * MIB))
        time.sleep(0.05)
        record = tracker.end(cell)
        assert monitor.sampler.cost().samples >= 5
        (warning,) = [w for w in record.warnings if w.kind == "staircase"]
        assert warning.message.startswith("cuda:0 allocated memory rose step by step, +1.9 GiB in 30 allocations")
    finally:
        tracker.close()
        monitor.stop()
