"""``%%gpumem --trace`` on a real CUDA GPU: sites of known allocations, a loop's transient under
"temporary" and at the peak, and the user's own recording left as it was. Bytes are exact: every
size here is a multiple of 512 B, so the requested size the trace records is the block's size."""

from __future__ import annotations

import inspect
import pickle
from pathlib import Path
from typing import Any

import pytest

from _harness import run_cell_capture
from gpumem.core.trace import SKIPPED_ACTIONS, TraceRecorder
from gpumem.core.trace.analysis import analyse_snapshot

pytestmark = pytest.mark.gpu

MIB = 1 << 20


def trace_text(cap: Any) -> str:
    texts = [output.data.get("text/plain", "") for output in cap.outputs]
    found = [text for text in texts if text.startswith("gpumem trace of")]
    assert len(found) == 1, texts
    return found[0]


def section(text: str, title: str) -> str:
    """The rows under one of the three headings."""
    lines = text.splitlines()
    start = next(position for position, line in enumerate(lines) if line.strip().startswith(title))
    rows = []
    for line in lines[start + 1 :]:
        if not line.startswith("    "):
            break
        rows.append(line.strip())
    return "\n".join(rows)


def test_helper_in_a_cell_is_attributed_to_its_line(gpu: Any, tmp_path: Path) -> None:
    define = "def make(n):\n    return torch.empty(n, dtype=torch.uint8, device='cuda:0')"
    assert run_cell_capture(gpu, define)[0].success  # cell [1]
    saved = tmp_path / "cell.pickle"
    result, cap = run_cell_capture(gpu, f"%%gpumem --trace-save {saved}\nx = make(64 << 20)")  # cell [2]
    assert result.success
    text = trace_text(cap)
    assert text.startswith("gpumem trace of cell [2]")
    left = section(text, "Left behind by the cell")
    assert left.splitlines() == ["64.0 MiB  cell [1] line 2 in make"]
    assert "64.0 MiB  cell [1] line 2 in make" in section(text, "Alive at the cell's peak")
    assert section(text, "Temporary").splitlines() == ["nothing"]
    html = cap.outputs[-1].data["text/html"]
    assert "cell [2] line 2 in &lt;module&gt;" in html  # the stack goes on to the line that called make
    with saved.open("rb") as file:
        snapshot = pickle.load(file)
    [trace] = analyse_snapshot(snapshot)
    assert [usage.bytes for usage in trace.left] == [64 * MIB]
    assert trace.left[0].site.label == "cell [1] line 2 in make"  # the terminal shell's '<ipython-input-1-...>'
    assert trace.peak_bytes == trace.start_bytes + 64 * MIB
    torch = gpu.user_ns["torch"]
    assert not torch._C._cuda_isHistoryEnabled()  # recording is off again


def test_loop_transient_is_temporary_and_at_the_peak(gpu: Any) -> None:
    cell = (
        "%%gpumem --trace\n"
        "for _ in range(3):\n"
        "    t = torch.empty(32 << 20, dtype=torch.uint8, device='cuda:0')\n"
        "    del t\n"
    )
    result, cap = run_cell_capture(gpu, cell)  # cell [1]
    assert result.success
    text = trace_text(cap)
    assert section(text, "Temporary").splitlines() == ["96.0 MiB  cell [1] line 3 in <module>  (3 blocks)"]
    peak = section(text, "Alive at the cell's peak")
    assert "32.0 MiB  cell [1] line 3 in <module>" in peak
    assert section(text, "Left behind by the cell").splitlines() == ["nothing"]


def test_the_users_recording_is_kept_with_their_entries(gpu: Any) -> None:
    torch = gpu.user_ns["torch"]
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=10_000)
    try:
        theirs = torch.empty(1 * MIB, dtype=torch.uint8, device="cuda:0")
        address = theirs.untyped_storage().data_ptr()
        result, cap = run_cell_capture(
            gpu, "%%gpumem --trace\nmine = torch.empty(2 << 20, dtype=torch.uint8, device='cuda:0')"
        )
        assert result.success
        assert torch._C._cuda_isHistoryEnabled()  # still recording
        entries = torch.cuda.memory._snapshot()["device_traces"][0]
        assert any(entry["action"] == "alloc" and entry["addr"] == address for entry in entries)  # theirs kept
        text = trace_text(cap)
        assert "Your own recording of allocation history was on" in text
        assert section(text, "Left behind by the cell").splitlines() == ["2.0 MiB  cell [1] line 2 in <module>"]
        del theirs
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def test_recorder_alone_exact_bytes() -> None:
    torch = pytest.importorskip("torch")

    def helper() -> Any:
        return torch.empty(8 * MIB, dtype=torch.uint8, device="cuda:0")

    recorder = TraceRecorder()
    assert recorder.start() is None
    kept = helper()
    for _ in range(4):
        scratch = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda:0")
        del scratch
    taken = recorder.stop()
    assert taken is not None
    [trace] = analyse_snapshot(taken.snapshot)
    assert [usage.bytes for usage in trace.left] == [8 * MIB]
    assert trace.left[0].site.label.endswith("in helper")
    assert [(usage.bytes, usage.count) for usage in trace.temporary] == [(16 * MIB, 4)]
    assert trace.peak_bytes == trace.start_bytes + 12 * MIB
    assert {usage.bytes for usage in trace.at_peak} == {8 * MIB, 4 * MIB}
    del kept


def test_skipped_actions_are_not_recorded_and_frees_still_count() -> None:
    """Where torch can skip actions the trace holds no free_completed (nor segment) events, and a free still counts
    when it is requested."""
    torch = pytest.importorskip("torch")
    recorder = TraceRecorder()
    assert recorder.start() is None
    kept = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda:0")
    for _ in range(4):
        scratch = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda:0")
        del scratch
    taken = recorder.stop()
    assert taken is not None
    actions = {entry["action"] for entry in taken.snapshot["device_traces"][0]}
    assert {"alloc", "free_requested"} <= actions
    if "skip_actions" in inspect.signature(torch.cuda.memory._record_memory_history).parameters:
        assert recorder.skipped == SKIPPED_ACTIONS
        assert not actions & set(SKIPPED_ACTIONS)
    else:
        assert recorder.skipped == ()
        assert "free_completed" in actions
    [trace] = analyse_snapshot(taken.snapshot)
    assert [(usage.bytes, usage.count) for usage in trace.temporary] == [(16 * MIB, 4)]
    assert [usage.bytes for usage in trace.left] == [8 * MIB]
    assert trace.peak_bytes == trace.start_bytes + 12 * MIB
    del kept


def test_trace_save_records_every_action_for_memory_viz(gpu: Any, tmp_path: Path) -> None:
    saved = tmp_path / "loop.pickle"
    cell = (
        f"%%gpumem --trace-save {saved}\n"
        "for _ in range(3):\n"
        "    t = torch.empty(2 << 20, dtype=torch.uint8, device='cuda:0')\n"
        "    del t\n"
    )
    result, cap = run_cell_capture(gpu, cell)  # cell [1]
    assert result.success
    with saved.open("rb") as file:
        entries = pickle.load(file)["device_traces"][0]
    assert [entry["action"] for entry in entries].count("free_completed") == 3
    # free_requested then free_completed of one block is one free, not two
    assert section(trace_text(cap), "Temporary").splitlines() == ["6.0 MiB  cell [1] line 3 in <module>  (3 blocks)"]


ALLOCATE_4_MIB = "x = torch.empty(4 << 20, dtype=torch.uint8, device='cuda:0')"
RUN_CELL_MAGIC = f"get_ipython().run_cell_magic('gpumem', '--trace', {ALLOCATE_4_MIB!r})"


@pytest.mark.parametrize(
    ("cell", "site"),
    [
        ("%%time\n%%gpumem --trace\nx = torch.empty(4 << 20, dtype=torch.uint8, device='cuda:0')",
         "%%time body line 2 in <module>"),
        ("%%gpumem --trace\n%%time\nx = torch.empty(4 << 20, dtype=torch.uint8, device='cuda:0')",
         "%%time body line 1 in <module>"),
        (RUN_CELL_MAGIC, "cell [1] line 1 in <module>"),
    ],
)  # fmt: skip
def test_trace_however_the_magic_runs_the_body(gpu: Any, cell: str, site: str) -> None:
    result, cap = run_cell_capture(gpu, cell)  # cell [1]
    assert result.success, cap.stderr
    text = trace_text(cap)
    assert text.startswith("gpumem trace of cell [1]")
    assert section(text, "Left behind by the cell").splitlines() == [f"4.0 MiB  {site}"]
    assert not gpu.user_ns["torch"]._C._cuda_isHistoryEnabled()  # recording is off again


def test_the_phases_of_the_last_traced_cell_are_kept(gpu: Any) -> None:
    from gpumem.ipython.cell_recorders import LAST_COSTS

    result, cap = run_cell_capture(
        gpu, "%%gpumem --trace\nx = torch.empty(1 << 20, dtype=torch.uint8, device='cuda:0')"
    )
    assert result.success
    assert set(LAST_COSTS) == {"snapshot_s", "entries", "analysis_s", "render_s", "html_bytes"}
    torch = gpu.user_ns["torch"]
    if "skip_actions" in inspect.signature(torch.cuda.memory._record_memory_history).parameters:
        assert LAST_COSTS["entries"] == 1  # the one alloc: segment and snapshot events are not recorded
    else:
        assert LAST_COSTS["entries"] >= 1
    assert LAST_COSTS["html_bytes"] == len(cap.outputs[-1].data["text/html"].encode())


def test_unload_inside_a_traced_cell_stops_recording(gpu: Any) -> None:
    torch = gpu.user_ns["torch"]
    result, cap = run_cell_capture(gpu, "%%gpumem --trace\nget_ipython().run_line_magic('unload_ext', 'gpumem')")
    assert result.success, cap.stderr
    assert not torch._C._cuda_isHistoryEnabled()
    assert "gpumem:" not in cap.stderr
    assert gpu.run_cell("%load_ext gpumem").success  # the fixture unloads it again


def test_a_real_training_loop_is_analysed_by_arrays_exactly_as_by_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real snapshot (forward, backward on autograd's threads, AdamW's state) takes the array path, and
    the arrays answer as the replay loop does; torch shares one dict per distinct frame between entries
    (what the site lookup by frame identity relies on)."""
    torch = pytest.importorskip("torch")
    from gpumem.core.trace import analysis
    from gpumem.core.trace.analysis import SiteNamer

    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randn(64, 256, device="cuda:0")
    recorder = TraceRecorder()
    assert recorder.start() is None
    for _ in range(5):
        optimizer.zero_grad(set_to_none=True)
        model(data).square().mean().backward()
        optimizer.step()
    torch.cuda.synchronize()
    taken = recorder.stop()
    assert taken is not None
    entries = taken.snapshot["device_traces"][0][taken.first_entry.get(0, 0) :]
    assert analysis._columns(entries) is not None  # torch's entries fit the arrays as they are
    by_arrays = analysis.analyse_device(taken.snapshot, 0, first_entry=taken.first_entry.get(0, 0), namer=SiteNamer())
    monkeypatch.setattr(analysis, "_columns", lambda entries: None)
    by_loop = analysis.analyse_device(taken.snapshot, 0, first_entry=taken.first_entry.get(0, 0), namer=SiteNamer())
    assert by_arrays == by_loop
    assert by_arrays.temporary
    assert by_arrays.left  # AdamW's state and the gradients
    frames = [frame for entry in entries for frame in entry.get("frames") or ()]
    assert len({id(frame) for frame in frames}) < len(frames) / 2
