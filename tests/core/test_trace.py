"""core.trace on a stored snapshot (tests/fixtures/trace_snapshot.json): exact bytes per site for the
peak, what the cell left behind and what was temporary; memory from before the cell kept apart; the
text and HTML reports; the recorder's messages where it cannot trace; the atomic snapshot file."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest

from _harness.synthetic_trace import synthetic_snapshot
from gpumem.core.gc_pause import collector_paused
from gpumem.core.trace import SKIPPED_ACTIONS, CellSnapshot, TraceRecorder, build_report, save_snapshot
from gpumem.core.trace.analysis import SiteNamer, analyse_device, analyse_snapshot
from gpumem.core.trace.site_timeline import build_timeline, render_svg

MIB = 1 << 20
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "trace_snapshot.json"
CELLS = {"/tmp/ipykernel_42/2817.py": 2, "/tmp/ipykernel_42/1001.py": 3, "/tmp/ipykernel_42/1002.py": 4}
CELL_START = 2  # the traced cell's first entry (time_us 1000); earlier ones are the user's


@pytest.fixture
def snapshot() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(FIXTURE.read_text())
    return data


def by_label(usages: list[Any]) -> dict[str, tuple[int, int]]:
    return {usage.site.label: (usage.bytes, usage.count) for usage in usages}


def test_peak_left_and_temporary_by_site(snapshot: dict[str, Any]) -> None:
    trace = analyse_device(snapshot, 0, first_entry=CELL_START, namer=SiteNamer(CELLS))
    assert trace.start_bytes == 6 * MIB  # 4 MiB still alive + 2 MiB the cell freed
    assert trace.freed_before == 2 * MIB
    assert trace.peak_bytes == 29 * MIB
    assert trace.peak_time == 1450  # the first time 29 MiB was reached (1600 only equals it)
    assert trace.before_at_peak == 4 * MIB
    assert by_label(trace.at_peak) == {
        "cell [4] line 3 in <module>": (16 * MIB, 1),
        "cell [3] line 2 in make": (8 * MIB, 1),
        "torch/optim/adamw.py:500 in _single_tensor_adamw": (1 * MIB, 1),
    }
    assert by_label(trace.left) == {
        "cell [3] line 2 in make": (8 * MIB, 1),
        "torch/optim/adamw.py:500 in _single_tensor_adamw": (1 * MIB, 1),
        "(no stack recorded)": (512, 1),
    }
    assert by_label(trace.temporary) == {"cell [4] line 3 in <module>": (48 * MIB, 3)}
    assert trace.temporary[0].largest == 16 * MIB
    assert trace.end_bytes == 13 * MIB + 512
    assert trace.failed == [1 << 40]


def test_ranked_by_bytes_user_code_named_library_folded(snapshot: dict[str, Any]) -> None:
    trace = analyse_device(snapshot, 0, first_entry=CELL_START, namer=SiteNamer(CELLS))
    assert [usage.bytes for usage in trace.at_peak] == [16 * MIB, 8 * MIB, 1 * MIB]
    loop = trace.at_peak[0]
    assert loop.site.user
    assert loop.site.via == "torch/nn/modules/linear.py:125 forward"  # the library call the user's line made
    assert not trace.at_peak[2].site.user  # no user frame at all: named by its innermost frame
    wheres = [frame.where for frame in loop.stack]
    assert wheres[:3] == ["torch/nn/functional.py:1676", "torch/nn/modules/linear.py:125", "cell [4] line 3"]


def test_without_the_cell_start_the_users_earlier_alloc_counts_as_the_cells(snapshot: dict[str, Any]) -> None:
    # Every entry belongs to the cell when gpumem started the recording itself.
    trace = analyse_device(snapshot, 0, namer=SiteNamer(CELLS))
    assert trace.start_bytes == 4 * MIB
    assert trace.freed_before == 0
    assert by_label(trace.temporary)["cell [2] line 1 in <module>"] == (2 * MIB, 1)


def test_free_completed_alone_frees_once(snapshot: dict[str, Any]) -> None:
    entries = snapshot["device_traces"][0]
    snapshot["device_traces"][0] = [entry for entry in entries if entry["action"] != "free_requested"]
    trace = analyse_device(snapshot, 0, first_entry=CELL_START, namer=SiteNamer(CELLS))
    assert trace.peak_bytes == 29 * MIB
    assert by_label(trace.temporary) == {"cell [4] line 3 in <module>": (48 * MIB, 3)}


def test_terminal_cell_names_and_unknown_files() -> None:
    namer = SiteNamer()
    site = namer.site([{"filename": "<ipython-input-7-0123abcd>", "line": 5, "name": "f"}])
    assert site.label == "cell [7] line 5 in f"
    mine = namer.site([{"filename": "/home/me/train.py", "line": 9, "name": "step"}])
    assert mine.user
    assert mine.label == "/home/me/train.py:9 in step"


def test_devices_without_events_are_left_out(snapshot: dict[str, Any]) -> None:
    snapshot["device_traces"].append([])
    assert [trace.device for trace in analyse_snapshot(snapshot, first_entry={0: CELL_START})] == [0]


def test_text_report(snapshot: dict[str, Any]) -> None:
    report = build_report(CellSnapshot(snapshot, {0: CELL_START}, True, [], None), cell_numbers=CELLS, cell=4)
    text = repr(report)
    assert text.splitlines()[0].startswith("gpumem trace of cell [4]")
    assert "Your own recording of allocation history was on" in text
    assert "peak 29.0 MiB; 6.0 MiB allocated before the cell" in text
    assert "4.0 MiB  before the cell" in text
    assert "48.0 MiB  cell [4] line 3 in <module>  (3 blocks)" in text
    assert "an allocation of 1.0 TiB ran out of memory" in text


def test_html_report_is_self_contained(snapshot: dict[str, Any]) -> None:
    report = build_report(CellSnapshot(snapshot, {0: CELL_START}, False, [0], 10), cell_numbers=CELLS, cell=4)
    page = report._repr_html_()
    assert "<svg" in page
    assert "<details><summary>cell [4] line 3 in &lt;module&gt;" in page
    assert "before the trace began" in page  # truncated: earlier memory is not claimed to predate the cell
    assert "the trace kept only the last 10 events" in page
    for external in ("http://", "https://", "src=", "href=", "@import"):
        assert external not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_user_strings_are_escaped() -> None:
    evil = "<img src=x onerror=alert(1)>"
    snapshot = {
        "segments": [],
        "device_traces": [[{"action": "alloc", "addr": 1, "size": 512, "time_us": 1, "frames": [
            {"filename": "/home/me/x.py", "line": 1, "name": evil}]}]],
    }  # fmt: skip
    page = build_report(CellSnapshot(snapshot, {}, False, [], 100))._repr_html_()
    assert evil not in page
    assert "&lt;img src=x" in page


def test_empty_cell() -> None:
    report = build_report(CellSnapshot({"segments": [], "device_traces": [[]]}, {}, False, [], 100))
    assert "allocated and freed no GPU memory" in repr(report)
    assert "allocated and freed no GPU memory" in report._repr_html_()


def test_timeline_keeps_the_peak_and_bounds_the_points(snapshot: dict[str, Any]) -> None:
    trace = analyse_device(snapshot, 0, first_entry=CELL_START, namer=SiteNamer(CELLS))
    timeline = build_timeline(trace, columns=4, bands=2)
    assert len(timeline.times) <= 2 * 4 + 1
    assert max(sum(point) for point in timeline.values) == 29 * MIB  # decimated, the peak is still drawn
    assert timeline.labels[0] == "before the cell"
    assert timeline.labels[-1] == "other"  # three sites, two bands
    assert timeline.values[0] == [6 * MIB, 0, 0, 0]
    svg = render_svg(timeline, "t1")
    assert svg.count('class="band"') == 4
    assert "peak 29.0 MiB" in svg


def test_large_trace_stays_small() -> None:
    snapshot = synthetic_snapshot(100_000)
    page = build_report(CellSnapshot(snapshot, {}, False, [], 200_000))._repr_html_()
    assert len(page.encode()) <= 2_000_000


def test_recorder_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails, as where it is not installed
    recorder = TraceRecorder()
    assert recorder.start() == "PyTorch is not installed in this Python environment"
    assert recorder.stop() is None


def test_recorder_with_torch_installed_but_not_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.delitem(sys.modules, "torch")  # installed, not imported yet (put back after the test)
    recorder = TraceRecorder()
    assert recorder.start() == "PyTorch is not imported (import torch in an earlier cell to trace this one)"


def test_recorder_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this test is about a machine without CUDA")
    recorder = TraceRecorder()
    assert recorder.start() == "no CUDA device is available to PyTorch (torch.cuda.is_available() is False)"
    assert not recorder.recording


def test_recorder_with_a_torch_too_old(monkeypatch: pytest.MonkeyPatch) -> None:
    class Memory:
        @staticmethod
        def _record_memory_history(enabled: bool, device: Any = None) -> None: ...  # 2.0's signature

        @staticmethod
        def _snapshot() -> dict[str, Any]:
            return {}

    class Cuda:
        memory = Memory

    class OldTorch:
        __version__ = "2.0.1"
        cuda = Cuda

    monkeypatch.setitem(sys.modules, "torch", OldTorch)
    assert TraceRecorder().start() == ("PyTorch 2.0.1 is too old to record allocation history (2.1 or later is needed)")


def test_max_entries_refused_below_one() -> None:
    with pytest.raises(ValueError, match="1 or more"):
        TraceRecorder(0)


def test_save_snapshot_is_atomic_and_loadable(tmp_path: Path, snapshot: dict[str, Any]) -> None:
    target = tmp_path / "cell.pickle"
    target.write_bytes(b"old")
    save_snapshot(snapshot, target)
    with target.open("rb") as file:
        assert pickle.load(file) == snapshot
    assert [path.name for path in tmp_path.iterdir()] == ["cell.pickle"]

    class Unpicklable:
        def __reduce__(self) -> Any:
            raise TypeError("no")

    with pytest.raises(TypeError):
        save_snapshot({"x": Unpicklable()}, target)
    with target.open("rb") as file:
        assert pickle.load(file) == snapshot  # the old file is intact
    assert [path.name for path in tmp_path.iterdir()] == ["cell.pickle"]


class _FakeAllocator:
    """Stands in for torch's recording switch: the calls it got, the history it keeps."""

    def __init__(self, recording: bool, entries: list[dict[str, Any]]) -> None:
        self.recording = recording
        self.entries = entries
        self.calls: list[dict[str, Any]] = []

    def record(self, enabled: str | None, context: str | None, stacks: str, max_entries: int) -> None:
        self.calls.append({"enabled": enabled, "context": context, "stacks": stacks, "max": max_entries})
        self.recording = enabled is not None
        if enabled is None:
            self.entries.clear()

    def install(self, monkeypatch: pytest.MonkeyPatch, *, skip_actions: bool = False) -> None:
        allocator = self

        class Memory:
            @staticmethod
            def _record_memory_history(
                enabled: str | None = "all", context: str | None = "all", stacks: str = "all", max_entries: int = 0
            ) -> None:
                allocator.record(enabled, context, stacks, max_entries)

            if skip_actions:  # torch 2.9 and later

                @staticmethod
                def _record_memory_history(  # type: ignore[no-redef]
                    enabled: str | None = "all",
                    context: str | None = "all",
                    stacks: str = "all",
                    max_entries: int = 0,
                    skip_actions: list[str] | None = None,
                ) -> None:
                    allocator.record(enabled, context, stacks, max_entries)
                    allocator.calls[-1]["skip"] = skip_actions

            @staticmethod
            def _snapshot() -> dict[str, Any]:
                return {"segments": [], "device_traces": [list(allocator.entries)]}

        class Cuda:
            memory = Memory

            @staticmethod
            def is_available() -> bool:
                return True

        class C:
            @staticmethod
            def _cuda_isHistoryEnabled() -> bool:  # noqa: N802 - torch._C's name
                return allocator.recording

        class Torch:
            __version__ = "2.5.0"
            cuda = Cuda
            _C = C

        monkeypatch.setitem(sys.modules, "torch", Torch)


def _alloc(addr: int, size: int, time_us: float) -> dict[str, Any]:
    return {"action": "alloc", "addr": addr, "size": size, "time_us": time_us, "frames": []}


def test_recorder_records_only_during_the_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    allocator = _FakeAllocator(recording=False, entries=[])
    allocator.install(monkeypatch)
    recorder = TraceRecorder(500)
    assert recorder.start() is None
    assert allocator.calls == [{"enabled": "all", "context": "alloc", "stacks": "python", "max": 500}]
    allocator.entries.append(_alloc(1, 512, 10))
    taken = recorder.stop()
    assert taken is not None
    assert allocator.calls[-1]["enabled"] is None  # off again, as it was
    assert not allocator.recording
    assert taken.first_entry == {}
    assert not taken.user_recording
    assert taken.truncated == []
    assert len(taken.snapshot["device_traces"][0]) == 1


@pytest.mark.parametrize("save", [False, True])
def test_recorder_skips_the_actions_the_analysis_never_reads(monkeypatch: pytest.MonkeyPatch, save: bool) -> None:
    """Not free_completed, segment or snapshot events, where torch can skip them; all of them for memory_viz."""
    allocator = _FakeAllocator(recording=False, entries=[])
    allocator.install(monkeypatch, skip_actions=True)
    recorder = TraceRecorder(500, every_action=save)
    assert recorder.start() is None
    wanted = None if save else ["free_completed", "segment_alloc", "segment_free", "snapshot"]
    assert allocator.calls == [{"enabled": "all", "context": "alloc", "stacks": "python", "max": 500, "skip": wanted}]
    assert recorder.skipped == (() if save else SKIPPED_ACTIONS)
    recorder.abandon()
    assert allocator.calls[-1]["enabled"] is None
    assert not allocator.recording


def test_abandon_leaves_the_users_recording_on(monkeypatch: pytest.MonkeyPatch) -> None:
    allocator = _FakeAllocator(recording=True, entries=[_alloc(1, 512, 10)])
    allocator.install(monkeypatch)
    recorder = TraceRecorder()
    assert recorder.start() is None
    recorder.abandon()
    assert allocator.calls == []
    assert allocator.recording
    assert not recorder.recording


def test_a_body_run_by_time_is_the_users_code() -> None:
    site = SiteNamer().site([{"filename": "<timed exec>", "line": 2, "name": "<module>"}])
    assert site.user
    assert site.label == "%%time body line 2 in <module>"


def test_recorder_leaves_the_users_recording_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    theirs = [_alloc(1, 512, 10), _alloc(2, 1024, 20)]
    allocator = _FakeAllocator(recording=True, entries=list(theirs))
    allocator.install(monkeypatch)
    recorder = TraceRecorder()
    assert recorder.start() is None
    allocator.entries.append(_alloc(3, 2048, 30))  # the cell's
    taken = recorder.stop()
    assert taken is not None
    assert allocator.calls == []  # their settings untouched
    assert allocator.recording
    assert allocator.entries[:2] == theirs  # their entries kept
    assert taken.user_recording
    assert taken.first_entry == {0: 2}
    trace = analyse_snapshot(taken.snapshot, first_entry=taken.first_entry)[0]
    assert [usage.bytes for usage in trace.left] == [2048]


def test_recorder_says_when_the_users_ring_buffer_went_round(monkeypatch: pytest.MonkeyPatch) -> None:
    allocator = _FakeAllocator(recording=True, entries=[_alloc(1, 512, 10)])
    allocator.install(monkeypatch)
    recorder = TraceRecorder()
    assert recorder.start() is None
    allocator.entries[:] = [_alloc(3, 2048, 30)]  # the oldest entry was overwritten
    taken = recorder.stop()
    assert taken is not None
    assert taken.truncated == [0]
    assert taken.first_entry == {0: 0}
    assert "earlier events are missing" in repr(build_report(taken))


def test_recorder_says_when_its_own_buffer_is_full(monkeypatch: pytest.MonkeyPatch) -> None:
    allocator = _FakeAllocator(recording=False, entries=[])
    allocator.install(monkeypatch)
    recorder = TraceRecorder(2)
    assert recorder.start() is None
    allocator.entries.extend([_alloc(1, 512, 10), _alloc(2, 512, 11)])
    taken = recorder.stop()
    assert taken is not None
    assert taken.truncated == [0]
    assert "the trace kept only the last 2 events" in repr(build_report(taken))


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_only_while_analysing(enabled: bool) -> None:
    import gc

    seen = []
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with collector_paused():
            seen.append(gc.isenabled())
        build_report(CellSnapshot(synthetic_snapshot(300), {}, False, [], 600))
        assert gc.isenabled() is enabled  # the user's setting, as it was
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False]
