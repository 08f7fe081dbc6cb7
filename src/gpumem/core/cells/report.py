"""Cell records as text and HTML: the full report of a ``%%gpumem`` cell and the one-line summary.

Objects here carry both ``_repr_html_`` and ``__repr__``: notebooks show the HTML, terminal IPython
the text. Every string that comes from user code (cell source, variable names, errors) is escaped.
The history table and its files live in :mod:`gpumem.core.cells.history`; their names are
re-exported here, where they were first defined.
"""

from __future__ import annotations

import html

from gpumem.core.cells.formatting import STYLE, cell_label, format_duration, peak_above
from gpumem.core.cells.history import (
    HistoryTable,
    history_columns,
    history_dataframe,
    history_rows,
    record_to_dict,
    write_csv,
    write_json,
)
from gpumem.core.cells.kind_changes import kinds_brief, kinds_line, kinds_since_earlier
from gpumem.core.cells.record import CellRecord, DeviceChange, HostChange, VariableChange
from gpumem.core.diagnoses.device_split import device_split_text, split_of
from gpumem.core.readers.cuda_fault import FROZEN_PREFIX
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


_KEEP_PEAKS = "(peak counters kept: CUDA peaks are exact only where the counter rose in this cell)"


def _parts(record: CellRecord) -> list[tuple[str, str]]:
    """What a cell's report says below its headline, in order, decided once for the text and the HTML:
    (kind, text) with kind "dim", "devices", "host", "variables", "kinds", "warn" or "note"."""
    parts = [("dim", text) for text in (_KEEP_PEAKS if record.keep_peaks else "", record.cuda_note) if text]
    if record.devices:
        parts.append(("devices", ""))
    parts.append(("host", ""))
    if record.variables:
        parts.append(("variables", ""))
    elif record.devices and record.variables_note:
        parts.append(("dim", f"variables: {record.variables_note}"))
    by_kind = kinds_line(record.kinds, record.kinds_since)
    if by_kind:
        parts.append(("kinds", by_kind))
    parts.extend(("warn", warning.message) for warning in record.warnings)
    parts.extend(("note", note) for note in record.notes)
    return parts


def _peak_of(change: DeviceChange | HostChange) -> tuple[int, int, bool, str]:
    """A peak above the start, its absolute value, whether it is exact and why not."""
    if isinstance(change, HostChange):
        return change.peak_above_start_bytes, change.peak_rss_bytes, change.peak_exact, ""
    return change.peak_above_start_bytes, change.peak_allocated_bytes, change.peak_exact, change.peak_note


def _peak_text(change: DeviceChange | HostChange) -> str:
    above, absolute, exact, _note = _peak_of(change)
    return f"{peak_above(above, exact)} ({format_bytes(absolute)}, {'exact' if exact else 'sampled lower bound'})"


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


_TEXT_MARKS = {"dim": "", "kinds": "", "warn": f"{_WARN} ", "note": f"{_INFO} "}


def _record_text(record: CellRecord, top: int) -> str:
    lines = [_headline(record)]
    for kind, text in _parts(record):
        if kind == "devices":
            for change in record.devices:
                lines += _device_lines(change)
        elif kind == "host":
            lines += _host_lines(record.host)
        elif kind == "variables":
            lines += _variable_lines(record, top)
        else:
            lines.append(f"  {_TEXT_MARKS[kind]}{text}")
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
        change.device,
        change.used_after_bytes,
        change.reserved_after_bytes,
        change.process_used_after_bytes,
        change.driver_reserved_after_bytes,
        change.others_used_after_bytes,
    )
    return [f"  {'':<8}              {device_split_text(split)}"]


def _host_lines(host: HostChange | None) -> list[str]:
    if host is None:
        return ["  host     unavailable (see %gpumem status)"]
    return [
        f"  {'host':<8} RSS          {_span(host.rss_before_bytes, host.rss_after_bytes)}",
        f"  {'':<8} peak         {_peak_text(host)}",
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
    for kind, text in _parts(record):
        if kind == "devices":
            parts.append("<table><thead><tr><th></th><th>allocated</th><th>reserved</th>")
            parts.append('<th>peak above start</th><th title="NVML: whole device, all processes">device used</th>')
            parts.append("</tr></thead><tbody>")
            parts.extend(_device_row_html(change) for change in record.devices)
            parts.append("</tbody></table>")
        elif kind == "host":
            parts.append(_host_table_html(record.host))
        elif kind == "variables":
            parts += _variables_html(record, top)
        elif kind in ("warn", "note"):
            mark = _WARN if kind == "warn" else _INFO
            parts.append(f'<div class="{kind}">{mark} {_code_spans(text)}</div>')
        else:
            parts.append(f'<div class="{kind}">{e(text)}</div>')
    parts.append("</div>")
    return "".join(parts)


def _peak_cell_html(change: DeviceChange | HostChange) -> str:
    e = html.escape
    above, absolute, exact, note = _peak_of(change)
    if exact:
        return f'<td title="{e(format_bytes(absolute))}, exact">{e(peak_above(above, exact))}</td>'
    bound = f'{e(peak_above(above, exact))} <span class="dim">(sampled)</span>'
    return f'<td title="{e(note or "sampled lower bound")}">{bound}</td>'


def _device_row_html(change: DeviceChange) -> str:
    e = html.escape
    if change.used_before_bytes is None or change.used_after_bytes is None:
        used = '<span class="dim">n/a</span>'
    else:
        used = _html_span(change.used_before_bytes, change.used_after_bytes)
    init = ' <span class="dim">(new)</span>' if change.initialized_in_cell else ""
    return (
        f"<tr><td>cuda:{change.device}{init}</td>"
        f"<td>{_html_span(change.allocated_before_bytes, change.allocated_after_bytes)}</td>"
        f"<td>{_html_span(change.reserved_before_bytes, change.reserved_after_bytes)}</td>"
        f"{_peak_cell_html(change)}<td>{used}</td></tr>"
        + "".join(
            f'<tr><td></td><td colspan="4" class="dim words">{e(line.strip())}</td></tr>'
            for line in _split_lines(change)
        )
    )


def _host_table_html(host: HostChange | None) -> str:
    """Host memory under its own heading: RSS is not PyTorch's allocated memory, nor a device's."""
    head = "<table><thead><tr><th></th><th>host RSS</th><th>peak above start</th></tr></thead><tbody>"
    if host is None:
        missing = '<td colspan="2" class="dim">unavailable (see %gpumem status)</td>'
        return f"{head}<tr><td></td>{missing}</tr></tbody></table>"
    return (
        f"{head}<tr><td>this process</td><td>{_html_span(host.rss_before_bytes, host.rss_after_bytes)}</td>"
        f"{_peak_cell_html(host)}</tr></tbody></table>"
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
        peak = peak_above(change.peak_above_start_bytes, change.peak_exact, "")
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
