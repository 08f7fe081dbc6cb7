"""A session on file: ``%gpumem export`` writes the timeline, its marks and the cell history; ``%gpumem
load`` reads them back, read-only, to look at on a machine without the GPU.

The timeline is exported twice: as :meth:`Timeline.window` returns it over all time with no
decimation (raw samples where they are still kept, and for older stretches each coarser bucket's
minimum and maximum, so every peak ever sampled is there), and as its whole store, every level
(resolution) row by row with its open bucket (:meth:`Timeline.store_state`), which loading rebuilds
exactly. A cell is :func:`record_to_dict`'s object; loading rebuilds the same :class:`CellRecord`, so a
round trip is exact (NaN, "not measured", is written as null). ``python -m gpumem run --save`` writes this
same format, with the run's own figures under ``run`` (cells: none); files it wrote in its earlier format
(``"format": "gpumem-session"``) load too. The JSON file is written atomically; with pyarrow installed
(``pip install jupyter-gpumem[parquet]``) the same document can also be written as a set of Parquet
files (:mod:`gpumem.core.sessions.parquet`), which :func:`read_session` reads back as exactly.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TextIO

from gpumem.core.atomic_files import replace_file
from gpumem.core.cells.history import history_rows, record_to_dict
from gpumem.core.cells.record import (
    CellRecord,
    CellWarning,
    DeviceChange,
    HostChange,
    KindChange,
    VariableChange,
)
from gpumem.core.readers.readings import AllocatorReading, DeviceInfo, DeviceReading, HostReading, Snapshot
from gpumem.core.sampling.timeline import Mark, Series, Timeline
from gpumem.core.sessions.parquet import (
    ParquetExportError,
    parquet_stem,
    read_document,
    read_store_document,
    write_document,
)

__all__ = [
    "JSON_MARKER",
    "PARQUET_INSTALL",
    "ParquetUnavailableError",
    "SavedReport",
    "SessionData",
    "SessionFormatError",
    "capture_session",
    "is_session_export",
    "read_parquet_store",
    "read_session",
    "record_from_dict",
    "session_to_json",
    "write_parquet",
    "write_session",
]

JSON_MARKER = "gpumem_session"
JSON_VERSION = 1
_HISTORY_MARKER = "gpumem_history"  # %gpumem history --json files load too (cells only)
# ``python -m gpumem run --save``'s earlier format ({"format": "gpumem-session", "version": 1, ...}): users have them.
_RUN_FORMAT = "gpumem-session"
_RUN_KEYS = ("script", "argv", "exit_code", "started_wall_s", "duration_s", "figures", "peak_times_s", "samples")


class SavedReport(NamedTuple):
    """A report shown under a cell (``--trace``, ``--profile``), kept as its text."""

    kind: str
    cell: int | None
    text: str


class SessionFormatError(ValueError):
    """The file is not a gpumem session (or history) export, or is damaged; the message says where."""


PARQUET_INSTALL = "pip install 'jupyter-gpumem[parquet]'"


class ParquetUnavailableError(SessionFormatError):
    """A Parquet export, and pyarrow (the ``parquet`` extra) is not installed to read it."""


@dataclass
class SessionData:
    """What an export holds. Times are the exporting process's monotonic seconds;
    ``wall_offset_s`` added to one gives the wall-clock time (seconds since the epoch)."""

    timeline: Series
    marks: list[Mark]
    cells: list[CellRecord]
    wall_offset_s: float | None = None
    exported_wall_s: float | None = None
    notes: list[str] = field(default_factory=list)
    reports: list[SavedReport] = field(default_factory=list)
    store: dict[str, Any] | None = None  # Timeline.store_state(): every level; None in older exports
    # What ``python -m gpumem run`` measured of its script (script, argv, exit_code, started_wall_s,
    # duration_s, figures: the report's rows, peak_times_s, samples); None for a notebook's session.
    run: dict[str, Any] | None = None
    snapshot: Snapshot | None = None  # every figure read when it was exported; None in older exports
    devices: list[DeviceInfo] = field(default_factory=list)  # name and capacity of each device in use

    def restore_timeline(self) -> Timeline | None:
        """The exported timeline store rebuilt, every level as it was (None: the export has none)."""
        return None if self.store is None else Timeline.from_state(self.store)


def capture_session(
    timeline: Timeline,
    cells: Sequence[CellRecord],
    reports: Sequence[SavedReport] = (),
    snapshot: Snapshot | None = None,
    devices: Sequence[DeviceInfo] = (),
) -> SessionData:
    """The session as it is now (the timeline read through its public window()), with the figures and
    device descriptions read at export (the header of a loaded panel). A device's UUID and PCI bus id
    are left out: a shared export names the GPU model, not the machine's card."""
    store = timeline.store_state()
    series = Timeline.from_state(store).window(max_points=sys.maxsize)  # the same instant as the store
    now_wall, now_monotonic = time.time(), time.monotonic()
    offset = now_wall - now_monotonic
    marks = [Mark(time_s, label) for time_s, label in store["marks"]]
    described = [info._replace(uuid="", pci_bus_id="") for info in devices]
    return SessionData(
        series, marks, list(cells), offset, now_wall, reports=list(reports), store=store, snapshot=snapshot,
        devices=described,
    )  # fmt: skip


# Writing ----------------------------------------------------------------------------------------


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value


def session_to_json(data: SessionData) -> dict[str, Any]:
    return {
        JSON_MARKER: JSON_VERSION,
        "exported_wall_s": data.exported_wall_s,
        "wall_offset_s": data.wall_offset_s,
        "timeline": {
            "times": list(data.timeline.times),
            "values": {name: [_number(v) for v in values] for name, values in data.timeline.values.items()},
        },
        "marks": [[mark.time_s, mark.label] for mark in data.marks],
        "cells": [record_to_dict(record) for record in data.cells],
        "reports": [report._asdict() for report in data.reports],
        "store": None if data.store is None else _store_to_json(data.store),
        "run": data.run,
        "machine": _machine_to_json(data.snapshot, data.devices),
    }


def _machine_to_json(snapshot: Snapshot | None, devices: Sequence[DeviceInfo]) -> dict[str, Any]:
    """The figures at export and the devices' descriptions, as plain objects."""
    figures = None
    if snapshot is not None:
        host = snapshot.host
        figures = {
            "monotonic_s": snapshot.monotonic_s,
            "wall_time_s": snapshot.wall_time_s,
            "allocator": [reading._asdict() for reading in snapshot.allocator],
            "devices": [reading._asdict() for reading in snapshot.devices],
            "host": None if host is None else host._asdict(),
        }
    return {"snapshot": figures, "devices": [info._asdict() for info in devices]}


def _machine_from_json(value: Any) -> tuple[Snapshot | None, list[DeviceInfo]]:
    """What :func:`_machine_to_json` wrote (absent in older exports); every field checked by its type."""
    if value is None:
        return None, []
    try:
        devices = [DeviceInfo(**_typed(DeviceInfo, item)) for item in _list(value["devices"], "machine devices")]
        figures = value["snapshot"]
        if figures is None:
            return None, devices
        host = figures["host"]
        snapshot = Snapshot(
            monotonic_s=float(figures["monotonic_s"]),
            wall_time_s=float(figures["wall_time_s"]),
            allocator=tuple(AllocatorReading(**_typed(AllocatorReading, r)) for r in figures["allocator"]),
            devices=tuple(DeviceReading(**_typed(DeviceReading, r)) for r in figures["devices"]),
            host=None if host is None else HostReading(**_typed(HostReading, host)),
        )
    except (TypeError, KeyError, ValueError) as error:
        raise SessionFormatError(f"machine: {type(error).__name__}: {error}") from None
    return snapshot, devices


def _typed(cls: Any, item: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of ``cls`` from ``item``, each converted to its declared type (int, float, str; None kept)."""
    fields = _fields(cls, item)
    # A field with a default may be absent: an export written before that field existed.
    missing = [name for name in cls._fields if name not in fields and name not in cls._field_defaults]
    if missing:
        raise KeyError(", ".join(missing))
    typed = {}
    for name, hint in typing.get_type_hints(cls).items():
        if name not in fields:
            continue  # absent with a default (checked above): the class's default stands
        kinds = [kind for kind in typing.get_args(hint) or (hint,) if kind is not type(None)]
        value = fields[name]
        if value is None and len(kinds) == len(typing.get_args(hint) or (hint,)):
            raise ValueError(f"{name} is null")
        typed[name] = None if value is None else kinds[0](value)
    return typed


def _store_to_json(store: Mapping[str, Any]) -> dict[str, Any]:
    """NaN (not measured) as null, as in the timeline's columns."""
    return {**store, "levels": [_level_numbers(level, _number) for level in store["levels"]]}


def _level_numbers(level: Mapping[str, Any], convert: Callable[[Any], Any]) -> dict[str, Any]:
    """One level of the store with ``convert`` applied to every value of its columns and open bucket."""
    columns = {name: [convert(v) for v in values] for name, values in level["columns"].items()}
    opened = level["open"]
    if opened is not None:
        opened = {**opened, "low": [convert(v) for v in opened["low"]], "high": [convert(v) for v in opened["high"]]}
    return {**level, "columns": columns, "open": opened}


def _store_from_json(value: Any) -> dict[str, Any] | None:
    """The store as written, null read back as NaN; checked by rebuilding it."""
    if value is None:
        return None
    try:
        levels = []
        for level in value["levels"]:
            levels.append(_level_numbers(level, _float))
            _check_capacity(len(levels) - 1, level["capacity"])  # before its rows are allocated
        store = {**value, "levels": levels}
        Timeline.from_state(store)
    except (TypeError, KeyError, ValueError, AttributeError, OverflowError) as error:
        raise SessionFormatError(f"timeline store: {type(error).__name__}: {error}") from None
    return store


# The most rows a loaded level may hold: hundreds of times the default levels' (21,600), yet each is
# allocated whole when the store is rebuilt, so a hand-edited capacity cannot take the machine's memory.
_MAX_LEVEL_ROWS = 10_000_000


def _check_capacity(index: int, capacity: Any) -> None:
    if not 0 < float(capacity) <= _MAX_LEVEL_ROWS:
        raise ValueError(f"level {index}: a capacity of {capacity} rows (1 to {_MAX_LEVEL_ROWS:,})")


def _float(value: Any) -> float:
    return math.nan if value is None else float(value)


def write_session(data: SessionData, path: str | os.PathLike[str], *, force: bool = False) -> bool:
    """The session as one JSON file, atomically; True when it replaced an earlier export.

    Another file there raises :class:`~gpumem.core.atomic_files.ForeignFileError` unless ``force``.
    """

    def write(handle: TextIO) -> None:
        json.dump(session_to_json(data), handle, allow_nan=False)
        handle.write("\n")

    return replace_file(path, write, recognise=is_session_export, force=force)


def is_session_export(start: bytes) -> bool:
    """Whether a file starts as a session export does (also one of ``run --save``'s earlier format)."""
    text = start.decode("utf-8", errors="replace").lstrip()
    return re.match(r'\{\s*"(' + JSON_MARKER + r'"\s*:|format"\s*:\s*"' + _RUN_FORMAT + '")', text) is not None


def write_parquet(data: SessionData, stem: Path) -> list[Path]:
    """``STEM.samples.parquet``, ``STEM.cells.parquet`` (the history's flat rows, and the cells themselves
    in its metadata) and ``STEM.levelN.parquet`` per level (:mod:`gpumem.core.sessions.parquet`); ImportError
    without pyarrow."""
    return write_document(session_to_json(data), history_rows(data.cells), stem)


def read_parquet_store(stem: Path, export: str | None = None) -> dict[str, Any]:
    """The timeline store from ``STEM.levelN.parquet`` (as :meth:`Timeline.store_state` gave it); ImportError
    without pyarrow, OSError when a file is missing, :class:`SessionFormatError` when it is not one (or not of
    ``export``)."""
    try:
        found = _store_from_json(read_store_document(stem, export))
    except ParquetExportError as error:
        raise SessionFormatError(str(error)) from None
    assert found is not None
    return found


# Reading ----------------------------------------------------------------------------------------


def read_session(path: str | os.PathLike[str]) -> SessionData:
    """An export read back: a session's JSON file, any file of its Parquet set (or the set's stem), or a
    ``%gpumem history --json`` file (cells only). The format is told by the content, not the name.

    OSError when it cannot be read; :class:`SessionFormatError` when it is not such a file
    (:class:`ParquetUnavailableError` when it is Parquet and pyarrow is not installed).
    """
    try:
        stem = parquet_stem(Path(path))
        document = None if stem is None else read_document(stem)
    except ImportError:
        raise ParquetUnavailableError(f"a Parquet export; install pyarrow to read it ({PARQUET_INSTALL})") from None
    except ParquetExportError as error:
        raise SessionFormatError(str(error)) from None
    if document is not None:
        return _session_from_document(document)
    text = Path(path).read_text(encoding="utf-8")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise SessionFormatError(f"not JSON (line {error.lineno}: {error.msg})") from None
    return _session_from_document(document)


def _session_from_document(document: Any) -> SessionData:
    """A session (or history) export's object, checked field by field."""
    if not isinstance(document, dict):
        raise SessionFormatError("not a gpumem export (the file is not a JSON object)")
    if document.get(_HISTORY_MARKER) == 1:
        cells = _cells(document.get("cells"))
        return SessionData(Series([], {}), [], cells, notes=["A history export: cells only, no timeline."])
    if document.get("format") == _RUN_FORMAT and JSON_MARKER not in document:
        return _session_from_run_file(document)
    version = document.get(JSON_MARKER)
    if version is None:
        raise SessionFormatError(f"not a gpumem export (no {JSON_MARKER!r} key)")
    if version != JSON_VERSION:
        raise SessionFormatError(f"a gpumem export of version {version!r}; this gpumem reads version {JSON_VERSION}")
    snapshot, devices = _machine_from_json(document.get("machine"))
    return SessionData(
        timeline=_series(document.get("timeline")),
        marks=_marks(document.get("marks")),
        cells=_cells(document.get("cells")),
        wall_offset_s=_optional_float(document.get("wall_offset_s")),
        exported_wall_s=_optional_float(document.get("exported_wall_s")),
        reports=_reports(document.get("reports", [])),
        store=_store_from_json(document.get("store")),
        run=_run(document.get("run")),
        snapshot=snapshot,
        devices=devices,
    )


def _run(value: Any) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise SessionFormatError("run: expected an object")
    return value


def _session_from_run_file(document: dict[str, Any]) -> SessionData:
    """A file ``python -m gpumem run --save`` wrote in its earlier format: the run's figures and its timeline
    (times counted from the start of the run), no cells, no marks."""
    if document.get("version") != 1:
        raise SessionFormatError(f"a gpumem run file of version {document.get('version')!r}; this gpumem reads 1")
    timeline = document.get("timeline")
    if not isinstance(timeline, dict):
        raise SessionFormatError("timeline: expected an object")
    started = _optional_float(document.get("started_wall_s"))
    duration = _optional_float(document.get("duration_s"))
    return SessionData(
        timeline=_series({"times": timeline.get("times_s"), "values": timeline.get("values_bytes")}),
        marks=[],
        cells=[],
        wall_offset_s=started,
        exported_wall_s=None if started is None or duration is None else started + duration,
        notes=["Saved by python -m gpumem run --save (its earlier format): the run's timeline and figures."],
        run={key: document[key] for key in _RUN_KEYS if key in document},
    )


def _marks(value: Any) -> list[Mark]:
    try:
        return [Mark(float(time_s), str(label)) for time_s, label in _list(value, "marks")]
    except (TypeError, ValueError) as error:
        raise SessionFormatError(f"marks: {type(error).__name__}: {error}") from None


def _reports(value: Any) -> list[SavedReport]:
    reports = []
    for item in _list(value, "reports"):
        if not isinstance(item, dict) or not isinstance(item.get("text"), str):
            raise SessionFormatError("reports: each must be an object with a text")
        cell = item.get("cell")
        reports.append(SavedReport(str(item.get("kind", "")), cell if isinstance(cell, int) else None, item["text"]))
    return reports


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise SessionFormatError(f"{what}: expected a list")
    return value


def _optional_float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _series(value: Any) -> Series:
    if not isinstance(value, dict):
        raise SessionFormatError("timeline: expected an object")
    times = [_finite(t, "timeline times") for t in _list(value.get("times"), "timeline times")]
    channels = value.get("values")
    if not isinstance(channels, dict):
        raise SessionFormatError("timeline values: expected an object")
    values: dict[str, list[float]] = {}
    for name, column in channels.items():
        what = f"timeline channel {name!r}"
        numbers = [math.nan if v is None else _finite(v, what) for v in _list(column, what)]
        if len(numbers) != len(times):
            raise SessionFormatError(f"timeline channel {name!r} has {len(numbers)} values for {len(times)} times")
        values[str(name)] = numbers
    return Series(times, values)


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SessionFormatError(f"{what}: {value!r} is not a finite number")
    return float(value)


def _cells(value: Any) -> list[CellRecord]:
    cells: list[CellRecord] = []
    items = _list(value, "cells")
    try:
        cells.extend(record_from_dict(item) for item in items)
    except (TypeError, KeyError, ValueError) as error:
        raise SessionFormatError(f"cell {len(cells) + 1}: {type(error).__name__}: {error}") from None
    return cells


def _fields(cls: Any, item: Mapping[str, Any]) -> dict[str, Any]:
    """The NamedTuple's own fields of ``item`` (record_to_dict adds derived ones, such as deltas)."""
    if not isinstance(item, Mapping):
        raise TypeError(f"expected an object, not {type(item).__name__}")
    return {name: item[name] for name in cls._fields if name in item}


# What every export of a record has had, though the record itself has a default for it (a scope's).
_EVERY_EXPORT_HAS = ("cell", "serial", "source_hash", "status", "error", "variables_note", "cuda_note",
                     "keep_peaks", "mode")  # fmt: skip


def record_from_dict(item: Mapping[str, Any]) -> CellRecord:
    """The record that :func:`record_to_dict` described (a field an older export lacks keeps its default)."""
    fields = _fields(CellRecord, item)
    if "cell" in item:  # the export names the execution count "cell", as the history table does
        fields["execution_count"] = item["cell"]
    fields["kinds"] = tuple(KindChange(**_fields(KindChange, k)) for k in item.get("kinds", ()))
    fields.update(notes=tuple(item.get("notes", ())), path=tuple(item.get("path", ())))
    fields["devices"] = tuple(DeviceChange(**_fields(DeviceChange, d)) for d in item["devices"])
    host = item.get("host")
    fields["host"] = None if host is None else HostChange(**_fields(HostChange, host))
    fields["variables"] = tuple(VariableChange(**_fields(VariableChange, v)) for v in item["variables"])
    fields["warnings"] = tuple(CellWarning(**_fields(CellWarning, w)) for w in item["warnings"])
    missing = [name for name in _EVERY_EXPORT_HAS if name not in item]  # then it is not an export of ours
    if missing:
        raise KeyError(", ".join(missing))
    return CellRecord(**fields)
