"""``%gpumem summary``, ``%gpumem export`` and ``%gpumem load`` in a real in-process IPython shell:
the session written and shown again exactly, the allocator annotated, refusals one line each."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError

from _harness import gpumem_loaded, run_cell_capture
from gpumem.core.monitoring.monitor import Monitor, set_default_monitor
from gpumem.core.sessions.session_file import read_session
from gpumem.ipython import extension as _extension
from gpumem.testing import MIB, FakeSource


class StatsSource(FakeSource):
    """A fake whose allocator also answers memory_stats(device), from its own counters."""

    def memory_stats(self, device: int) -> dict[str, Any]:
        reading = self.snapshot().allocator_for(device)
        assert reading is not None
        return {
            "allocated_bytes.all.current": reading.allocated_bytes,
            "allocated_bytes.all.peak": reading.peak_allocated_bytes,
            "reserved_bytes.all.current": reading.reserved_bytes,
            "reserved_bytes.all.peak": reading.peak_reserved_bytes,
            "num_alloc_retries": reading.num_alloc_retries,
            "num_ooms": reading.num_ooms,
        }


@pytest.fixture
def fake() -> StatsSource:
    return StatsSource(devices=1, segments=True)


@pytest.fixture
def shell(ip: Any, fake: StatsSource) -> Iterator[Any]:
    with gpumem_loaded(ip, fake) as loaded:
        loaded.user_ns.update(src=fake, MIB=MIB)
        yield loaded


def _state() -> Any:
    state = _extension.get_state()
    assert state is not None
    return state


def _one_line_error(shell: Any, line: str, message: str) -> None:
    result, cap = run_cell_capture(shell, line)
    assert isinstance(result.error_in_exec, UsageError), line
    assert message in cap.stderr + cap.stdout, (line, cap.stderr + cap.stdout)
    assert "Traceback" not in cap.stderr + cap.stdout


def test_export_then_load_shows_the_same_session(shell: Any, tmp_path: Path) -> None:
    assert run_cell_capture(shell, "%%gpumem\nh = src.allocate(64 * MIB)")[0].success
    assert run_cell_capture(shell, "%%gpumem -q\ng = src.allocate(32 * MIB)")[0].success
    timeline = _state().monitor.timeline
    for step in range(30):  # samples of our own as well, whatever the sampler took
        timeline.append(
            timeline.latest()[0] + 0.1 if timeline.latest() else float(step), {"cuda:0/allocated": step * MIB}
        )
    target = tmp_path / "run.json"
    result, cap = run_cell_capture(shell, f"%gpumem export {target}")
    assert result.success, cap.stderr
    whole = timeline.window(max_points=10**9)
    cells = _state().tracker.history
    marks = len(timeline.marks())
    assert cap.stdout == f"wrote {len(whole.times):,} points, {marks:,} marks, 2 cells and 0 reports to {target}\n"
    loaded = read_session(target)
    assert loaded.cells == list(cells)
    assert loaded.cells[1].quiet
    assert loaded.timeline.times == whole.times
    for name, values in whole.values.items():
        got = loaded.timeline.values[name]
        assert all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, values, strict=True)), name
    assert loaded.marks == timeline.marks()

    result, cap = run_cell_capture(shell, f"%gpumem load {target}")
    assert result.success, cap.stderr
    (output,) = cap.outputs
    assert "<svg" in output.data["text/html"]
    assert "h = src.allocate(64 * MIB)" in output.data["text/html"]
    assert output.data["text/plain"].startswith(f"gpumem session from {target}, exported ")
    assert len(_state().tracker.history) == 2  # loading changed nothing here

    result, cap = run_cell_capture(shell, f"%gpumem export {target}")
    assert cap.stdout.startswith(f"replaced {target} with ")


def test_export_with_parquet(shell: Any, tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    assert run_cell_capture(shell, "%%gpumem\nh = src.allocate(64 * MIB)")[0].success
    result, cap = run_cell_capture(shell, f"%gpumem export {tmp_path / 'run.json'} --parquet")
    assert result.success, cap.stderr
    levels = [f"run.level{index}.parquet" for index in range(3)]  # the default timeline's three levels
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        ["run.cells.parquet", "run.json", "run.samples.parquet", *levels]
    )


def test_export_and_load_refusals(shell: Any, tmp_path: Path) -> None:
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    _one_line_error(shell, f"%gpumem export {notes}", "exists and is not a gpumem export; it was left as it was")
    assert notes.read_text() == '{"mine": 1}'
    _one_line_error(shell, f"%gpumem load {notes}", "not a gpumem export (no 'gpumem_session' key)")
    _one_line_error(shell, f"%gpumem load {tmp_path / 'missing.json'}", "No such file or directory")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    _one_line_error(shell, f"%gpumem load {tmp_path / 'binary.json'}", "not a gpumem export (not UTF-8 text)")
    _one_line_error(shell, f"%gpumem export {tmp_path / 'no' / 'dir.json'}", "cannot write")


def test_summary_shows_the_allocator_and_dumps_json(shell: Any, fake: StatsSource, tmp_path: Path) -> None:
    shell.user_ns["h"] = fake.allocate(64 * MIB)
    target = tmp_path / "stats.json"
    result, cap = run_cell_capture(shell, f"%gpumem summary --json {target}")
    assert result.success, cap.stderr
    text = cap.outputs[0].data["text/plain"]
    assert text.splitlines()[0] == "gpumem summary of cuda:0 (PyTorch's caching allocator)"
    assert "\n  allocated             64.0 MiB  64.0 MiB  in tensors now" in text
    assert text.splitlines()[-1] == "This PyTorch does not count: device mallocs, device frees."
    assert "largest free block" in text  # from the fake's segments
    assert cap.stdout == f"wrote the memory statistics to {target}\n"
    assert json.loads(target.read_text())["devices"]["0"] == fake.memory_stats(0)


def test_summary_of_a_device_that_does_not_exist_is_refused(shell: Any) -> None:
    _one_line_error(shell, "%gpumem summary -d 3", "--device cuda:3: no such device")


def test_summary_with_real_torch_without_cuda(ip: Any) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this torch has a CUDA device")
    set_default_monitor(Monitor())
    assert ip.run_cell("%load_ext gpumem").success
    try:
        result, cap = run_cell_capture(ip, "import torch\n%gpumem summary")
        assert result.success, cap.stderr
        assert cap.stdout == (
            "gpumem summary: CUDA is not initialized in this process (this PyTorch build has no CUDA support); "
            "nothing to summarize.\n"
        )
        assert not torch.cuda.is_initialized()
    finally:
        ip.run_cell("%unload_ext gpumem")
        set_default_monitor(None)


def test_help_lists_the_new_subcommands(shell: Any) -> None:
    from IPython.utils.capture import capture_output

    with capture_output() as cap:
        shell.run_cell("%gpumem?")
    for text in ("%gpumem summary", "%gpumem export", "%gpumem load", "--parquet", "--profile"):
        assert text in cap.stdout, text


def test_a_profile_shown_under_a_cell_is_exported_and_shown_again(shell: Any, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    shell.user_ns["torch"] = torch
    result, cap = run_cell_capture(shell, "%%gpumem --profile\nm = torch.ones(1000, 1000)")  # cell [1]
    assert result.success, cap.stderr
    shown = next(o.data["text/plain"] for o in cap.outputs if o.data["text/plain"].startswith("gpumem profile"))
    target = tmp_path / "run.json"
    assert run_cell_capture(shell, f"%gpumem export {target}")[0].success
    (report,) = read_session(target).reports
    assert (report.kind, report.cell, report.text) == ("profile", 1, shown)
    result, cap = run_cell_capture(shell, f"%gpumem load {target}")
    assert result.success
    assert "--profile report of cell [1]" in cap.outputs[0].data["text/html"]
    assert cap.outputs[0].data["text/plain"].endswith(f"--profile report of cell [1]\n{shown}")


def test_a_hand_edited_export_is_refused_in_one_line(shell: Any, tmp_path: Path) -> None:
    """Numbers JSON allows but no store can hold (Infinity, a capacity past memory), or a mark or a time
    that is not a number: each is one line saying what is wrong, never a traceback or a huge allocation."""
    assert run_cell_capture(shell, "%%gpumem\nh = src.allocate(64 * MIB)")[0].success
    target = tmp_path / "run.json"
    assert run_cell_capture(shell, f"%gpumem export {target}")[0].success
    text = target.read_text()
    document = json.loads(text)
    capacity = document["store"]["levels"][2]["capacity"]
    edits = {
        "infinite.json": text.replace('"max_marks": ', '"max_marks": Infinity, "was": '),
        "huge.json": text.replace(f'"capacity": {capacity}', '"capacity": 1000000000000'),
        "past_index.json": text.replace(f'"capacity": {capacity}', f'"capacity": {10**30}'),
        "mark.json": json.dumps({**document, "marks": [["soon", "cell"]]}),
        "time.json": json.dumps({**document, "timeline": {"times": ["x"], "values": {}}}),
    }
    for name, edited in edits.items():
        assert edited != text, name
        (tmp_path / name).write_text(edited)
        _one_line_error(shell, f"%gpumem load {tmp_path / name}", f"{tmp_path / name}: ")


def _exactly(data: Any) -> str:
    """A loaded session as one string, every float by its repr (NaN included): equal strings, equal sessions."""
    return json.dumps(
        [data.timeline, data.marks, [cell._asdict() for cell in data.cells], data.reports, data.store],
        default=repr,
        sort_keys=True,
    )


def test_a_parquet_export_loads_as_the_json_one_does(shell: Any, tmp_path: Path) -> None:
    """The files the real --parquet export wrote, read back by the magic: the same panel and history as
    the JSON file it wrote beside them, whichever file of the set (or its stem) is named."""
    pytest.importorskip("pyarrow")
    assert run_cell_capture(shell, "%%gpumem\nh = src.allocate(64 * MIB)")[0].success
    assert run_cell_capture(shell, "%%gpumem -q\ng = src.allocate(32 * MIB)")[0].success
    target = tmp_path / "run.json"
    result, cap = run_cell_capture(shell, f"%gpumem export {target} --parquet")
    assert result.success, cap.stderr
    from_json = read_session(target)
    assert from_json.cells == list(_state().tracker.history)
    assert from_json.store is not None
    assert from_json.marks
    result, cap = run_cell_capture(shell, f"%gpumem load {target}")
    assert result.success, cap.stderr
    (shown,) = cap.outputs
    for name in ("run.samples.parquet", "run.cells.parquet", "run.level2.parquet", "run"):
        path = tmp_path / name
        assert _exactly(read_session(path)) == _exactly(from_json), name
        result, cap = run_cell_capture(shell, f"%gpumem load {path}")
        assert result.success, cap.stderr
        (output,) = cap.outputs
        for kind in ("text/plain", "text/html"):
            assert output.data[kind] == shown.data[kind].replace(str(target), str(path)), (name, kind)
        assert output.data["text/plain"].startswith(f"gpumem session from {path}, exported ")
        assert "store restored, every level: " in output.data["text/plain"]
    assert len(_state().tracker.history) == 2  # loading changed nothing here


def test_a_damaged_parquet_export_is_refused_in_one_line(shell: Any, tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    assert run_cell_capture(shell, "%%gpumem\nh = src.allocate(64 * MIB)")[0].success
    assert run_cell_capture(shell, f"%gpumem export {tmp_path / 'run.json'} --parquet")[0].success
    samples, cells = tmp_path / "run.samples.parquet", tmp_path / "run.cells.parquet"
    cells.write_bytes(cells.read_bytes()[:100])  # truncated
    _one_line_error(shell, f"%gpumem load {samples}", f"{samples}: ArrowInvalid: ")
    cells.unlink()
    _one_line_error(
        shell, f"%gpumem load {samples}", "run.cells.parquet is missing (a Parquet export is read as a set)"
    )
    (tmp_path / "notes.parquet").write_bytes(samples.read_bytes())
    _one_line_error(shell, f"%gpumem load {tmp_path / 'notes.parquet'}", "a Parquet file, but not one of a gpumem")


def test_without_pyarrow_loading_parquet_says_what_to_install(
    shell: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs whether pyarrow is installed or not: the file is told Parquet by its first bytes."""
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    target = tmp_path / "run.samples.parquet"
    target.write_bytes(b"PAR1" + bytes(64) + b"PAR1")
    _one_line_error(
        shell,
        f"%gpumem load {target}",
        f"{target}: a Parquet export; install pyarrow to read it (pip install 'jupyter-gpumem[parquet]')",
    )
    _one_line_error(shell, f"%gpumem export {tmp_path / 'run.json'} --parquet", "--parquet needs pyarrow")


def test_export_keeps_the_figures_and_devices_a_loaded_header_shows(
    shell: Any, fake: StatsSource, tmp_path: Path
) -> None:
    assert run_cell_capture(shell, "h = src.allocate(64 * MIB)")[0].success
    target = tmp_path / "run.json"
    assert run_cell_capture(shell, f"%gpumem export {target}")[0].success
    loaded = read_session(target)
    assert loaded.snapshot is not None
    reading = loaded.snapshot.allocator_for(0)
    assert reading is not None
    assert reading.allocated_bytes == fake.snapshot().allocator[0].allocated_bytes >= 64 * MIB
    info = fake.device_info(0)
    assert info is not None
    assert loaded.devices == [info._replace(uuid="", pci_bus_id="")]
