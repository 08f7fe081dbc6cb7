"""Cell records as text, HTML, table rows and files.

Objects here carry both ``_repr_html_`` and ``__repr__``: notebooks show the HTML, terminal IPython
the text. Every string that comes from user code (cell source, variable names, errors) is escaped.
"""

from __future__ import annotations

import csv
import html
import json
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from gpumem.core.cells import CellRecord, DeviceChange, HostChange, VariableChange
from gpumem.core.units import format_bytes, format_delta

__all__ = [
    "CellReport",
    "CellSummary",
    "HistoryTable",
    "format_duration",
    "history_dataframe",
    "history_rows",
    "record_to_dict",
    "write_csv",
    "write_json",
]

_WARN = "\u26a0"
_ARROW = "\u2192"

_STYLE = (
    "<style>"
    ".gpumem-report{font-family:var(--jp-ui-font-family,sans-serif);font-size:12px;line-height:1.4;margin:2px 0}"
    ".gpumem-report table{border-collapse:collapse;margin:2px 0}"
    ".gpumem-report th,.gpumem-report td{padding:1px 8px;text-align:right;border:none;white-space:nowrap}"
    ".gpumem-report th:first-child,.gpumem-report td:first-child{text-align:left}"
    ".gpumem-report td.src{text-align:left;font-family:var(--jp-code-font-family,monospace)}"
    ".gpumem-report th.src{text-align:left}"
    ".gpumem-report thead th{border-bottom:1px solid var(--jp-border-color2,#ccc);font-weight:600}"
    ".gpumem-report .up{color:var(--jp-error-color1,#c62828)}"
    ".gpumem-report .down{color:var(--jp-success-color1,#2e7d32)}"
    ".gpumem-report .dim{color:var(--jp-ui-font-color2,#777)}"
    ".gpumem-report .warn{color:var(--jp-warn-color0,#b26a00);margin:1px 0}"
    ".gpumem-report code{font-size:11px}"
    "</style>"
)


def format_duration(seconds: float) -> str:
    """``0.0004 -> '0.4 ms'``, ``1.234 -> '1.23 s'``, ``125 -> '2 min 5 s'``."""
    if seconds < 1:
        return f"{seconds * 1000:.1f} ms" if seconds < 0.1 else f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.2f} s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {rest} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def _cell_label(record: CellRecord) -> str:
    count = record.execution_count
    return f"[{count}]" if count is not None else f"#{record.serial}"


def _at_least(delta: int, space: str = " ") -> str:
    """A sampled peak above the start, a lower bound: ``'≥ +1.0 GiB'``, and ``'≥ 0 B'`` rather than ``'≥ ±0 B'``."""
    return f"\u2265{space}{format_delta(delta) if delta else '0 B'}"


def _peak_text(change: DeviceChange) -> str:
    if change.peak_exact:
        return f"{format_delta(change.peak_above_start_bytes)} ({format_bytes(change.peak_allocated_bytes)}, exact)"
    above = _at_least(change.peak_above_start_bytes)
    return f"{above} ({format_bytes(change.peak_allocated_bytes)}, sampled lower bound)"


def _host_peak_text(host: HostChange) -> str:
    if host.peak_exact:
        return f"{format_delta(host.peak_above_start_bytes)} ({format_bytes(host.peak_rss_bytes)}, exact)"
    return f"{_at_least(host.peak_above_start_bytes)} ({format_bytes(host.peak_rss_bytes)}, sampled lower bound)"


def _span(before: int, after: int) -> str:
    return f"{format_bytes(before)} {_ARROW} {format_bytes(after)} ({format_delta(after - before)})"


def _used_text(change: DeviceChange) -> str:
    if change.used_before_bytes is None or change.used_after_bytes is None:
        return "n/a (NVML unavailable)"
    return _span(change.used_before_bytes, change.used_after_bytes) + "  [NVML, all processes]"


def _variable_status(change: VariableChange) -> str:
    if change.previous_bytes is None:
        return "new"
    return f"{format_delta(change.grown_bytes)}"


def _headline(record: CellRecord) -> str:
    status = record.status if record.error is None else f"{record.status}: {record.error}"
    return f"gpumem {_cell_label(record)} {_first_line(record)}  {format_duration(record.duration_s)}  {status}"


def _first_line(record: CellRecord) -> str:
    return record.first_line or "(empty cell)"


def _record_text(record: CellRecord, top: int) -> str:
    lines = [_headline(record)]
    if record.keep_peaks:
        lines.append("  (peak counters kept: CUDA peaks are exact only where the counter rose in this cell)")
    if record.cuda_note:
        lines.append(f"  {record.cuda_note}")
    for change in record.devices:
        name = f"cuda:{change.device}"
        init = " (CUDA initialized in this cell)" if change.initialized_in_cell else ""
        lines.append(
            f"  {name:<8} allocated    {_span(change.allocated_before_bytes, change.allocated_after_bytes)}{init}"
        )
        lines.append(f"  {'':<8} reserved     {_span(change.reserved_before_bytes, change.reserved_after_bytes)}")
        lines.append(f"  {'':<8} peak         {_peak_text(change)}")
        lines.append(f"  {'':<8} device used  {_used_text(change)}")
    if record.host is not None:
        host = record.host
        lines.append(f"  {'host':<8} RSS          {_span(host.rss_before_bytes, host.rss_after_bytes)}")
        lines.append(f"  {'':<8} peak         {_host_peak_text(host)}")
    else:
        lines.append("  host     unavailable (see %gpumem status)")
    if record.variables:
        lines.append(f"  variables holding GPU memory, {record.variables_note}:")
        shown = record.variables[:top]
        width = max(len(variable.name) for variable in shown)
        type_width = max(len(variable.type_name) for variable in shown)
        device_width = max(len(variable.device) for variable in shown)
        for variable in shown:
            lines.append(
                f"    {variable.name:<{width}}  {variable.type_name:<{type_width}}  {variable.device:<{device_width}}  "
                f"{format_bytes(variable.nbytes):>10}  {_variable_status(variable)}"
            )
        if len(record.variables) > top:
            lines.append(f"    ... and {len(record.variables) - top} more")
    elif record.devices and record.variables_note:
        lines.append(f"  variables: {record.variables_note}")
    for warning in record.warnings:
        lines.append(f"  {_WARN} {warning.message}")
    return "\n".join(lines)


def _delta_class(delta: int | None) -> str:
    if not delta:
        return ""
    return "up" if delta > 0 else "down"


def _html_span(before: int, after: int) -> str:
    delta = after - before
    return (
        f"{html.escape(format_bytes(before))} {_ARROW} {html.escape(format_bytes(after))} "
        f'<span class="{_delta_class(delta)}">({html.escape(format_delta(delta))})</span>'
    )


def _record_html(record: CellRecord, top: int) -> str:
    e = html.escape
    parts = [_STYLE, '<div class="gpumem-report">']
    status = e(record.status)
    if record.error:
        status += f": {e(record.error)}"
    parts.append(
        f"<div><b>gpumem</b> {e(_cell_label(record))} <code>{e(_first_line(record))}</code> "
        f'<span class="dim">{e(format_duration(record.duration_s))} \u00b7 {status}</span></div>'
    )
    if record.cuda_note:
        parts.append(f'<div class="dim">{e(record.cuda_note)}</div>')
    parts.append("<table><thead><tr><th></th><th>allocated</th><th>reserved</th>")
    parts.append('<th>peak above start</th><th title="NVML: whole device, all processes">device used</th>')
    parts.append("</tr></thead><tbody>")
    for change in record.devices:
        if change.peak_exact:
            peak = e(format_delta(change.peak_above_start_bytes))
            peak_cell = f'<td title="{e(format_bytes(change.peak_allocated_bytes))}, exact">{peak}</td>'
        else:
            note = e(change.peak_note or "sampled lower bound")
            peak = e(_at_least(change.peak_above_start_bytes))
            peak_cell = f'<td title="{note}">{peak} <span class="dim">(sampled)</span></td>'
        if change.used_before_bytes is None or change.used_after_bytes is None:
            used = '<span class="dim">n/a</span>'
        else:
            used = _html_span(change.used_before_bytes, change.used_after_bytes)
        init = ' <span class="dim">(new)</span>' if change.initialized_in_cell else ""
        parts.append(
            f"<tr><td>cuda:{change.device}{init}</td>"
            f"<td>{_html_span(change.allocated_before_bytes, change.allocated_after_bytes)}</td>"
            f"<td>{_html_span(change.reserved_before_bytes, change.reserved_after_bytes)}</td>"
            f"{peak_cell}<td>{used}</td></tr>"
        )
    if record.host is not None:
        host = record.host
        if host.peak_exact:
            peak_cell = e(format_delta(host.peak_above_start_bytes))
        else:
            peak_cell = f'{e(_at_least(host.peak_above_start_bytes))} <span class="dim">(sampled)</span>'
        parts.append(
            f"<tr><td>host RSS</td><td>{_html_span(host.rss_before_bytes, host.rss_after_bytes)}</td>"
            f'<td class="dim">-</td><td>{peak_cell}</td><td class="dim">-</td></tr>'
        )
    else:
        parts.append('<tr><td>host</td><td colspan="4" class="dim">unavailable (see %gpumem status)</td></tr>')
    parts.append("</tbody></table>")
    if record.variables:
        parts.append(f'<div class="dim">variables holding GPU memory, {e(record.variables_note)}</div>')
        parts.append("<table><thead><tr><th>name</th><th>type</th><th>device</th><th>bytes</th><th></th></tr>")
        parts.append("</thead><tbody>")
        for variable in record.variables[:top]:
            parts.append(
                f'<tr><td class="src">{e(variable.name)}</td><td>{e(variable.type_name)}</td>'
                f"<td>{e(variable.device)}</td><td>{e(format_bytes(variable.nbytes))}</td>"
                f"<td>{e(_variable_status(variable))}</td></tr>"
            )
        parts.append("</tbody></table>")
        if len(record.variables) > top:
            parts.append(f'<div class="dim">... and {len(record.variables) - top} more</div>')
    elif record.devices and record.variables_note:
        parts.append(f'<div class="dim">variables: {e(record.variables_note)}</div>')
    for warning in record.warnings:
        parts.append(f'<div class="warn">{_WARN} {_code_spans(warning.message)}</div>')
    parts.append("</div>")
    return "".join(parts)


def _code_spans(text: str) -> str:
    """Escape ``text`` and render its `backquoted` parts as code."""
    pieces = text.split("`")
    out: list[str] = []
    for i, piece in enumerate(pieces):
        escaped = html.escape(piece)
        out.append(f"<code>{escaped}</code>" if i % 2 == 1 and i < len(pieces) - 1 else escaped)
    return "".join(out)


def _summary_text(record: CellRecord) -> str:
    parts: list[str] = []
    changed = [
        c for c in record.devices if c.allocated_delta_bytes or c.reserved_delta_bytes or c.peak_above_start_bytes
    ]
    for change in changed or record.devices[:1]:
        delta = change.peak_above_start_bytes
        peak = format_delta(delta) if change.peak_exact else _at_least(delta, "")
        parts.append(
            f"cuda:{change.device} allocated {format_delta(change.allocated_delta_bytes)} (peak {peak}), "
            f"reserved {format_delta(change.reserved_delta_bytes)}"
        )
    if record.host is not None:
        parts.append(f"host {format_delta(record.host.rss_delta_bytes)}")
    figures = "; ".join(parts) or "no memory figures (see %gpumem status)"
    line = f"gpumem {_cell_label(record)} {format_duration(record.duration_s)}: {figures}"
    if record.status != "ok":
        line += f" [{record.status}]"
    if record.warnings:
        others = record.warnings[1:]
        more = f" (+{len(others)} more: {', '.join(w.kind for w in others)})" if others else ""
        line += f" {_WARN} {record.warnings[0].message}{more}"
    return line


class CellReport:
    """The full report of one cell: HTML in notebooks, text in terminals."""

    def __init__(self, record: CellRecord, top: int = 5) -> None:
        self.record = record
        self.top = top

    def _repr_html_(self) -> str:
        return _record_html(self.record, self.top)

    def __repr__(self) -> str:
        return _record_text(self.record, self.top)


class CellSummary:
    """One line under an automatically measured cell."""

    def __init__(self, record: CellRecord) -> None:
        self.record = record

    def _repr_html_(self) -> str:
        return f'{_STYLE}<div class="gpumem-report">{_code_spans(_summary_text(self.record))}</div>'

    def __repr__(self) -> str:
        return _summary_text(self.record)


# History ------------------------------------------------------------------------------------------


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
        header += ["host \u0394", "warnings", "first line"]
        rows: list[list[str]] = []
        for record in self.records:
            row = [
                _cell_label(record),
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
                    delta = change.peak_above_start_bytes
                    row += [
                        format_delta(change.allocated_delta_bytes),
                        format_delta(delta) if change.peak_exact else _at_least(delta, ""),
                    ]
            row.append(format_delta(record.host.rss_delta_bytes) if record.host is not None else "n/a")
            row.append(", ".join(sorted({w.kind for w in record.warnings})) or "")
            row.append(record.first_line)
            rows.append(row)
        return header, rows

    def _empty_text(self) -> str:
        return f"None of the {self.total} measured cells shown." if self.total else "No measured cells yet."

    def _repr_html_(self) -> str:
        if not self.records:
            return f'<div class="gpumem-report">{self._empty_text()}</div>'
        header, rows = self._columns()
        e = html.escape
        parts = [_STYLE, '<div class="gpumem-report"><table><thead><tr>']
        parts += [f"<th>{e(name)}</th>" for name in header[:-1]]
        parts.append(f'<th class="src">{e(header[-1])}</th>')
        parts.append("</tr></thead><tbody>")
        for row in rows:
            cells = [f"<td>{e(value)}</td>" for value in row[:-1]]
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
        for row in rows:
            lines.append(
                "  ".join(value.ljust(width) for value, width in zip(row, widths, strict=False)) + "  " + row[-1]
            )
        if self.total > len(self.records):
            lines.append(f"(last {len(self.records)} of {self.total} cells; --all shows every one)")
        return "\n".join(line.rstrip() for line in lines)


def record_to_dict(record: CellRecord) -> dict[str, Any]:
    """A JSON-ready nested dict, with the derived deltas spelled out."""
    devices = []
    for change in record.devices:
        item: dict[str, Any] = change._asdict()
        item.update(
            allocated_delta_bytes=change.allocated_delta_bytes,
            reserved_delta_bytes=change.reserved_delta_bytes,
            peak_above_start_bytes=change.peak_above_start_bytes,
            used_delta_bytes=change.used_delta_bytes,
        )
        devices.append(item)
    host: dict[str, Any] | None = None
    if record.host is not None:
        host = record.host._asdict()
        host.update(
            rss_delta_bytes=record.host.rss_delta_bytes,
            peak_above_start_bytes=record.host.peak_above_start_bytes,
        )
    return {
        "serial": record.serial,
        "execution_count": record.execution_count,
        "first_line": record.first_line,
        "source_hash": record.source_hash,
        "started_wall_s": record.started_wall_s,
        "duration_s": record.duration_s,
        "status": record.status,
        "error": record.error,
        "mode": record.mode,
        "keep_peaks": record.keep_peaks,
        "devices": devices,
        "host": host,
        "variables": [change._asdict() for change in record.variables],
        "variables_note": record.variables_note,
        "warnings": [warning._asdict() for warning in record.warnings],
        "cuda_note": record.cuda_note,
    }


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
    columns = [
        "cell",
        "execution_count",
        "first_line",
        "started_wall_s",
        "duration_s",
        "status",
        "error",
        "mode",
        "keep_peaks",
        "host_rss_before_bytes",
        "host_rss_after_bytes",
        "host_rss_delta_bytes",
        "host_peak_rss_bytes",
        "host_peak_exact",
    ]
    for device in _devices_in(records):
        columns += [f"cuda{device}_{name}" for name in _DEVICE_FIELDS]
    return [*columns, "warnings", "variables"]


def history_rows(records: Sequence[CellRecord]) -> list[dict[str, Any]]:
    """One flat dict per cell (per-device figures as ``cuda{i}_*`` columns; None where not measured)."""
    columns = history_columns(records)
    rows: list[dict[str, Any]] = []
    for record in records:
        row: dict[str, Any] = dict.fromkeys(columns)
        host = record.host
        row.update(
            cell=record.serial,
            execution_count=record.execution_count,
            first_line=record.first_line,
            started_wall_s=record.started_wall_s,
            duration_s=record.duration_s,
            status=record.status,
            error=record.error,
            mode=record.mode,
            keep_peaks=record.keep_peaks,
            warnings=" | ".join(warning.message for warning in record.warnings),
            variables=", ".join(f"{change.name}={change.nbytes}" for change in record.variables),
        )
        if host is not None:
            row.update(
                host_rss_before_bytes=host.rss_before_bytes,
                host_rss_after_bytes=host.rss_after_bytes,
                host_rss_delta_bytes=host.rss_delta_bytes,
                host_peak_rss_bytes=host.peak_rss_bytes,
                host_peak_exact=host.peak_exact,
            )
        for change in record.devices:
            for name in _DEVICE_FIELDS:
                row[f"cuda{change.device}_{name}"] = getattr(change, name)
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
        if column.endswith("_bytes") or column in ("cell", "execution_count"):
            frame[column] = frame[column].astype("Int64")
        elif column.endswith("_exact") or column == "keep_peaks":
            frame[column] = frame[column].astype("boolean")
    frame.insert(3, "started", pd.to_datetime(frame["started_wall_s"], unit="s", utc=True))
    return frame.drop(columns=["started_wall_s"])


def write_json(records: Sequence[CellRecord], path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump([record_to_dict(record) for record in records], handle, indent=1)
        handle.write("\n")


def write_csv(records: Sequence[CellRecord], path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=history_columns(records))
        writer.writeheader()
        for row in history_rows(records):
            writer.writerow({key: "" if value is None else value for key, value in row.items()})
