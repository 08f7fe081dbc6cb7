"""A cell's allocation trace as text (terminals) and HTML (notebooks): three tables and the timeline.

The HTML is one self-contained fragment: inline CSS, an inline SVG and a few lines of inline script,
no external resource, so it renders offline and in a saved notebook. Each site row expands
(``<details>``) to the stack of its largest block, library frames folded into one line. Every
string from user code (file names, function names) is escaped.
"""

from __future__ import annotations

import html
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpumem.core.trace.analysis import DeviceTrace, Frame, SiteUsage
from gpumem.core.trace.site_timeline import build_timeline, render_svg
from gpumem.core.units import format_bytes

__all__ = ["TraceReport", "render_html", "render_text"]

_ROWS = 8  # sites shown per table; the rest are summed in one line
_STACK = 24  # frames shown per stack
_STYLE = (
    "<style>.gpumem-trace table{border-collapse:collapse;margin:2px 0 8px}"
    ".gpumem-trace td,.gpumem-trace th{padding:1px 8px;text-align:left;vertical-align:top}"
    ".gpumem-trace td.b{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}"
    ".gpumem-trace details summary{cursor:pointer}.gpumem-trace .lib{color:#6b7280}"
    ".gpumem-trace pre{margin:2px 0 2px 12px;font-size:11px}</style>"
)


@dataclass
class TraceReport:
    """What ``%%gpumem --trace`` shows under the cell."""

    devices: list[DeviceTrace]
    notes: list[str] = field(default_factory=list)  # true sentences about the trace itself
    cell: int | None = None

    def __repr__(self) -> str:
        return render_text(self)

    def _repr_html_(self) -> str:
        return render_html(self)


# The three views: title, the rows, and what the bytes of a row mean.
def _views(trace: DeviceTrace) -> list[tuple[str, list[SiteUsage], str]]:
    peak_title = f"Alive at the cell's peak ({format_bytes(trace.peak_bytes)})"
    left_total = sum(usage.bytes for usage in trace.left)
    temporary_total = sum(usage.bytes for usage in trace.temporary)
    return [
        (peak_title, trace.at_peak, "alive"),
        (f"Left behind by the cell ({format_bytes(left_total)})", trace.left, "still allocated"),
        (
            f"Temporary: allocated and freed inside the cell ({format_bytes(temporary_total)} in all)",
            trace.temporary,
            "allocated in all",
        ),
    ]


def _before_row(trace: DeviceTrace, view: str) -> int:
    """Bytes of the "before the cell" row of a view (0: no row)."""
    if view == "alive":
        return trace.before_at_peak
    return 0


def _before_label(trace: DeviceTrace) -> str:
    return "before the trace began" if trace.truncated else "before the cell"


def _stack_lines(stack: Sequence[Frame]) -> list[tuple[str, bool]]:
    """``(text, is user code)`` per line, innermost first, runs of library frames folded into one."""
    lines: list[tuple[str, bool]] = []
    run: list[Frame] = []
    for frame in (*stack[:_STACK], None):
        if frame is not None and not frame.user:
            run.append(frame)
            continue
        if run:
            first = run[0]
            more = f" (+{len(run) - 1} library frames)" if len(run) > 1 else ""
            lines.append((f"{first.where} in {first.function}{more}", False))
            run = []
        if frame is not None:
            lines.append((f"{frame.where} in {frame.function}", True))
    if len(stack) > _STACK:
        lines.append((f"... {len(stack) - _STACK} outer frames", False))
    return lines


def _headline(report: TraceReport) -> str:
    where = f"cell [{report.cell}]" if report.cell is not None else "the cell"
    return f"gpumem trace of {where}: allocation sites (bytes as requested from PyTorch's allocator)"


def _device_summary(trace: DeviceTrace) -> str:
    parts = [
        f"cuda:{trace.device}: {len(trace.times):,} allocator events",
        f"peak {format_bytes(trace.peak_bytes)}",
        f"{format_bytes(trace.start_bytes)} allocated {_before_label(trace)}",
        f"{format_bytes(trace.end_bytes)} at the end",
    ]
    if trace.freed_before:
        parts.append(f"the cell freed {format_bytes(trace.freed_before)} allocated {_before_label(trace)}")
    return "; ".join(parts)


def _failures(trace: DeviceTrace) -> list[str]:
    return [f"an allocation of {format_bytes(size)} ran out of memory" for size in trace.failed]


def render_text(report: TraceReport) -> str:
    lines = [_headline(report), *report.notes]
    for trace in report.devices:
        lines.append(_device_summary(trace))
        lines.extend(_failures(trace))
        for title, usages, view in _views(trace):
            lines.append(f"  {title}")
            before = _before_row(trace, view)
            if before:
                lines.append(f"    {format_bytes(before):>10}  {_before_label(trace)}")
            for usage in usages[:_ROWS]:
                count = f"  ({usage.count} blocks)" if usage.count > 1 else ""
                via = f"  via {usage.site.via}" if usage.site.via else ""
                lines.append(f"    {format_bytes(usage.bytes):>10}  {usage.site.label}{count}{via}")
            lines.extend(_rest_text(usages))
            if not usages and not before:
                lines.append("    nothing")
    if not report.devices:
        lines.append("The cell allocated and freed no GPU memory through PyTorch.")
    return "\n".join(lines)


def _rest_text(usages: Sequence[SiteUsage]) -> list[str]:
    rest = usages[_ROWS:]
    if not rest:
        return []
    return [f"    {format_bytes(sum(usage.bytes for usage in rest)):>10}  {len(rest)} more sites"]


def _row_html(usage: SiteUsage) -> str:
    site = usage.site
    count = f" ({usage.count} blocks, largest {format_bytes(usage.largest)})" if usage.count > 1 else ""
    via = f' <span class="lib">via {html.escape(site.via)}</span>' if site.via else ""
    stack = "\n".join(
        html.escape(text) if user else f'<span class="lib">{html.escape(text)}</span>'
        for text, user in _stack_lines(usage.stack)
    )
    label = html.escape(site.label) if site.user else f'<span class="lib">{html.escape(site.label)}</span>'
    summary = f"{label}{html.escape(count)}{via}"
    body = f"<details><summary>{summary}</summary><pre>{stack}</pre></details>" if stack else summary
    return f'<tr><td class="b" title="{usage.bytes:,} bytes">{format_bytes(usage.bytes)}</td><td>{body}</td></tr>'


def _table_html(trace: DeviceTrace, title: str, usages: list[SiteUsage], view: str) -> str:
    rows = []
    before = _before_row(trace, view)
    if before:
        rows.append(
            f'<tr><td class="b" title="{before:,} bytes">{format_bytes(before)}</td>'
            f'<td class="lib">{_before_label(trace)}</td></tr>'
        )
    rows.extend(_row_html(usage) for usage in usages[:_ROWS])
    rest = usages[_ROWS:]
    if rest:
        total = sum(usage.bytes for usage in rest)
        rows.append(f'<tr><td class="b">{format_bytes(total)}</td><td class="lib">{len(rest)} more sites</td></tr>')
    if not rows:
        rows.append('<tr><td class="lib" colspan="2">nothing</td></tr>')
    return f"<div><b>{html.escape(title)}</b><table>{''.join(rows)}</table></div>"


def render_html(report: TraceReport) -> str:
    parts = [f'<div class="gpumem-trace" style="position:relative">{_STYLE}<b>{html.escape(_headline(report))}</b>']
    parts.extend(f"<div>{html.escape(note)}</div>" for note in report.notes)
    for trace in report.devices:
        parts.append(f"<div>{html.escape(_device_summary(trace))}</div>")
        parts.extend(f'<div style="color:#b91c1c">{html.escape(text)}</div>' for text in _failures(trace))
        if trace.times:
            parts.append(render_svg(build_timeline(trace), f"gpumem-trace-{uuid.uuid4().hex[:12]}"))
        parts.extend(_table_html(trace, title, usages, view) for title, usages, view in _views(trace))
    if not report.devices:
        parts.append("<div>The cell allocated and freed no GPU memory through PyTorch.</div>")
    parts.append("</div>")
    return "".join(parts)
