"""Session export and load: every sample, mark and cell comes back exactly (NaN included), older
stretches as their buckets' extremes, a damaged or foreign file refused with where, atomic writes."""

from __future__ import annotations

import html
import json
import math
import sys
from array import array
from pathlib import Path
from typing import Any

import pytest

from gpumem.core.atomic_files import ForeignFileError
from gpumem.core.cells.history import write_json
from gpumem.core.cells.record import CellRecord, CellWarning, DeviceChange, HostChange, VariableChange
from gpumem.core.readers.readings import DeviceInfo
from gpumem.core.sampling.timeline import Level, Timeline
from gpumem.core.sessions.loaded_session import LoadedSession
from gpumem.core.sessions.session_file import (
    ParquetUnavailableError,
    SavedReport,
    SessionData,
    SessionFormatError,
    capture_session,
    read_parquet_store,
    read_session,
    session_to_json,
    write_parquet,
    write_session,
)
from gpumem.testing import GIB, FakeSource

M = 1 << 20


def _record(serial: int, *, quiet: bool = False) -> CellRecord:
    device = DeviceChange(
        device=0,
        allocated_before_bytes=10 * M,
        allocated_after_bytes=74 * M + serial,
        reserved_before_bytes=20 * M,
        reserved_after_bytes=80 * M,
        peak_allocated_bytes=90 * M,
        peak_exact=serial % 2 == 0,
        peak_note="" if serial % 2 == 0 else "sampled: a lower bound",
        peak_reserved_bytes=100 * M,
        used_before_bytes=None,
        used_after_bytes=1 << 33,
        total_bytes=80 << 30,
        initialized_in_cell=serial == 1,
        process_used_after_bytes=None if serial % 2 else 3 << 30,
        driver_reserved_after_bytes=None if serial % 2 else 624 * M,
        others_used_after_bytes=None if serial % 2 else 0,
    )
    return CellRecord(
        serial=serial,
        execution_count=serial + 1 if serial != 2 else None,
        first_line="x = torch.zeros(1 << 24, device='cuda')  # é \u2013",
        source_hash="0123456789abcdef",
        started_wall_s=1_700_000_000.123456 + serial,
        duration_s=0.1 + serial / 3,
        status="ok" if serial != 3 else "out of memory",
        error=None if serial != 3 else "OutOfMemoryError: CUDA out of memory.",
        devices=(device,),
        host=HostChange(1 << 30, (1 << 30) + 4096, (1 << 30) + 8192, peak_exact=True) if serial != 2 else None,
        variables=(VariableChange("x", "Tensor", "cuda:0", 64 * M, None, hidden=False),),
        variables_note="",
        warnings=(CellWarning("leak", "x grows by 64 MiB each run"),) if serial == 3 else (),
        cuda_note=None,
        keep_peaks=serial == 2,
        mode="magic" if serial != 2 else "auto",
        quiet=quiet,
    )


def _timeline() -> Timeline:
    """Small levels, so older samples survive only as 1 s and 4 s buckets."""
    timeline = Timeline(levels=(Level(0.0, 20), Level(1.0, 6), Level(4.0, 50)))
    for step in range(200):
        time_s = 100.0 + step * 0.1
        values = {"cuda:0/allocated": float((step * 37) % 101) * M, "host/rss": float(1 << 30) + step}
        if step % 7 == 0:
            values["cuda:0/used"] = math.nan  # not measured at this sample
        timeline.append(time_s, values)
        if step % 50 == 0:
            timeline.add_mark(time_s, f"cell [{step // 50}] \u2713")
    return timeline


def _same_series(first: list[float], second: list[float]) -> bool:
    return len(first) == len(second) and all(
        (math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(first, second, strict=True)
    )


def test_round_trip_is_exact(tmp_path: Path) -> None:
    timeline = _timeline()
    cells = [_record(1), _record(2, quiet=True), _record(3)]
    reports = [SavedReport("trace", 3, "gpumem trace of cell [3]\n  <b>x</b> é"), SavedReport("profile", None, "")]
    data = capture_session(timeline, cells, reports)
    target = tmp_path / "session.json"
    assert write_session(data, target) is False
    loaded = read_session(target)
    whole = timeline.window(max_points=10**9)
    assert loaded.timeline.times == whole.times
    assert loaded.timeline.values.keys() == whole.values.keys() == {"cuda:0/allocated", "host/rss", "cuda:0/used"}
    for name, values in whole.values.items():
        assert _same_series(loaded.timeline.values[name], values), name
    assert len(whole.times) > 20  # the raw ring alone holds 20: older stretches are there as buckets
    assert max(whole.values["cuda:0/allocated"]) == 100 * M  # every sampled peak survives
    assert loaded.marks == timeline.marks()
    assert loaded.cells == cells
    assert loaded.reports == reports
    assert loaded.wall_offset_s == data.wall_offset_s
    assert loaded.exported_wall_s == data.exported_wall_s
    assert json.loads(target.read_text())["gpumem_session"] == 1  # strict JSON: NaN is null
    assert "NaN" not in target.read_text()


def _level_arrays(timeline: Timeline) -> list[tuple[bytes, ...]]:
    """Every level's keys and columns, oldest row first, as bytes: bit-exact, NaN included."""
    state = timeline.store_state()
    return [
        (
            array("d", level["keys"]).tobytes(),
            *(array("d", level["columns"][name]).tobytes() for name in state["channels"]),
        )
        for level in state["levels"]
    ]


def _open_buckets(timeline: Timeline) -> list[bytes]:
    buckets = [level["open"] for level in timeline.store_state()["levels"]]
    return [
        b"" if b is None else array("d", [b["key"], *b["low"], *b["high"], *b["low_first"]]).tobytes() for b in buckets
    ]


def _assert_same_store(restored: Timeline, timeline: Timeline) -> None:
    assert _level_arrays(restored) == _level_arrays(timeline)
    assert _open_buckets(restored) == _open_buckets(timeline)
    before, after = timeline.store_state(), restored.store_state()
    for key in ("channels", "last_time_s", "max_marks", "marks"):
        assert after[key] == before[key], key
    assert [level["evicted"] for level in after["levels"]] == [level["evicted"] for level in before["levels"]]
    whole, again = timeline.window(max_points=10**9), restored.window(max_points=10**9)
    assert again.times == whole.times
    for name, values in whole.values.items():
        assert _same_series(again.values[name], values), name


def test_every_level_round_trips_exactly(tmp_path: Path) -> None:
    timeline = _timeline()
    state = timeline.store_state()
    assert [len(level["keys"]) for level in state["levels"]] == [
        20,
        6,
        4,
    ]  # raw full, 1 s full, 4 s: 100-115 s (116- is open)
    assert state["levels"][0]["evicted"] == pytest.approx(117.9)  # raw samples were lost: buckets hold them
    assert all(level["open"] is not None for level in state["levels"][1:])
    data = capture_session(timeline, [])
    write_session(data, tmp_path / "session.json")
    loaded = read_session(tmp_path / "session.json")
    restored = loaded.restore_timeline()
    assert restored is not None
    _assert_same_store(restored, timeline)
    shown = "store restored, every level: 20 of 20 raw samples, 6 of 6 1.00 s buckets, 4 of 50 4.00 s buckets"
    assert shown in repr(LoadedSession(loaded, "session.json")).splitlines()
    # and it goes on like the original: the next sample closes the same buckets
    for store in (restored, timeline):
        store.append(130.0, {"cuda:0/allocated": 5.0 * M, "host/rss": 1.0})
    _assert_same_store(restored, timeline)


def test_every_level_round_trips_through_parquet(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow.parquet")
    timeline = _timeline()
    written = write_parquet(capture_session(timeline, []), tmp_path / "run")
    assert [path.name for path in written[2:]] == ["run.level0.parquet", "run.level1.parquet", "run.level2.parquet"]
    restored = Timeline.from_state(read_parquet_store(tmp_path / "run"))
    _assert_same_store(restored, timeline)


def test_a_damaged_store_is_refused_saying_where(tmp_path: Path) -> None:
    document = session_to_json(capture_session(_timeline(), []))
    document["store"]["levels"][1]["columns"]["host/rss"].pop()
    (tmp_path / "bad.json").write_text(json.dumps(document))
    with pytest.raises(
        SessionFormatError, match="timeline store: ValueError: channel 'host/rss': 11 values for 6 rows"
    ):
        read_session(tmp_path / "bad.json")


def test_a_history_export_loads_as_cells(tmp_path: Path) -> None:
    cells = [_record(1), _record(3)]
    target = tmp_path / "history.json"
    write_json(cells, target)
    loaded = read_session(target)
    assert loaded.cells == cells
    assert loaded.timeline.times == []
    assert loaded.notes == ["A history export: cells only, no timeline."]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "not JSON (line 1: Expecting value)"),
        ("[1]", "not a gpumem export (the file is not a JSON object)"),
        ('{"other": 1}', "not a gpumem export (no 'gpumem_session' key)"),
        ('{"gpumem_session": 2}', "a gpumem export of version 2; this gpumem reads version 1"),
        (
            '{"gpumem_session": 1, "timeline": {"times": [1], "values": {"a": []}}, "marks": [], "cells": []}',
            "timeline channel 'a' has 0 values for 1 times",
        ),
        (
            '{"gpumem_session": 1, "timeline": {"times": [], "values": {}}, "marks": [], "cells": [{"serial": 1}]}',
            "cell 1: KeyError: 'devices'",
        ),
    ],
)
def test_a_bad_file_is_refused_saying_why(tmp_path: Path, text: str, message: str) -> None:
    target = tmp_path / "bad.json"
    target.write_text(text)
    with pytest.raises(SessionFormatError) as refused:
        read_session(target)
    assert str(refused.value) == message


def test_another_file_is_not_replaced(tmp_path: Path) -> None:
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}')
    data = capture_session(_timeline(), [])
    with pytest.raises(ForeignFileError):
        write_session(data, notes)
    assert notes.read_text() == '{"mine": true}'
    assert write_session(data, notes, force=True) is True
    assert write_session(data, notes) is True  # now it is an export: replaced without --force
    assert [path.name for path in tmp_path.iterdir()] == ["notes.json"]


def test_parquet_holds_the_same_samples_and_cells(tmp_path: Path) -> None:
    parquet = pytest.importorskip("pyarrow.parquet")
    timeline = _timeline()
    data = capture_session(timeline, [_record(1), _record(3)])
    written = write_parquet(data, tmp_path / "run")
    assert [path.name for path in written[:2]] == ["run.samples.parquet", "run.cells.parquet"]
    samples = parquet.read_table(written[0]).to_pydict()
    assert samples["time_s"] == data.timeline.times
    assert _same_series(samples["cuda:0/allocated"], data.timeline.values["cuda:0/allocated"])
    cells = parquet.read_table(written[1]).to_pydict()
    assert cells["cell"] == [2, 4]  # the execution counts, as everywhere
    assert cells["serial"] == [1, 3]
    assert cells["cuda0_allocated_after_bytes"] == [74 * M + 1, 74 * M + 3]


def test_the_loaded_view_draws_every_channel_and_the_history() -> None:
    data = capture_session(_timeline(), [_record(1)])
    view = LoadedSession(data, "run.json")
    page = view._repr_html_()
    assert page.count("<svg") == 1
    assert "cuda:0/allocated" in page
    assert "host/rss" in page
    assert "cell [1] \u2713" in page  # a mark, as the tooltip of its line
    assert "x = torch.zeros" in page  # the history table
    text = repr(view)
    assert text.startswith("gpumem session from run.json, exported ")
    assert "  cuda:0/allocated: peak 100.0 MiB" in text
    assert "  cuda:0/used: never measured" in text
    empty = LoadedSession(SessionData(data.timeline._replace(times=[], values={}), [], []), "e.json")
    assert "No samples in this export." in repr(empty)


def test_parquet_levels_of_an_earlier_export_are_not_read_back(tmp_path: Path) -> None:
    """An earlier export to the same stem with more levels leaves its last level file behind: the store read
    back is the newer export's, its own levels only."""
    pytest.importorskip("pyarrow.parquet")
    older = Timeline(levels=(Level(0.0, 20), Level(1.0, 6), Level(4.0, 50), Level(16.0, 5)))
    for step in range(300):
        older.append(step * 0.5, {"cuda:0/allocated": float(step)})
    write_parquet(capture_session(older, []), tmp_path / "run")
    timeline = _timeline()
    write_parquet(capture_session(timeline, []), tmp_path / "run")
    assert (tmp_path / "run.level3.parquet").exists()  # the older export's, not this one's
    _assert_same_store(Timeline.from_state(read_parquet_store(tmp_path / "run")), timeline)


def _parquet_export(tmp_path: Path) -> tuple[SessionData, Timeline]:
    timeline = _timeline()
    cells = [_record(1), _record(2, quiet=True), _record(3)]
    reports = [SavedReport("trace", 3, "gpumem trace of cell [3]\n  <b>x</b> é"), SavedReport("profile", None, "")]
    data = capture_session(timeline, cells, reports)
    write_parquet(data, tmp_path / "run")
    return data, timeline


@pytest.mark.parametrize(
    "name", ["run.samples.parquet", "run.cells.parquet", "run.level2.parquet", "run", "run.parquet"]
)
def test_a_parquet_export_reads_back_as_exactly_as_the_json(tmp_path: Path, name: str) -> None:
    """Any file of the set (told by its first bytes), or the set's stem, reads the whole session back."""
    pytest.importorskip("pyarrow.parquet")
    data, timeline = _parquet_export(tmp_path)
    loaded = read_session(tmp_path / name)
    whole = timeline.window(max_points=10**9)
    assert loaded.timeline.times == whole.times
    assert loaded.timeline.values.keys() == whole.values.keys() == {"cuda:0/allocated", "host/rss", "cuda:0/used"}
    for channel, values in whole.values.items():
        assert _same_series(loaded.timeline.values[channel], values), channel
    assert loaded.marks == timeline.marks()
    assert loaded.cells == data.cells
    assert loaded.cells[1].quiet
    assert loaded.reports == data.reports
    assert (loaded.wall_offset_s, loaded.exported_wall_s) == (data.wall_offset_s, data.exported_wall_s)
    restored = loaded.restore_timeline()
    assert restored is not None
    _assert_same_store(restored, timeline)
    assert repr(LoadedSession(loaded, "x")) == repr(LoadedSession(data, "x"))


def _rewrite(path: Path, edit: Any, key: bytes = b"gpumem_session") -> None:
    """The Parquet file with its gpumem metadata passed through ``edit`` (a hand-edited file)."""
    parquet = pytest.importorskip("pyarrow.parquet")
    table = parquet.read_table(path)
    meta = json.loads(table.schema.metadata[key])
    parquet.write_table(table.replace_schema_metadata({key: json.dumps(edit(meta))}), path)


def _refused(path: Path) -> str:
    with pytest.raises(SessionFormatError) as error:
        read_session(path)
    return str(error.value)


def test_a_cell_missing_a_field_every_export_has_is_refused_though_the_record_has_a_default(tmp_path: Path) -> None:
    target = tmp_path / "cells.json"
    write_json([_record(1)], target)
    document = json.loads(target.read_text())
    del document["cells"][0]["status"]  # a scope's record is "ok" by default; a cell in a file must say
    target.write_text(json.dumps(document))
    with pytest.raises(SessionFormatError, match="cell 1: KeyError: 'status'"):
        read_session(target)


def test_a_damaged_parquet_export_is_refused_saying_why(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow.parquet")
    _parquet_export(tmp_path)
    samples, cells = tmp_path / "run.samples.parquet", tmp_path / "run.cells.parquet"
    good = cells.read_bytes()
    _rewrite(cells, lambda meta: {**meta, "cells": [{"serial": 1}]})
    assert _refused(samples) == "cell 1: KeyError: 'devices'"
    _rewrite(cells, lambda meta: {**meta, "gpumem_session": 2})
    assert _refused(samples) == "a gpumem export of version 2; this gpumem reads version 1"
    _rewrite(cells, lambda meta: {**meta, "export": "another"})
    assert _refused(samples) == "run.samples.parquet is of another export than run.cells.parquet"
    _rewrite(cells, lambda meta: {k: v for k, v in meta.items() if k != "export"})
    assert _refused(cells) == (
        "run.cells.parquet is of an older export (flat cell rows only); load the JSON file written with it"
    )
    cells.write_bytes(good[: len(good) // 2])  # truncated
    assert _refused(samples).startswith("ArrowInvalid: ")
    cells.unlink()
    assert _refused(samples) == "run.cells.parquet is missing (a Parquet export is read as a set)"


def test_a_damaged_parquet_level_is_refused_saying_why(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow.parquet")
    _parquet_export(tmp_path)
    level, samples = tmp_path / "run.level1.parquet", tmp_path / "run.samples.parquet"
    _rewrite(level, lambda meta: {**meta, "capacity": 10**12}, b"gpumem_store")
    assert (
        _refused(samples) == "timeline store: ValueError: level 1: a capacity of 1000000000000 rows (1 to 10,000,000)"
    )
    _rewrite(level, lambda meta: {**meta, "export": "another"}, b"gpumem_store")  # left by another export
    assert _refused(samples) == "run.level1.parquet is of another export than run.cells.parquet"
    level.unlink()
    assert _refused(samples) == "run.level1.parquet is missing (a Parquet export is read as a set)"


def test_a_hand_made_parquet_file_is_refused_saying_why(tmp_path: Path) -> None:
    parquet = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    _parquet_export(tmp_path)
    samples = tmp_path / "run.samples.parquet"
    table = parquet.read_table(samples)
    parquet.write_table(table.set_column(0, "time_s", pa.array([math.inf] * table.num_rows)), samples)
    assert _refused(samples) == "timeline times: inf is not a finite number"
    parquet.write_table(table.drop_columns(["time_s"]), samples)
    assert _refused(samples) == "KeyError: 'time_s'"
    parquet.write_table(pa.table({"a": [1]}), tmp_path / "notes.parquet")
    assert _refused(tmp_path / "notes.parquet") == (
        "a Parquet file, but not one of a gpumem export's (STEM.samples.parquet, STEM.cells.parquet, "
        "STEM.levelN.parquet)"
    )
    parquet.write_table(pa.table({"a": [1]}), samples)
    assert _refused(samples) == "run.samples.parquet: not a gpumem export's (no gpumem_session metadata)"
    (tmp_path / "json.samples.parquet").write_text('{"other": 1}')  # the name says Parquet, the content JSON
    assert _refused(tmp_path / "json.samples.parquet") == "not a gpumem export (no 'gpumem_session' key)"


def test_without_pyarrow_a_parquet_export_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Told by its first bytes, before pyarrow is asked for; runs whether pyarrow is installed or not."""
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    target = tmp_path / "run.samples.parquet"
    target.write_bytes(b"PAR1" + bytes(64) + b"PAR1")
    for path in (target, tmp_path / "run"):
        with pytest.raises(ParquetUnavailableError) as error:
            read_session(path)
        assert (
            str(error.value) == "a Parquet export; install pyarrow to read it (pip install 'jupyter-gpumem[parquet]')"
        )


def test_the_figures_and_devices_at_export_come_back(tmp_path: Path) -> None:
    """The header of a loaded panel: the snapshot read at export and each device's name and capacity, exactly;
    the card's UUID and PCI bus id are not written."""
    source = FakeSource(devices=1, total_bytes=140 * GIB)
    handle = source.allocate(3 * GIB)
    source.free(handle)
    source.allocate(GIB)
    snapshot = source.snapshot()
    info = DeviceInfo(0, 0, "NVIDIA H200", "GPU-1234", "00000000:19:00.0", 140 * GIB)
    target = tmp_path / "session.json"
    write_session(capture_session(_timeline(), [], snapshot=snapshot, devices=[info]), target)
    assert "GPU-1234" not in target.read_text() and "00000000:19" not in target.read_text()
    loaded = read_session(target)
    assert loaded.snapshot == snapshot
    assert loaded.devices == [info._replace(uuid="", pci_bus_id="")]
    older = json.loads(target.read_text())
    del older["machine"]  # exports made before the figures were kept still load
    target.write_text(json.dumps(older))
    assert read_session(target).snapshot is None
    assert read_session(target).devices == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m["snapshot"]["allocator"][0].update(allocated_bytes=None), "allocated_bytes is null"),
        (lambda m: m["snapshot"]["allocator"][0].pop("reserved_bytes"), "KeyError: 'reserved_bytes'"),
        (lambda m: m["devices"][0].update(total_bytes="lots"), "ValueError"),
        (lambda m: m.update(devices=3), "machine devices: expected a list"),
    ],
)
def test_damaged_figures_at_export_are_refused_saying_where(tmp_path: Path, change: Any, message: str) -> None:
    source = FakeSource(devices=1)
    info = DeviceInfo(0, 0, "GPU", "", "", 80 * GIB)
    document = session_to_json(capture_session(_timeline(), [], snapshot=source.snapshot(), devices=[info]))
    change(document["machine"])
    target = tmp_path / "session.json"
    target.write_text(json.dumps(document))
    with pytest.raises(SessionFormatError, match="machine") as refused:
        read_session(target)
    assert message in str(refused.value)


def test_the_loaded_view_folds_each_cells_report_and_leaves_the_curves_to_the_panel() -> None:
    from gpumem.core.cells.report import CellReport, CellSummary

    data = capture_session(_timeline(), [_record(1), _record(2, quiet=True)])
    page = LoadedSession(data, "run.json", curves=False)._repr_html_()
    assert "<svg" not in page  # a notebook draws them in the read-only panel
    assert page.count("<details class='gpumem-cell-report'") == 2
    for record in data.cells:
        assert CellReport(record)._repr_html_() in page
        assert f"data-cell='{record.execution_count}'><summary>" in page
    assert html.escape(repr(CellSummary(data.cells[0]))) in page


def test_an_export_written_before_a_reading_gained_a_field_still_loads(tmp_path: Path) -> None:
    """A field added to a reading later (with a default) may be absent from an older export: the default stands;
    a field without a default is still required."""
    source = FakeSource(devices=1, total_bytes=140 * GIB)
    source.allocate(GIB)
    target = tmp_path / "session.json"
    write_session(capture_session(_timeline(), [], snapshot=source.snapshot()), target)
    document = json.loads(target.read_text())
    for reading in document["machine"]["snapshot"]["allocator"]:
        del reading["live_allocations"]
    target.write_text(json.dumps(document))
    loaded = read_session(target)
    assert loaded.snapshot is not None
    assert [reading.live_allocations for reading in loaded.snapshot.allocator] == [-1]
    del document["machine"]["snapshot"]["allocator"][0]["allocated_bytes"]
    target.write_text(json.dumps(document))
    with pytest.raises(SessionFormatError, match="allocated_bytes"):
        read_session(target)
