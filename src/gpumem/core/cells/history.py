"""The history of measured cells: ``%gpumem history``'s table, flat rows, a DataFrame, JSON and CSV files."""

from __future__ import annotations

import csv
import html
import json
import os
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

from gpumem.core.atomic_files import replace_file
from gpumem.core.cells.formatting import STYLE, cell_label, format_duration, peak_above
from gpumem.core.cells.kind_changes import kinds_brief, kinds_since_earlier
from gpumem.core.cells.record import CellRecord
from gpumem.core.units import format_delta

__all__ = [
    "JSON_MARKER",
    "HistoryTable",
    "history_columns",
    "history_dataframe",
    "history_rows",
    "is_csv_export",
    "is_json_export",
    "record_to_dict",
    "write_csv",
    "write_json",
]


def _devices_in(records: Iterable[CellRecord]) -> list[int]:
    return sorted({change.device for record in records for change in record.devices})


def _time_text(wall_s: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall_s))


class HistoryTable:
    """``%gpumem history``: one row per measured cell, newest last."""

    def __init__(self, records: Sequence[CellRecord], total: int | None = None) -> None:
        self.records = list(records)
        self.total = len(self.records) if total is None else total

    def _columns(self) -> tuple[list[str], list[list[str]]]:
        devices = _devices_in(self.records)
        header = ["cell", "started", "duration", "status"]
        for device in devices:
            header += [f"cuda:{device} alloc \u0394", f"cuda:{device} peak"]
        header += ["host \u0394", "by kind", "warnings", "first line"]
        rows: list[list[str]] = []
        for record in self.records:
            row = [
                cell_label(record),
                _time_text(record.started_wall_s),
                format_duration(record.duration_s),
                record.status,
            ]
            by_device = {change.device: change for change in record.devices}
            for device in devices:
                change = by_device.get(device)
                if change is None:
                    row += ["-", "-"]
                else:
                    row += [
                        format_delta(change.allocated_delta_bytes),
                        peak_above(change.peak_above_start_bytes, change.peak_exact, ""),
                    ]
            row.append(format_delta(record.host.rss_delta_bytes) if record.host is not None else "n/a")
            row.append(_kinds_column(record))
            row.append(_marks(record))
            row.append(record.first_line)
            rows.append(row)
        return _without_empty(header, rows, "by kind")

    def _empty_text(self) -> str:
        return f"None of the {self.total} measured cells shown." if self.total else "No measured cells yet."

    def _repr_html_(self) -> str:
        if not self.records:
            return f'<div class="gpumem-report">{self._empty_text()}</div>'
        header, rows = self._columns()
        e = html.escape
        parts = [STYLE, '<div class="gpumem-report"><table class="history"><thead><tr>']
        parts += [f"<th>{e(name)}</th>" for name in header[:-1]]
        parts.append(f'<th class="src">{e(header[-1])}</th>')
        parts.append("</tr></thead><tbody>")
        # "by kind" is a phrase: it may wrap between words, as the first line may
        words = header.index("by kind") if "by kind" in header else -1
        for row in rows:
            cells = [
                f'<td class="words">{e(value)}</td>' if i == words else f"<td>{e(value)}</td>"
                for i, value in enumerate(row[:-1])
            ]
            cells.append(f'<td class="src">{e(row[-1])}</td>')
            parts.append("<tr>" + "".join(cells) + "</tr>")
        parts.append("</tbody></table>")
        if self.total > len(self.records):
            parts.append(
                f'<div class="dim">last {len(self.records)} of {self.total} cells (--all shows every one)</div>'
            )
        parts.append("</div>")
        return "".join(parts)

    def __repr__(self) -> str:
        if not self.records:
            return self._empty_text()
        header, rows = self._columns()
        widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header) - 1)]
        lines = ["  ".join(name.ljust(width) for name, width in zip(header, widths, strict=False)) + "  first line"]
        lines.extend(
            "  ".join(value.ljust(width) for value, width in zip(row, widths, strict=False)) + "  " + row[-1]
            for row in rows
        )
        if self.total > len(self.records):
            lines.append(f"(last {len(self.records)} of {self.total} cells; --all shows every one)")
        return "\n".join(line.rstrip() for line in lines)


def _without_empty(header: list[str], rows: list[list[str]], name: str) -> tuple[list[str], list[list[str]]]:
    """The table without column ``name`` when no row has a value there ("by kind" where no cell's CUDA tensors
    were sorted into kinds: no CUDA device in use, or holders not looked up)."""
    index = header.index(name)
    if any(row[index] for row in rows):
        return header, rows
    return header[:index] + header[index + 1 :], [row[:index] + row[index + 1 :] for row in rows]


def _kinds_column(record: CellRecord) -> str:
    """The largest kind change, and since when if that is before the cell just before this one."""
    brief = kinds_brief(record.kinds, limit=1)
    since = kinds_since_earlier(record) if brief else ""
    return f"{since}: {brief}" if since else brief


def _marks(record: CellRecord) -> str:
    """The kinds of the cell's warnings, and a mark when it has notes (its full report has them)."""
    marks = sorted({warning.kind for warning in record.warnings})
    if record.notes:
        marks.append(f"\u2139 {len(record.notes)} note" + ("s" if len(record.notes) > 1 else ""))
    return ", ".join(marks)


def record_to_dict(record: CellRecord) -> dict[str, Any]:
    """Every field of a measured block's record as JSON-ready data, the execution count as ``cell`` and the
    derived deltas spelled out (:func:`gpumem.core.sessions.session_file.record_from_dict` reads it back)."""
    item: dict[str, Any] = {"cell": record.execution_count, **record._asdict()}
    del item["execution_count"]
    derived = ("allocated_delta_bytes", "reserved_delta_bytes", "peak_above_start_bytes", "used_delta_bytes")
    item["devices"] = [_with(change, derived) for change in record.devices]
    if record.host is not None:
        item["host"] = _with(record.host, ("rss_delta_bytes", "peak_above_start_bytes"))
    item["variables"] = [change._asdict() for change in record.variables]
    item["warnings"] = [warning._asdict() for warning in record.warnings]
    item["kinds"] = [_with(change, ("delta_bytes",)) for change in record.kinds]
    item.update(path=list(record.path), notes=list(record.notes))
    return item


def _with(part: Any, derived: tuple[str, ...]) -> dict[str, Any]:
    """A part of a record (a NamedTuple) as a dict, with the derived figures named."""
    return {**part._asdict(), **{name: getattr(part, name) for name in derived}}


# The flat rows' columns: the record's own, then host and per-device figures (their names in
# record_to_dict's dict, prefixed "host_" and "cuda{i}_").
_RECORD_COLUMNS = (
    "cell",
    "serial",
    "first_line",
    "started_wall_s",
    "duration_s",
    "status",
    "error",
    "mode",
    "keep_peaks",
)
_HOST_FIELDS = ("rss_before_bytes", "rss_after_bytes", "rss_delta_bytes", "peak_rss_bytes", "peak_exact")
_DEVICE_FIELDS = (
    "allocated_before_bytes",
    "allocated_after_bytes",
    "allocated_delta_bytes",
    "reserved_before_bytes",
    "reserved_after_bytes",
    "reserved_delta_bytes",
    "peak_allocated_bytes",
    "peak_above_start_bytes",
    "peak_exact",
    "used_delta_bytes",
)


def history_columns(records: Sequence[CellRecord]) -> list[str]:
    return _columns_for(_devices_in(records))


def _columns_for(devices: Iterable[int]) -> list[str]:
    columns = [*_RECORD_COLUMNS, *(f"host_{name}" for name in _HOST_FIELDS)]
    for device in devices:
        columns += [f"cuda{device}_{name}" for name in _DEVICE_FIELDS]
    return [*columns, "warnings", "variables"]


def history_rows(records: Sequence[CellRecord]) -> list[dict[str, Any]]:
    """One flat dict per cell (per-device figures as ``cuda{i}_*`` columns; None where not measured):
    :func:`record_to_dict`'s figures, flattened.

    ``cell`` is the execution count, as ``In[N]`` and ``%gpumem history`` show it (None for code run without
    one); ``serial`` is the cell's 1-based place among this session's measured cells (``#N`` in the table).
    """
    columns = history_columns(records)
    rows: list[dict[str, Any]] = []
    for record in records:
        item = record_to_dict(record)
        row: dict[str, Any] = dict.fromkeys(columns)
        row.update((name, item[name]) for name in _RECORD_COLUMNS)
        host = item["host"]
        if host is not None:
            row.update((f"host_{name}", host[name]) for name in _HOST_FIELDS)
        for device in item["devices"]:
            row.update((f"cuda{device['device']}_{name}", device[name]) for name in _DEVICE_FIELDS)
        row["warnings"] = " | ".join(warning["message"] for warning in item["warnings"])
        row["variables"] = ", ".join(f"{change['name']}={change['nbytes']}" for change in item["variables"])
        rows.append(row)
    return rows


def history_dataframe(records: Sequence[CellRecord]) -> Any:
    """The history as a pandas DataFrame (pandas is imported here, not before)."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("gpumem.history() needs pandas: pip install pandas") from None
    columns = history_columns(records)
    frame = pd.DataFrame(history_rows(records), columns=columns)
    for column in columns:
        if column.endswith("_bytes") or column in ("cell", "serial"):
            frame[column] = frame[column].astype("Int64")
        elif column.endswith("_exact") or column == "keep_peaks":
            frame[column] = frame[column].astype("boolean")
    frame.insert(3, "started", pd.to_datetime(frame["started_wall_s"], unit="s", utc=True))
    return frame.drop(columns=["started_wall_s"])


# The JSON export is one object with this key (its value: the format's version) above the cells, so
# that an existing file can be told apart from any other JSON before it is replaced.
JSON_MARKER = "gpumem_history"
JSON_VERSION = 1
_DEVICE_COLUMN = re.compile(r"cuda([0-9]{1,9})_(?:" + "|".join(_DEVICE_FIELDS) + ")", re.ASCII)


def write_json(records: Sequence[CellRecord], path: str | os.PathLike[str], *, force: bool = False) -> bool:
    """``{"gpumem_history": 1, "cells": [...]}`` to ``path``, atomically; True when it replaced a file.

    An existing file that is not such an export raises :class:`~gpumem.core.atomic_files.ForeignFileError`
    unless ``force``. Non-ASCII text is escaped (``\\ud800`` for a lone surrogate): the file is ASCII.
    """

    def write(handle: TextIO) -> None:
        cells = [record_to_dict(record) for record in records]
        json.dump({JSON_MARKER: JSON_VERSION, "cells": cells}, handle, indent=1)
        handle.write("\n")

    return replace_file(path, write, recognise=is_json_export, force=force)


def write_csv(records: Sequence[CellRecord], path: str | os.PathLike[str], *, force: bool = False) -> bool:
    """One row per cell to ``path``, atomically; True when it replaced a file.

    An existing file whose first line is not a history header raises
    :class:`~gpumem.core.atomic_files.ForeignFileError` unless ``force``. A character UTF-8 cannot encode (a
    lone surrogate) is written as its backslash escape, so the file stays valid UTF-8.
    """

    def write(handle: TextIO) -> None:
        writer = csv.DictWriter(handle, fieldnames=history_columns(records))
        writer.writeheader()
        for row in history_rows(records):
            writer.writerow({key: "" if value is None else value for key, value in row.items()})

    return replace_file(path, write, recognise=is_csv_export, force=force, newline="")


def is_csv_export(start: bytes) -> bool:
    """Whether a file starting with ``start`` is a history CSV: its header is exactly our columns."""
    first = start.split(b"\n", 1)[0].rstrip(b"\r").decode("utf-8", errors="replace")
    names = next(csv.reader([first]), [])
    devices = sorted({int(match.group(1)) for match in map(_DEVICE_COLUMN.fullmatch, names) if match})
    return names == _columns_for(devices)


def is_json_export(start: bytes) -> bool:
    """Whether a file starting with ``start`` is a history JSON export: an object whose first key is the marker."""
    text = start.decode("utf-8", errors="replace").lstrip()
    return re.match(r'\{\s*"' + JSON_MARKER + r'"\s*:', text) is not None
