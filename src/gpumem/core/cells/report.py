"""Cell records as text and HTML: the full report of a ``%%gpumem`` cell and the one-line summary.

Objects here carry both ``_repr_html_`` and ``__repr__``: notebooks show the HTML, terminal IPython
the text. Every string that comes from user code (cell source, variable names, errors) is escaped.
The history table and its files live in :mod:`gpumem.core.cells.history`; their names are
re-exported here, where they were first defined.
"""

from __future__ import annotations

import html

from gpumem.core.cells.formatting import STYLE, at_least, cell_label, format_duration
from gpumem.core.cells.history import (
    HistoryTable,
    history_columns,
    history_dataframe,
    history_rows,
    record_to_dict,
    write_csv,
    write_json,
)
from gpumem.core.cells.kinds import kinds_brief, kinds_line, kinds_since_earlier
from gpumem.core.cells.record import CellRecord, DeviceChange, HostChange, VariableChange
from gpumem.core.cuda_fault import FROZEN_PREFIX
from gpumem.core.device_split import device_split_text, split_of
from gpumem.core.units import format_bytes, format_delta

__all__ = [
    "CellReport",
    "CellSummary",
    "HistoryTable",
    "format_duration",
    "history_columns",
    "history_dataframe",
    "history_rows",
    "record_to_dict",
    "write_csv",
    "write_json",
]

_WARN = "\u26a0"
_ARROW = "\u2192"
_INFO = "\u2139"


def _peak_text(change: DeviceChange) -> str:
    if change.peak_exact:
        return f"{format_delta(change.peak_above_start_bytes)} ({format_bytes(change.peak_allocated_bytes)}, exact)"
    above = at_least(change.peak_above_start_bytes)
    return f"{above} ({format_bytes(change.peak_allocated_bytes)}, sampled lower bound)"


def _host_peak_text(host: HostChange) -> str:
    if host.peak_exact:
        return f"{format_delta(host.peak_above_start_bytes)} ({format_bytes(host.peak_rss_bytes)}, exact)"
    return f"{at_least(host.peak_above_start_bytes)} ({format_bytes(host.peak_rss_bytes)}, sampled lower bound)"


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
    return f"gpumem {cell_label(record)} {_first_line(record)}  {format_duration(record.duration_s)}  {status}"


def _first_line(record: CellRecord) -> str:
    """The cell's first line with its padding (spaces lining up a comment) closed up, for the header."""
    return " ".join(record.first_line.split()) or "(empty cell)"


def _record_text(record: CellRecord, top: int) -> str:
    lines = [_headline(record)]
    if record.keep_peaks:
        lines.append("  (peak counters kept: CUDA peaks are exact only where the counter rose in this cell)")
    if record.cuda_note:
        lines.append(f"  {record.cuda_note}")
    for change in record.devices:
        lines += _device_lines(change)
    lines += _host_lines(record.host)
    if record.variables:
        lines += _variable_lines(record, top)
    elif record.devices and record.variables_note:
        lines.append(f"  variables: {record.variables_note}")
    by_kind = kinds_line(record.kinds, record.kinds_since)
    if by_kind:
        lines.append(f"  {by_kind}")
    lines.extend(f"  {_WARN} {warning.message}" for warning in record.warnings)
    lines.extend(f"  {_INFO} {note}" for note in record.notes)
    return "\n".join(lines)


def _device_lines(change: DeviceChange) -> list[str]:
    name = f"cuda:{change.device}"
    init = " (CUDA initialized in this cell)" if change.initialized_in_cell else ""
    return [
        f"  {name:<8} allocated    {_span(change.allocated_before_bytes, change.allocated_after_bytes)}{init}",
        f"  {'':<8} reserved     {_span(change.reserved_before_bytes, change.reserved_after_bytes)}",
        f"  {'':<8} peak         {_peak_text(change)}",
        f"  {'':<8} device used  {_used_text(change)}",
        *_split_lines(change),
    ]


def _split_lines(change: DeviceChange) -> list[str]:
    """How NVML's "device used" divides at the end of the cell (only when NVML's per-process figure is known)."""
    if change.used_after_bytes is None or change.process_used_after_bytes is None:
        return []
    split = split_of(
        change.device, change.used_after_bytes, change.reserved_after_bytes, change.process_used_after_bytes
    )
    return [f"  {'':<8}              {device_split_text(split)}"]


def _host_lines(host: HostChange | None) -> list[str]:
    if host is None:
        return ["  host     unavailable (see %gpumem status)"]
    return [
        f"  {'host':<8} RSS          {_span(host.rss_before_bytes, host.rss_after_bytes)}",
        f"  {'':<8} peak         {_host_peak_text(host)}",
    ]


def _variable_lines(record: CellRecord, top: int) -> list[str]:
    lines = [f"  variables holding GPU memory, {record.variables_note}:"]
    shown = record.variables[:top]
    width = max(len(variable.name) for variable in shown)
    type_width = max(len(variable.type_name) for variable in shown)
    device_width = max(len(variable.device) for variable in shown)
    lines.extend(
        f"    {variable.name:<{width}}  {variable.type_name:<{type_width}}  {variable.device:<{device_width}}  "
        f"{format_bytes(variable.nbytes):>10}  {_variable_status(variable)}"
        for variable in shown
    )
    if len(record.variables) > top:
        lines.append(f"    ... and {len(record.variables) - top} more")
    return lines


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
    parts = [STYLE, '<div class="gpumem-report">']
    status = e(record.status)
    if record.error:
        status += f": {e(record.error)}"
    parts.append(
        f"<div><b>gpumem</b> {e(cell_label(record))} <code>{e(_first_line(record))}</code> "
        f'<span class="dim">{e(format_duration(record.duration_s))} \u00b7 {status}</span></div>'
    )
    if record.cuda_note:
        parts.append(f'<div class="dim">{e(record.cuda_note)}</div>')
    if record.devices:
        parts.append("<table><thead><tr><th></th><th>allocated</th><th>reserved</th>")
        parts.append('<th>peak above start</th><th title="NVML: whole device, all processes">device used</th>')
        parts.append("</tr></thead><tbody>")
        parts.extend(_device_row_html(change) for change in record.devices)
        parts.append("</tbody></table>")
    parts.append(_host_table_html(record.host))
    if record.variables:
        parts += _variables_html(record, top)
    elif record.devices and record.variables_note:
        parts.append(f'<div class="dim">variables: {e(record.variables_note)}</div>')
    by_kind = kinds_line(record.kinds, record.kinds_since)
    if by_kind:
        parts.append(f'<div class="kinds">{e(by_kind)}</div>')
    parts.extend(f'<div class="warn">{_WARN} {_code_spans(warning.message)}</div>' for warning in record.warnings)
    parts.extend(f'<div class="note">{_INFO} {_code_spans(note)}</div>' for note in record.notes)
    parts.append("</div>")
    return "".join(parts)


def _device_row_html(change: DeviceChange) -> str:
    e = html.escape
    if change.peak_exact:
        peak = e(format_delta(change.peak_above_start_bytes))
        peak_cell = f'<td title="{e(format_bytes(change.peak_allocated_bytes))}, exact">{peak}</td>'
    else:
        note = e(change.peak_note or "sampled lower bound")
        peak = e(at_least(change.peak_above_start_bytes))
        peak_cell = f'<td title="{note}">{peak} <span class="dim">(sampled)</span></td>'
    if change.used_before_bytes is None or change.used_after_bytes is None:
        used = '<span class="dim">n/a</span>'
    else:
        used = _html_span(change.used_before_bytes, change.used_after_bytes)
    init = ' <span class="dim">(new)</span>' if change.initialized_in_cell else ""
    return (
        f"<tr><td>cuda:{change.device}{init}</td>"
        f"<td>{_html_span(change.allocated_before_bytes, change.allocated_after_bytes)}</td>"
        f"<td>{_html_span(change.reserved_before_bytes, change.reserved_after_bytes)}</td>"
        f"{peak_cell}<td>{used}</td></tr>"
        + "".join(
            f'<tr><td></td><td colspan="4" class="dim">{e(line.strip())}</td></tr>' for line in _split_lines(change)
        )
    )


def _host_table_html(host: HostChange | None) -> str:
    """Host memory under its own heading: RSS is not PyTorch's allocated memory, nor a device's."""
    head = "<table><thead><tr><th></th><th>host RSS</th><th>peak above start</th></tr></thead><tbody>"
    if host is None:
        missing = '<td colspan="2" class="dim">unavailable (see %gpumem status)</td>'
        return f"{head}<tr><td></td>{missing}</tr></tbody></table>"
    if host.peak_exact:
        peak_cell = html.escape(format_delta(host.peak_above_start_bytes))
    else:
        peak_cell = f'{html.escape(at_least(host.peak_above_start_bytes))} <span class="dim">(sampled)</span>'
    return (
        f"{head}<tr><td>this process</td><td>{_html_span(host.rss_before_bytes, host.rss_after_bytes)}</td>"
        f"<td>{peak_cell}</td></tr></tbody></table>"
    )


def _variables_html(record: CellRecord, top: int) -> list[str]:
    e = html.escape
    parts = [
        f'<div class="dim">variables holding GPU memory, {e(record.variables_note)}</div>',
        "<table><thead><tr><th>name</th><th>type</th><th>device</th><th>bytes</th><th></th></tr>",
        "</thead><tbody>",
    ]
    parts.extend(
        f'<tr><td class="src">{e(variable.name)}</td><td>{e(variable.type_name)}</td>'
        f"<td>{e(variable.device)}</td><td>{e(format_bytes(variable.nbytes))}</td>"
        f"<td>{e(_variable_status(variable))}</td></tr>"
        for variable in record.variables[:top]
    )
    parts.append("</tbody></table>")
    if len(record.variables) > top:
        parts.append(f'<div class="dim">... and {len(record.variables) - top} more</div>')
    return parts


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
        peak = format_delta(delta) if change.peak_exact else at_least(delta, "")
        parts.append(
            f"cuda:{change.device} allocated {format_delta(change.allocated_delta_bytes)} (peak {peak}), "
            f"reserved {format_delta(change.reserved_delta_bytes)}"
        )
    if record.cuda_note and record.cuda_note.startswith(FROZEN_PREFIX):  # not ±0 B: unknown since a CUDA error
        parts.append(record.cuda_note.split(" (", 1)[0])
    if record.host is not None:
        parts.append(f"host {format_delta(record.host.rss_delta_bytes)}")
    by_kind = kinds_brief(record.kinds)
    if by_kind:
        since = kinds_since_earlier(record)
        parts.append(f"by kind ({since}): {by_kind}" if since else f"by kind {by_kind}")
    figures = "; ".join(parts) or "no memory figures (see %gpumem status)"
    line = f"gpumem {cell_label(record)} {format_duration(record.duration_s)}: {figures}"
    if record.status != "ok":
        line += f" [{record.status}]"
    if record.warnings:
        others = record.warnings[1:]
        more = f" (+{len(others)} more: {', '.join(w.kind for w in others)})" if others else ""
        line += f" {_WARN} {record.warnings[0].message}{more}"
    elif record.notes:  # information, kept to its first clause: the full report has the rest
        more = f" (+{len(record.notes) - 1} more)" if len(record.notes) > 1 else ""
        line += f" {_INFO} {record.notes[0].split(';', 1)[0]}{more}"
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
        return f'{STYLE}<div class="gpumem-report">{_code_spans(_summary_text(self.record))}</div>'

    def __repr__(self) -> str:
        return _summary_text(self.record)
