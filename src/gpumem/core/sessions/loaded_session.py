"""A loaded session, read-only: its memory curves as an inline SVG and its cell history table.

Static on purpose: it needs no GPU, no widgets and no running kernel state, so an export opens in
any notebook on a laptop (and the text form in a terminal).
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpumem.core.cells.formatting import STYLE, format_duration
from gpumem.core.cells.history import HistoryTable
from gpumem.core.cells.report import CellReport, CellSummary
from gpumem.core.sampling.timeline import Mark, decimate_min_max
from gpumem.core.sessions.session_file import SavedReport, SessionData
from gpumem.core.units import format_bytes

__all__ = ["LoadedSession"]

_WIDTH, _HEIGHT, _MARGIN = 720, 220, 8
_POINTS_DRAWN = 1_200  # per curve: min/max decimation keeps every peak visible
_MARKS_DRAWN = 200
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


class LoadedSession:
    """What ``%gpumem load`` shows; :attr:`data` holds every sample, mark and cell as exported.

    ``curves=False`` leaves the curves out of the HTML (a notebook shows them in the read-only panel).
    """

    def __init__(self, data: SessionData, source: str, *, curves: bool = True) -> None:
        self.data = data
        self.source = source
        self.curves = curves

    def _title(self) -> str:
        exported = self.data.exported_wall_s
        when = f", exported {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(exported))}" if exported else ""
        return f"gpumem session from {self.source}{when} (read-only)"

    def channel_lines(self) -> list[str]:
        """Per channel: its peak and last value."""
        series = self.data.timeline
        times = series.times
        if not times:
            return ["No samples in this export."]
        span = format_duration(times[-1] - times[0])
        lines = [f"{len(times):,} points over {span}; marks: {len(self.data.marks):,}; cells: {len(self.data.cells):,}"]
        if self.data.store is not None:
            lines.append(
                "store restored, every level: " + ", ".join(_level_line(level) for level in self.data.store["levels"])
            )
        for name, values in series.values.items():
            finite = [value for value in values if not math.isnan(value)]
            if finite:
                lines.append(f"  {name}: peak {format_bytes(max(finite))}, last {format_bytes(finite[-1])}")
            else:
                lines.append(f"  {name}: never measured")
        return lines

    def run_lines(self) -> list[str]:
        """For a session ``python -m gpumem run --save`` wrote: the script, its exit code, its peaks."""
        run = self.data.run
        if not run:
            return []
        command = " ".join(str(word) for word in [Path(str(run.get("script", "?"))).name, *(run.get("argv") or [])])
        duration = run.get("duration_s")
        took = f", {format_duration(duration)}" if isinstance(duration, (int, float)) else ""
        lines = [f"python -m gpumem run {command}: exit code {run.get('exit_code', '?')}{took}"]
        for row in run.get("figures") or []:
            peak = row.get("peak_allocated_bytes") if isinstance(row, dict) else None
            if isinstance(peak, int) and isinstance(row.get("device"), int):
                bound = "" if row.get("peak_exact") else "\u2265 "
                lines.append(f"  cuda:{row['device']}: peak allocated {bound}{format_bytes(peak)}")
        return lines

    def __repr__(self) -> str:
        parts = [self._title(), *self.run_lines(), *self.channel_lines(), *self.data.notes]
        parts.append(repr(HistoryTable(self.data.cells)))
        parts.extend(f"\n{_report_title(report)}\n{report.text}" for report in self.data.reports)
        return "\n".join(parts)

    def _repr_html_(self) -> str:
        shown = [*self.run_lines(), *self.channel_lines(), *self.data.notes]
        lines = "".join(f"<div>{html.escape(line)}</div>" for line in shown)
        table = HistoryTable(self.data.cells)._repr_html_()
        curves = curves_svg(self.data.timeline.times, self.data.timeline.values, self.data.marks) if self.curves else ""
        return (
            f"{STYLE}<div class='gpumem-report'><b>{html.escape(self._title())}</b>{lines}{curves}</div>{table}"
            + self._cell_reports_html()
            + "".join(
                f"<details><summary>{html.escape(_report_title(report))}</summary><pre>{html.escape(report.text)}</pre>"
                "</details>"
                for report in self.data.reports
            )
        )

    def _cell_reports_html(self) -> str:
        """Each cell's report as it was shown under the cell, folded under its one-line summary."""
        parts = [
            f"<details class='gpumem-cell-report' data-cell='{record.execution_count}'>"
            f"<summary>{html.escape(repr(CellSummary(record)))}</summary>{CellReport(record)._repr_html_()}</details>"
            for record in self.data.cells
        ]
        return f"<div class='gpumem-cell-reports'>{''.join(parts)}</div>" if parts else ""


def _level_line(level: dict[str, Any]) -> str:
    span = float(level["span_s"])
    what = "raw samples" if span == 0 else f"{format_duration(span)} buckets"
    return f"{len(level['keys']):,} of {int(level['capacity']):,} {what}"


def _report_title(report: SavedReport) -> str:
    where = f"cell [{report.cell}]" if report.cell is not None else "a cell"
    return f"--{report.kind} report of {where}"


def curves_svg(times: Sequence[float], values: dict[str, list[float]], marks: Sequence[Mark]) -> str:
    """The channels as polylines on one byte scale, marks as dashed vertical lines, with a legend."""
    if not times:
        return ""
    series = decimate_min_max(times, values, _POINTS_DRAWN)
    finite = [v for column in series.values.values() for v in column if not math.isnan(v)]
    top = max(finite, default=0.0) or 1.0
    start, end = series.times[0], series.times[-1]
    width = (end - start) or 1.0

    def x(time_s: float) -> float:
        return _MARGIN + (time_s - start) / width * (_WIDTH - 2 * _MARGIN)

    def y(value: float) -> float:
        return _HEIGHT - _MARGIN - value / top * (_HEIGHT - 2 * _MARGIN)

    shapes = []
    for mark in [m for m in marks if start <= m.time_s <= end][-_MARKS_DRAWN:]:
        left = f"{x(mark.time_s):.1f}"
        shapes.append(
            f"<line x1='{left}' x2='{left}' y1='0' y2='{_HEIGHT}' stroke='#bbb' stroke-dasharray='3,3'>"
            f"<title>{html.escape(mark.label)}</title></line>"
        )
    legend = []
    for index, (name, column) in enumerate(series.values.items()):
        colour = _COLOURS[index % len(_COLOURS)]
        for run in _runs(series.times, column):
            points = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in run)
            shapes.append(f"<polyline fill='none' stroke='{colour}' stroke-width='1.5' points='{points}'/>")
        legend.append(f"<span style='color:{colour}'>&#9632; {html.escape(name)}</span>")
    return (
        f"<div>{' '.join(legend)} (top of the scale: {html.escape(format_bytes(top))})</div>"
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{_WIDTH}' height='{_HEIGHT}' "
        f"style='border:1px solid #ddd'>{''.join(shapes)}</svg>"
    )


def _runs(times: Sequence[float], column: Sequence[float]) -> list[list[tuple[float, float]]]:
    """Stretches of measured points: a NaN (not measured) breaks the line."""
    runs: list[list[tuple[float, float]]] = [[]]
    for time_s, value in zip(times, column, strict=True):
        if math.isnan(value):
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append((time_s, value))
    return [run for run in runs if run]
