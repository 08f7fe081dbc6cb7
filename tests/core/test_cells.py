"""CellTracker driven directly: a deterministic fake allocator for the CUDA side, real torch CPU tensors
and the real holders walk for variable attribution and the graph warning."""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import pytest

from _harness import cpu_holders
from gpumem.core.cells import (
    KEPT_PEAK_NOTE,
    PEAK_RESET_NOTE,
    STATUS_ERROR,
    STATUS_INTERRUPTED,
    STATUS_OK,
    STATUS_OUT_OF_MEMORY,
    CellOptions,
    CellTracker,
    classify_error,
    first_line_of,
    source_key,
)
from gpumem.core.monitoring.monitor import Monitor
from gpumem.testing import GIB, MIB, FakeSource


@pytest.fixture
def fake() -> FakeSource:
    return FakeSource(devices=2)


@pytest.fixture
def tracker(fake: FakeSource) -> Iterator[CellTracker]:
    tracker = CellTracker(Monitor(fake), start_sampler=False)
    yield tracker
    tracker.close()


def run(tracker: CellTracker, source: str, body: Any = None, **options: Any) -> Any:
    cell = tracker.begin(source, options=CellOptions(**options))
    error: BaseException | None = None
    try:
        if body is not None:
            body()
    except BaseException as caught:
        error = caught
    return tracker.end(cell, error=error)


def test_deltas_and_exact_peak_of_a_transient(tracker: CellTracker, fake: FakeSource) -> None:
    fake.allocate(3 * GIB)  # before the cell, and a peak far above what the cell reaches
    fake.transient(5 * GIB)
    kept: list[int] = []

    def body() -> None:
        kept.append(fake.allocate(1 * GIB))
        fake.transient(2 * GIB)

    record = run(tracker, "x = torch.ones(...)", body)
    (change,) = record.devices
    assert change.device == 0
    assert change.allocated_before_bytes == 3 * GIB
    assert change.allocated_after_bytes == 4 * GIB
    assert change.allocated_delta_bytes == 1 * GIB
    assert change.peak_exact and change.peak_note == ""
    assert change.peak_allocated_bytes == 6 * GIB  # 4 GiB held + 2 GiB transient; the old 8 GiB peak was reset
    assert change.peak_above_start_bytes == 3 * GIB
    assert change.used_delta_bytes == change.reserved_delta_bytes  # the fake's NVML sees reserved + context
    assert record.status == STATUS_OK and record.error is None
    assert record.first_line == "x = torch.ones(...)"
    assert record.cuda_note is None


def test_only_devices_in_use_are_reported_and_selection_is_honoured(tracker: CellTracker, fake: FakeSource) -> None:
    record = run(tracker, "a", lambda: fake.allocate(10 * MIB, device=1))
    assert [change.device for change in record.devices] == [1]
    record = run(tracker, "b", lambda: fake.allocate(10 * MIB, device=0), devices=(1,))
    assert [change.device for change in record.devices] == [1]
    assert record.devices[0].allocated_delta_bytes == 0


def test_no_cuda_says_so_and_keeps_host(tracker: CellTracker, fake: FakeSource) -> None:
    fake.cuda_initialized = False
    record = run(tracker, "x = 1", lambda: fake.set_host_rss(3 * GIB))
    assert record.devices == ()
    assert record.cuda_note is not None and "CUDA is not in use" in record.cuda_note
    assert record.host is not None
    assert record.host.rss_delta_bytes == 2 * GIB
    assert record.host.peak_exact  # the lifetime peak rose during the cell


def test_device_initialized_inside_the_cell_has_an_exact_peak(tracker: CellTracker, fake: FakeSource) -> None:
    fake.cuda_initialized = False

    def body() -> None:
        fake.allocate(1 * GIB)  # the fake initializes CUDA on first allocation, as torch does
        fake.transient(2 * GIB)

    record = run(tracker, "first cuda", body)
    (change,) = record.devices
    assert change.initialized_in_cell
    assert change.allocated_before_bytes == 0
    assert change.peak_exact and change.peak_allocated_bytes == 3 * GIB


def test_user_reset_inside_the_cell_is_detected(tracker: CellTracker, fake: FakeSource) -> None:
    big = fake.allocate(2 * GIB)

    def body() -> None:
        fake.free(big)
        fake.reset_peaks([0])  # what torch.cuda.reset_peak_memory_stats() does
        fake.allocate(100 * MIB)

    record = run(tracker, "reset inside", body)
    (change,) = record.devices
    assert not change.peak_exact
    assert change.peak_note == PEAK_RESET_NOTE
    assert change.peak_allocated_bytes == 2 * GIB  # the sampled lower bound: the level at the cell's start
    assert [w.kind for w in record.warnings] == ["peak-reset"]


def test_reset_through_torch_is_counted_even_after_an_unsampled_spike(
    tracker: CellTracker, fake: FakeSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    # The CPU build has no CUDA reset; stand in for it with one that resets the fake allocator.
    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", lambda d: fake.reset_peaks([d]), raising=False)
    fake.allocate(1 * GIB)

    def body() -> None:
        fake.transient(4 * GIB)  # nothing samples this spike
        torch._C._cuda_resetPeakMemoryStats(0)  # what torch.cuda.reset_peak_memory_stats(0) calls
        fake.allocate(2 * GIB)

    record = run(tracker, "spike, then reset", body)
    (change,) = record.devices
    # Every reading is consistent with an exact 3 GiB peak; only the count of resets shows it is not.
    assert not change.peak_exact and change.peak_note == PEAK_RESET_NOTE
    assert change.peak_allocated_bytes == 3 * GIB  # the counter since the reset: a lower bound
    assert [w.kind for w in record.warnings] == ["peak-reset"]
    record = run(tracker, "next cell", lambda: fake.transient(GIB))
    assert record.devices[0].peak_exact  # the tracker's own reset at the cell start is not counted
    tracker.close()
    assert torch._C._cuda_resetPeakMemoryStats.__name__ == "<lambda>"  # unwrapped again


def test_keep_peaks_does_not_reset_and_labels_the_bound(tracker: CellTracker, fake: FakeSource) -> None:
    fake.allocate(1 * GIB)
    fake.transient(4 * GIB)  # the user's own peak so far: 5 GiB

    record = run(tracker, "small", lambda: fake.transient(1 * GIB), keep_peaks=True)
    (change,) = record.devices
    assert fake.snapshot().allocator[0].peak_allocated_bytes == 5 * GIB  # untouched
    assert not change.peak_exact and change.peak_note == KEPT_PEAK_NOTE
    assert change.peak_allocated_bytes == 1 * GIB  # nothing sampled the transient: a lower bound
    assert record.keep_peaks

    record = run(tracker, "big", lambda: fake.transient(6 * GIB), keep_peaks=True)
    (change,) = record.devices
    assert change.peak_exact  # the counter rose above its old value, so that rise happened in this cell
    assert change.peak_allocated_bytes == 7 * GIB


def test_sampler_feeds_the_lower_bound(fake: FakeSource) -> None:
    monitor = Monitor(fake, rate_hz=200)
    tracker = CellTracker(monitor)
    try:
        fake.allocate(1 * GIB)
        fake.transient(3 * GIB)

        def body() -> None:
            handle = fake.allocate(2 * GIB)
            deadline = time.monotonic() + 5
            while monitor.sampler.cost().samples < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            fake.free(handle)

        record = run(tracker, "sampled", body, keep_peaks=True)
        assert tracker.started_sampler and monitor.running and tracker in monitor.users
        (change,) = record.devices
        assert not change.peak_exact
        assert change.peak_allocated_bytes == 3 * GIB  # seen by the sampler thread while the cell ran
    finally:
        tracker.close()
    assert not monitor.running and monitor.users == frozenset()


def test_the_sampler_is_shared_with_other_users(fake: FakeSource) -> None:
    monitor = Monitor(fake)
    monitor.acquire("panel")
    tracker = CellTracker(monitor)
    run(tracker, "cell")
    assert monitor.users == {"panel", tracker}
    tracker.close()
    assert monitor.running and monitor.users == {"panel"}  # the panel still needs it
    monitor.release("panel")
    assert not monitor.running


def test_status_of_errors_interrupts_and_out_of_memory(tracker: CellTracker, fake: FakeSource) -> None:
    torch = pytest.importorskip("torch")

    def boom() -> None:
        raise ValueError("bad value")

    def interrupt() -> None:
        raise KeyboardInterrupt

    def torch_oom() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def fake_oom() -> None:
        fake.allocate(200 * GIB)

    statuses = [run(tracker, name, body).status for name, body in (("a", boom), ("b", interrupt))]
    statuses += [run(tracker, name, body).status for name, body in (("c", torch_oom), ("d", fake_oom))]
    assert statuses == [STATUS_ERROR, STATUS_INTERRUPTED, STATUS_OUT_OF_MEMORY, STATUS_OUT_OF_MEMORY]
    assert [r.error for r in tracker.history][:2] == ["ValueError: bad value", "KeyboardInterrupt"]
    assert classify_error(RuntimeError("CUDA out of memory. Tried to allocate"))[0] == STATUS_OUT_OF_MEMORY
    assert classify_error(RuntimeError("shape mismatch"))[0] == STATUS_ERROR


def test_leak_warning_after_three_similar_runs(tracker: CellTracker, fake: FakeSource) -> None:
    source = "cache.append(torch.ones(256 << 20, device='cuda'))"
    records = [run(tracker, source, lambda: fake.allocate(256 * MIB)) for _ in range(3)]
    assert [r.warnings for r in records[:2]] == [(), ()]
    (warning,) = records[2].warnings
    assert warning.kind == "leak"
    assert "256.0 MiB" in warning.message and "run 3 times" in warning.message and "cuda:0" in warning.message
    # Trailing spaces and surrounding blank lines do not make it a different cell.
    assert source_key(source) == source_key(f"\n{source}   \n\n")
    record = run(tracker, f"\n{source}  \n", lambda: fake.allocate(256 * MIB))
    assert [w.kind for w in record.warnings] == ["leak"] and "run 4 times" in record.warnings[0].message


def test_no_leak_warning_for_dissimilar_small_or_few_runs(tracker: CellTracker, fake: FakeSource) -> None:
    for size in (100 * MIB, 300 * MIB, 100 * MIB):  # growth, but not by a similar amount
        assert run(tracker, "dissimilar", lambda size=size: fake.allocate(size)).warnings == ()
    for _ in range(5):  # similar but below leak_min_bytes
        assert run(tracker, "tiny", lambda: fake.allocate(4096)).warnings == ()
    for _ in range(2):
        assert run(tracker, "twice", lambda: fake.allocate(GIB)).warnings == ()
    handles: list[int] = []
    for _ in range(3):  # allocates and frees: no growth
        assert (
            run(tracker, "steady", lambda: handles.append(fake.allocate(GIB)) or fake.free(handles.pop())).warnings
            == ()
        )
    # Failed runs do not count towards a leak.
    for _ in range(3):
        run(tracker, "failing", lambda: (fake.allocate(GIB), 1 / 0))
    assert all(not r.warnings for r in tracker.history if r.first_line == "failing")


def test_capacity_and_fragmentation_warnings(fake: FakeSource) -> None:
    small = FakeSource(total_bytes=10 * GIB, context_bytes=0)
    tracker = CellTracker(Monitor(small), start_sampler=False)
    record = run(tracker, "fill", lambda: small.allocate(int(9.5 * GIB)))
    assert "capacity" in [w.kind for w in record.warnings]
    assert "95%" in next(w.message for w in record.warnings if w.kind == "capacity")


def test_history_is_bounded_and_clearable(fake: FakeSource) -> None:
    tracker = CellTracker(Monitor(fake), history_size=5, start_sampler=False)
    for i in range(8):
        run(tracker, f"cell {i}")
    assert [r.first_line for r in tracker.history] == [f"cell {i}" for i in range(3, 8)]
    assert [r.serial for r in tracker.history] == [4, 5, 6, 7, 8]
    tracker.history_size = 2
    assert len(tracker.history) == 2
    tracker.clear_history()
    assert tracker.history == ()


def test_listeners_get_every_record(tracker: CellTracker) -> None:
    seen: list[int] = []
    tracker.add_listener(lambda record: seen.append(record.serial))
    run(tracker, "a")
    run(tracker, "b")
    assert seen == [1, 2]


def test_a_cell_whose_end_never_came_is_recorded_as_an_error(tracker: CellTracker) -> None:
    tracker.begin("lost")
    record = run(tracker, "next")
    first, second = tracker.history
    assert first.first_line == "lost" and first.status == STATUS_ERROR
    assert second is record and record.status == STATUS_OK


def test_first_line_skips_blank_lines_and_cell_magic_headers() -> None:
    assert first_line_of("\n\n  %%time\n  x = 1\ny = 2") == "x = 1"
    assert first_line_of("%%time") == "%%time"
    assert first_line_of("") == ""
    assert first_line_of("z" * 200).endswith("…") and len(first_line_of("z" * 200)) == 80


# Variable attribution with real torch tensors (on the CPU) and the real holders walk ----------------


@pytest.fixture
def cpu_tracker(fake: FakeSource) -> Iterator[CellTracker]:
    tracker = CellTracker(Monitor(fake), start_sampler=False, holder_finder=cpu_holders)
    yield tracker
    tracker.close()


def test_new_and_grown_variables_are_named(cpu_tracker: CellTracker, fake: FakeSource) -> None:
    torch = pytest.importorskip("torch")
    ns: dict[str, Any] = {"old": torch.zeros(1000), "keep": [torch.zeros(10)]}

    cell = cpu_tracker.begin("x = ...", options=CellOptions(attribute=True, mode="magic"), namespace=ns)
    ns["x"] = torch.zeros(250_000)  # 1,000,000 bytes
    ns["keep"].append(torch.zeros(100))
    fake.allocate(2 * MIB)
    record = cpu_tracker.end(cell, namespace=ns)

    names = {v.name: v for v in record.variables}
    assert set(names) == {"x", "keep"}
    assert names["x"].nbytes == 1_000_000 and names["x"].previous_bytes is None
    assert names["x"].type_name == "Tensor"
    assert names["keep"].previous_bytes == 40 and names["keep"].nbytes == 440 and names["keep"].grown_bytes == 400
    assert record.variables[0].name == "x"  # largest growth first
    assert record.variables_note == "new or grown since the start of the cell"


def test_auto_mode_attributes_only_when_allocated_memory_changed(cpu_tracker: CellTracker, fake: FakeSource) -> None:
    torch = pytest.importorskip("torch")
    ns: dict[str, Any] = {}
    cell = cpu_tracker.begin("small")
    ns["a"] = torch.zeros(10)
    fake.allocate(1000)  # below attribute_threshold_bytes (1 MiB)
    record = cpu_tracker.end(cell, namespace=ns)
    assert record.variables == () and "less than 1.0 MiB" in record.variables_note

    cell = cpu_tracker.begin("big")
    ns["b"] = torch.zeros(1000)
    fake.allocate(8 * MIB)
    record = cpu_tracker.end(cell, namespace=ns, execution_count=7)
    assert [v.name for v in record.variables] == ["b", "a"]
    assert record.variables_note == "new or grown (first inspection)"

    cell = cpu_tracker.begin("bigger")
    ns["c"] = torch.zeros(5)
    fake.allocate(8 * MIB)
    record = cpu_tracker.end(cell, namespace=ns)
    assert [v.name for v in record.variables] == ["c"]
    assert record.variables_note == "new or grown since cell [7]"


def test_graph_kept_alive_warning_names_the_element(cpu_tracker: CellTracker, fake: FakeSource) -> None:
    torch = pytest.importorskip("torch")
    w = torch.randn(64, 64, requires_grad=True)
    ns: dict[str, Any] = {"w": w, "losses": []}
    for _ in range(2):
        cell = cpu_tracker.begin("losses.append(loss)")
        loss = (w @ w).sum()
        ns["losses"].append(loss)
        fake.allocate(4 * MIB)
        record = cpu_tracker.end(cell, namespace=ns)
    graph = [warning for warning in record.warnings if warning.kind == "graph"]
    assert len(graph) == 1
    assert "`losses[0]`, `losses[1]`" in graph[0].message
    assert ".item()" in graph[0].message and ".detach()" in graph[0].message

    # With .item() the list holds numbers: no graph, no warning.
    ns["losses"] = [loss.item() for loss in ns["losses"]]
    cell = cpu_tracker.begin("losses.append(loss.item())")
    ns["losses"].append((w @ w).sum().item())
    fake.allocate(4 * MIB)
    record = cpu_tracker.end(cell, namespace=ns)
    assert not [warning for warning in record.warnings if warning.kind == "graph"]


def test_attribution_failure_is_a_note_not_an_exception(fake: FakeSource) -> None:
    def broken(namespace: Mapping[str, Any], device: str, names: Collection[str] | None) -> Any:
        raise RuntimeError("walk failed")

    tracker = CellTracker(Monitor(fake), start_sampler=False, holder_finder=broken)
    cell = tracker.begin("x", options=CellOptions(attribute=True))
    fake.allocate(GIB)
    record = tracker.end(cell, namespace={})
    assert record.variables == ()
    assert record.variables_note == "variable attribution failed: RuntimeError: walk failed"


class _Box:
    """A plain object whose contents change without its name being rebound."""

    def __init__(self) -> None:
        self.cache: list[Any] = []


def test_auto_mode_walks_only_changed_names_unless_growth_is_unexplained(
    cpu_tracker: CellTracker, fake: FakeSource
) -> None:
    torch = pytest.importorskip("torch")
    ns: dict[str, Any] = {f"v{i}": torch.zeros(10) for i in range(50)}
    ns["box"] = _Box()
    fake.allocate(MIB)  # a device in use: attribution only runs then

    def auto_cell(body: Any, grow_bytes: int) -> Any:
        cell = cpu_tracker.begin("cell", options=CellOptions(attribute=True))
        body()
        fake.allocate(grow_bytes)
        return cpu_tracker.end(cell, namespace=ns)

    auto_cell(lambda: None, 0)
    assert cpu_tracker.walks == {"full": 1, "changed names": 0}

    record = auto_cell(lambda: ns.update(x=torch.zeros(1000)), 4000)
    assert cpu_tracker.walks == {"full": 1, "changed names": 1}
    assert [v.name for v in record.variables] == ["x"]

    ns["v3"].resize_(2000)  # grows in place: same object, so not a changed name
    record = auto_cell(lambda: ns.update(y=torch.zeros(5)), 8 * MIB)
    assert cpu_tracker.walks == {"full": 2, "changed names": 1}  # 8 MiB changed: the whole namespace, for the kinds
    assert [v.name for v in record.variables] == ["v3", "y"]

    record = auto_cell(lambda: ns["box"].cache.append(torch.zeros(250_000)), 0)
    assert [v.name for v in record.variables] == []  # not seen: nothing grew that needed explaining
    record = auto_cell(lambda: ns.pop("x"), 2 * MIB)
    assert cpu_tracker.walks["full"] == 3
    assert [(v.name, v.grown_bytes) for v in record.variables] == [("box", 1_000_000)]


def test_output_cache_entries_are_reported_as_hidden(cpu_tracker: CellTracker, fake: FakeSource) -> None:
    torch = pytest.importorskip("torch")
    ns: dict[str, Any] = {}
    fake.allocate(MIB)
    cell = cpu_tracker.begin("first", options=CellOptions(attribute=True))
    cpu_tracker.end(cell, namespace=ns)
    cell = cpu_tracker.begin("torch.ones(1000)", options=CellOptions(attribute=True))
    value = torch.ones(1000)
    fake.allocate(4000)
    record = cpu_tracker.end(cell, namespace=ns, hidden={"Out[2]": value})
    (variable,) = record.variables
    assert variable.name == "Out[2]" and variable.hidden and variable.nbytes == 4000
    assert any(w.kind == "output-cache" and "Out[2]" in w.message for w in record.warnings)


# The pieces the tracker is built from ---------------------------------------------------------------


def _reading(allocated: int, peak: int, device: int = 0) -> Any:
    from gpumem.core.readers.sources import AllocatorReading

    return AllocatorReading(device, allocated, allocated, allocated, 0, peak, peak, 0, 0)


@pytest.mark.parametrize(
    ("before", "after", "sampled", "reset_at_start", "reset_in_cell", "expected"),
    [
        (None, (2, 5), 2, False, False, (5, True, "")),  # CUDA first used in the cell: the counter is the cell's
        ((1, 9), (2, 5), 2, True, False, (5, True, "")),  # reset by the tracker at the start
        ((1, 1), (2, 5), 6, False, False, (6, False, PEAK_RESET_NOTE)),  # counter below what was sampled
        ((1, 9), (2, 5), 2, True, True, (5, False, PEAK_RESET_NOTE)),  # reset again inside the cell
        ((1, 9), (2, 12), 2, False, False, (12, True, "")),  # kept counter that rose: exact
        ((1, 9), (2, 9), 3, False, False, (3, False, KEPT_PEAK_NOTE)),  # kept counter that did not rise
        ((1, 9), (2, 4), 2, False, False, (2, False, PEAK_RESET_NOTE)),  # kept counter that fell: reset
    ],
)
def test_the_peak_exactness_rule(
    before: tuple[int, int] | None,
    after: tuple[int, int],
    sampled: int,
    reset_at_start: bool,
    reset_in_cell: bool,
    expected: tuple[int, bool, str],
) -> None:
    from gpumem.core.monitoring.peaks import cell_peak

    peak = cell_peak(
        _reading(*before) if before is not None else None,
        _reading(*after),
        sampled,
        sampled,
        reset_at_start=reset_at_start,
        reset_in_cell=reset_in_cell,
    )
    assert (peak.allocated_bytes, peak.exact, peak.note) == expected


def test_the_package_and_report_keep_their_names() -> None:
    from gpumem.core import cells
    from gpumem.core.cells import history, report

    for name in cells.__all__:
        assert getattr(cells, name) is not None
    for name in ("HistoryTable", "history_dataframe", "history_rows", "record_to_dict", "write_csv", "write_json"):
        assert getattr(report, name) is getattr(history, name)


# A warning belongs to the cell that caused it --------------------------------------------------------

EXPANDABLE_ADVICE = (
    "for the next kernel, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before torch initializes CUDA: "
    "`%env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` in the first cell, or "
    'os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True" before `import torch`'
)
NOTHING_TO_RETURN = (
    "`%gpumem free` (torch.cuda.empty_cache()) would return none of it: every free piece shares a segment "
    "with a live tensor, and goes back only when those tensors are deleted"
)


@pytest.fixture
def segmented(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[CellTracker, FakeSource]]:
    """A tracker over a fake allocator that places blocks in segments as PyTorch's does."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    source = FakeSource(segments=True)
    tracker = CellTracker(Monitor(source), start_sampler=False)
    yield tracker, source
    tracker.close()


def kinds(record: Any) -> list[str]:
    return [warning.kind for warning in record.warnings]


def fragment(source: FakeSource, pieces: int) -> list[int]:
    """``pieces`` x 1 GiB allocated and freed, then 600 MiB taken from each: 424 MiB stranded per segment."""
    for handle in [source.allocate(GIB) for _ in range(pieces)]:
        source.free(handle)
    return [source.allocate(600 * MIB) for _ in range(pieces)]


def test_one_large_free_block_is_no_fragmentation_warning(segmented: tuple[CellTracker, FakeSource]) -> None:
    """x = 1 GiB, a 2 GiB transient, two 64 MiB tensors: 1.875 GiB free, in one block any request can use."""
    tracker, source = segmented
    records = [
        run(tracker, "x = 1 GiB", lambda: source.allocate(GIB)),
        run(tracker, "2 GiB transient", lambda: source.transient(2 * GIB)),
        run(tracker, "two 64 MiB", lambda: [source.allocate(64 * MIB) for _ in range(2)]),
        run(tracker, "y = 1"),
    ]
    assert [kinds(record) for record in records] == [[], [], [], []]
    reading = source.snapshot().allocator[0]
    assert reading.inactive_split_bytes == 2 * GIB - 128 * MIB  # what the old check called "unusable fragments"
    assert tracker._reserves.reads == 2  # after the transient and the 64 MiB tensors; "y = 1" changed nothing
    assert tracker.standing_conditions() == []


def test_fragmentation_is_told_once_and_again_when_it_worsens(segmented: tuple[CellTracker, FakeSource]) -> None:
    tracker, source = segmented
    blocks: list[int] = []
    made = run(tracker, "blocks = 12 x 1 GiB", lambda: blocks.extend(source.allocate(GIB) for _ in range(12)))
    assert kinds(made) == []
    freed = run(tracker, "del blocks", lambda: [source.free(handle) for handle in blocks])
    assert kinds(freed) == []  # 12 GiB free, but in segments empty_cache returns whole
    parts: list[int] = []
    record = run(tracker, "parts = 12 x 600 MiB", lambda: parts.extend(source.allocate(600 * MIB) for _ in range(12)))
    (warning,) = record.warnings
    assert warning.kind == "fragmentation"
    assert warning.message == (
        "cuda:0: 5.0 GiB of the 12.0 GiB reserved is free but in 12 pieces, the largest 424.0 MiB: a request "
        f"above 424.0 MiB cannot use any of it; {NOTHING_TO_RETURN}; {EXPANDABLE_ADVICE}"
    )
    reads = tracker._reserves.reads
    assert kinds(run(tracker, "print('unrelated')")) == []  # standing, not repeated
    assert tracker._reserves.reads == reads  # the counters did not move: no snapshot read
    assert kinds(run(tracker, "small = 1 MiB", lambda: source.allocate(MIB))) == []  # moved, but not worse
    assert tracker._reserves.reads == reads + 1
    (standing,) = tracker.standing_conditions()
    assert standing.kind == "fragmentation" and "13 pieces" in standing.message  # the 1 MiB's small segment

    more: list[int] = []
    record = run(tracker, "six more", lambda: more.extend(fragment(source, 6)))
    (warning,) = record.warnings  # worse by 6 x 424 MiB: told again, with the new figures
    assert warning.message.startswith("cuda:0: 7.5 GiB of the 18.0 GiB reserved is free but in 19 pieces, the largest")
    assert kinds(run(tracker, "print('unrelated again')")) == []

    def free_all() -> None:
        for handle in parts + more:
            source.free(handle)
        source.empty_cache()  # what %gpumem free does

    assert kinds(run(tracker, "del parts; %gpumem free", free_all)) == []  # better: gone
    assert tracker.standing_conditions() == []
    assert kinds(run(tracker, "again", lambda: fragment(source, 12))) == ["fragmentation"]  # back: told again


def test_what_empty_cache_would_return_is_said_only_when_it_returns_something(
    segmented: tuple[CellTracker, FakeSource],
) -> None:
    tracker, source = segmented

    def body() -> None:
        fragment(source, 12)
        source.transient(3 * GIB)  # an empty 3 GiB segment beside the 12 stranded pieces

    (warning,) = run(tracker, "fragment, then a transient", body).warnings
    assert warning.message.startswith(
        "cuda:0: 8.0 GiB of the 15.0 GiB reserved is free but in 13 pieces, the largest 3.0 GiB: "
        "a request above 3.0 GiB cannot use any of it; "
        "`%gpumem free` (torch.cuda.empty_cache()) returns 3.0 GiB of it to the device now"
    )


def test_a_condition_the_cell_did_not_cause_is_standing_not_told(segmented: tuple[CellTracker, FakeSource]) -> None:
    tracker, source = segmented
    source.allocate(MIB)
    run(tracker, "first cell")  # CUDA in use before this cell
    fragment(source, 12)  # between measured cells (a cell measured by nothing)
    assert kinds(run(tracker, "print('hello')")) == []
    (standing,) = tracker.standing_conditions()
    assert standing.kind == "fragmentation" and standing.device == 0


def test_retries_in_the_cell_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    source = FakeSource(segments=True, total_bytes=13 * GIB + 100 * MIB, context_bytes=0)
    tracker = CellTracker(Monitor(source), start_sampler=False)
    fragment(source, 12)
    source.transient(GIB)  # 13 GiB reserved, 100 MiB left on the device
    run(tracker, "first cell")

    def body() -> None:
        source.allocate(GIB + 50 * MIB)  # no free piece fits; only the retry (the empty 1 GiB returned) makes room

    (warning,) = run(tracker, "retry", body).warnings
    assert warning.message.startswith("cuda:0: 5.0 GiB of the 13.0 GiB reserved is free but in 12 pieces")
    assert "; 1 allocation in this cell found no free piece large enough and made PyTorch return" in warning.message
    assert source.snapshot().allocator[0].num_alloc_retries == 1
    tracker.close()


def test_near_full_is_told_when_crossed_and_when_it_grows_by_a_point() -> None:
    small = FakeSource(total_bytes=10 * GIB, context_bytes=0)
    tracker = CellTracker(Monitor(small), start_sampler=False)
    held: list[int] = []
    assert kinds(run(tracker, "8 GiB", lambda: held.append(small.allocate(8 * GIB)))) == []
    crossed = run(tracker, "1.5 GiB", lambda: small.allocate(int(1.5 * GIB)))
    expected = "cuda:0 is 95% full after this cell (9.5 GiB of 10.0 GiB used, all processes); "
    assert [w.message for w in crossed.warnings] == [expected + "`%gpumem who` lists what holds it"]
    assert kinds(run(tracker, "50 MiB", lambda: small.allocate(50 * MIB))) == []  # grew, by less than 1 %
    assert kinds(run(tracker, "unrelated")) == []
    worse = run(tracker, "60 MiB", lambda: small.allocate(60 * MIB))  # 110 MiB since the warning: over 1 %
    assert [w.message[:34] for w in worse.warnings] == ["cuda:0 is 96% full after this cell"]
    (standing,) = tracker.standing_conditions()
    assert standing.kind == "capacity" and standing.message.startswith("cuda:0 is 96% full now")

    def release() -> None:
        small.free(held.pop())
        small.empty_cache()

    assert kinds(run(tracker, "del the 8 GiB; %gpumem free", release)) == []
    assert tracker.standing_conditions() == []
    assert kinds(run(tracker, "8 GiB again", lambda: small.allocate(8 * GIB))) == ["capacity"]  # crossed again
    tracker.close()


def test_graph_warning_in_magic_cells_only_for_names_the_cell_changed(
    cpu_tracker: CellTracker, fake: FakeSource
) -> None:
    torch = pytest.importorskip("torch")
    w = torch.randn(16, 16, requires_grad=True)
    ns: dict[str, Any] = {"w": w}

    def magic(source: str, body: Any) -> Any:
        cell = cpu_tracker.begin(source, options=CellOptions(attribute=True, mode="magic"), namespace=ns)
        body()
        fake.allocate(4 * MIB)
        return cpu_tracker.end(cell, namespace=ns)

    record = magic("outs = [...]", lambda: ns.update(outs=[(w @ w).sum() for _ in range(4)]))
    (graph,) = [warning for warning in record.warnings if warning.kind == "graph"]
    assert graph.message.startswith("`outs[0]` … `outs[3]` (4 elements) keep their whole autograd graphs alive")
    assert kinds(magic("z = torch.zeros(10)", lambda: ns.update(z=torch.zeros(10)))) == []
    assert kinds(magic("pass", lambda: None)) == []
    (standing,) = cpu_tracker.standing_conditions(ns)
    assert standing.kind == "graph" and "`outs[0]` … `outs[3]`" in standing.message
    record = magic("outs.append(...)", lambda: ns["outs"].append((w @ w).sum()))
    assert [w.message.split(" keep")[0] for w in record.warnings] == ["`outs[0]` … `outs[4]` (5 elements)"]
    ns["outs"] = [out.item() for out in ns["outs"]]
    assert cpu_tracker.standing_conditions(ns) == []


def test_graph_warning_counts_elements_past_the_walks_cap() -> None:
    """The walk keeps one path past its cap for a name; the warning then says 'more than N', never a wrong count."""
    from gpumem.core.cells.warnings import graph_warning
    from gpumem.core.holders.model import MAX_GRAPH_PATHS

    exact = graph_warning([f"outs[{i}]" for i in range(MAX_GRAPH_PATHS)])
    assert f"`outs[{MAX_GRAPH_PATHS - 1}]` ({MAX_GRAPH_PATHS} elements)" in exact.message
    capped = graph_warning([f"outs[{i}]" for i in range(MAX_GRAPH_PATHS + 1)])
    assert f"`outs[{MAX_GRAPH_PATHS - 1}]` (more than {MAX_GRAPH_PATHS} elements)" in capped.message
    assert f"outs[{MAX_GRAPH_PATHS}]" not in capped.message
