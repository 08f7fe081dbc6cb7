"""The pieces of text the cell report and the history table share: the style, labels and durations."""

from __future__ import annotations

from gpumem.core.cells.record import CellRecord
from gpumem.core.units import format_delta, format_duration

__all__ = ["STYLE", "at_least", "cell_label", "format_duration", "peak_above"]

STYLE = (
    "<style>"
    ".gpumem-report{font-family:var(--jp-ui-font-family,sans-serif);font-size:12px;line-height:1.4;margin:2px 0}"
    ".gpumem-report table{border-collapse:collapse;margin:2px 0}"
    ".gpumem-report th,.gpumem-report td{padding:1px 8px;text-align:right;border:none;white-space:nowrap}"
    ".gpumem-report th:first-child,.gpumem-report td:first-child{text-align:left}"
    ".gpumem-report td.src{text-align:left;font-family:var(--jp-code-font-family,monospace)}"
    # A source column that ends a row (history's first line) wraps, anywhere since code has long words,
    # so the table never outgrows the output area; names in the report's first column stay on one line.
    ".gpumem-report td.src:last-child{white-space:normal;overflow-wrap:anywhere;min-width:12em}"
    ".gpumem-report th.src{text-align:left}"
    # History: headings and the by-kind phrase wrap between words, so many device columns still fit.
    ".gpumem-report table.history th{white-space:normal}"
    ".gpumem-report td.words{white-space:normal;text-align:left;min-width:7em}"
    ".gpumem-report thead th{border-bottom:1px solid var(--jp-border-color2,#ccc);font-weight:600}"
    ".gpumem-report .up{color:var(--jp-error-color1,#c62828)}"
    ".gpumem-report .down{color:var(--jp-success-color1,#2e7d32)}"
    ".gpumem-report .dim{color:var(--jp-ui-font-color2,#777)}"
    ".gpumem-report .warn{color:var(--jp-warn-color0,#b26a00);margin:1px 0}"
    ".gpumem-report .note{margin:1px 0}"
    ".gpumem-report code{font-size:11px}"
    "</style>"
)


def cell_label(record: CellRecord) -> str:
    """``[7]`` for a cell with an execution count, else ``#3``, its place among the measured cells; a scope,
    tag or run by its kind (its label follows in the report)."""
    if record.kind != "cell":
        return record.kind
    count = record.execution_count
    return f"[{count}]" if count is not None else f"#{record.serial}"


def at_least(delta: int, space: str = " ") -> str:
    """A sampled peak above the start, a lower bound: ``'≥ +1.0 GiB'``, and ``'≥ 0 B'`` rather than ``'≥ ±0 B'``."""
    return f"\u2265{space}{format_delta(delta) if delta else '0 B'}"


def peak_above(delta: int, exact: bool, space: str = " ") -> str:
    """A peak above the start: its delta when exact, else the lower bound (:func:`at_least`)."""
    return format_delta(delta) if exact else at_least(delta, space)
