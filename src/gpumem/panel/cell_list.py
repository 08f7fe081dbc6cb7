"""The panel's compact history of measured cells: pick one to read its report in the panel.

After an out-of-memory error the extension's explanation is shown here as well.
The records come from the cell tracker the IPython extension owns, handed to this layer as a callable
(:mod:`gpumem.panel.cell_source`, set when the extension loads and cleared when it unloads): the panel never
imports the IPython layer. The list is read on the writer thread after a cell ends while the panel is
shown (a copy of a bounded deque); a report is rendered only for the cell picked.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from gpumem.core.cells.record import CellRecord
from gpumem.core.cells.report import CellReport
from gpumem.core.diagnoses.oom import render_html
from gpumem.core.units import format_delta
from gpumem.panel.cell_source import cell_records, last_oom, set_cell_source

if TYPE_CHECKING:
    from gpumem.panel.holders_view import ConditionLine

__all__ = [
    "CELLS_SHOWN",
    "CellsPane",
    "cell_options",
    "cell_records",
    "last_oom",
    "render_conditions",
    "set_cell_source",
]

CELLS_SHOWN = 20  # the newest cells offered
# A report is laid out for an output area; in the panel (a sidebar's width too) its tables and lines wrap.
_STYLE = (
    "<style>.gm-cells-pane .gpumem-report,.gm-cells-pane .gpumem-report *{white-space:normal!important;"
    "overflow-wrap:anywhere;min-width:0!important;max-width:100%}"
    ".gm-cells-pane .gpumem-report table{width:100%;table-layout:fixed}"
    ".gm-cells-pane .gpumem-report th,.gm-cells-pane .gpumem-report td{padding:1px 3px}</style>"
)
_NONE = 0  # the choice "no cell picked"


def _label(record: CellRecord) -> str:
    number = f"[{record.execution_count}]" if record.execution_count is not None else f"#{record.serial}"
    change = format_delta(sum(change.allocated_delta_bytes for change in record.devices))
    if not record.devices and record.host is not None:
        change = f"host {format_delta(record.host.rss_delta_bytes)}"
    warned = f" \u26a0 {len(record.warnings)}" if record.warnings else ""
    line = record.first_line if len(record.first_line) <= 32 else record.first_line[:31] + "\u2026"  # noqa: PLR2004
    return f"{number} {line}  {change}{warned}"


def cell_options(records: Sequence[CellRecord]) -> list[tuple[str, int]]:
    """The dropdown's choices, newest first: ``[N] first line  +1.0 GiB ⚠ 1`` -> the record's serial."""
    newest = sorted(records, key=lambda record: -record.serial)[:CELLS_SHOWN]
    return [("pick a measured cell", _NONE), *((_label(record), record.serial) for record in newest)]


def render_conditions(lines: Sequence[ConditionLine]) -> str:
    """What stands now, one line each: the condition (the cell that caused it) — what fixes it."""
    if not lines:
        return ""
    items = "".join(
        f"<li>{html.escape(line.text)}{f' ({html.escape(line.cell)})' if line.cell else ''}"
        f" \u2014 {html.escape(line.fix)}</li>"
        for line in lines
    )
    return (
        '<div class="gm-title">Standing now</div>'
        f'<ul class="gm-conditions" aria-label="conditions that stand now" style="margin:2px 0;padding-left:18px">'
        f"{items}</ul>"
    )


class CellsPane(widgets.VBox):  # type: ignore[misc]
    """A dropdown of the newest measured cells and the picked cell's report (its warnings included)."""

    def __init__(self) -> None:
        self.choice = widgets.Dropdown(
            options=[("no measured cell yet", _NONE)], value=_NONE, description="cell report",
            tooltip="The report of a measured cell: its figures, the names that hold memory, its warnings",
            style={"description_width": "initial"}, layout=widgets.Layout(width="auto", max_width="100%"),
        )  # fmt: skip
        self.report = widgets.HTML("", layout=widgets.Layout(max_width="100%"))
        self.oom = widgets.HTML("", layout=widgets.Layout(max_width="100%", display="none"))
        self.conditions = widgets.HTML("", layout=widgets.Layout(max_width="100%", display="none"))
        self._records: dict[int, CellRecord] = {}
        self._oom_shown = 0
        super().__init__([self.oom, self.conditions, self.choice, self.report], layout=widgets.Layout(width="100%"))
        self.add_class("gm-cells-pane")

    # Writer thread only ---------------------------------------------------------------------------
    def show_records(self, records: Sequence[CellRecord]) -> None:
        """Offer the newest cells (keeping the one picked, while it is still offered)."""
        options = cell_options(records)
        if not records or options == list(self.choice.options):
            return
        self._records = {record.serial: record for record in records}
        current = self.choice.value if self.choice.value in self._records else _NONE
        with self.choice.hold_sync():
            self.choice.options = options
            self.choice.value = current

    def show_conditions(self, lines: Sequence[ConditionLine]) -> None:
        """The conditions that stand now (those gone since the last walk are no longer listed)."""
        text = render_conditions(lines)
        if text != self.conditions.value:
            with self.conditions.hold_sync():
                self.conditions.value = text
                self.conditions.layout.display = "block" if text else "none"

    def show_oom(self, found: tuple[int, Any] | None) -> None:
        """The newest out-of-memory explanation, once per explanation (the actions above free what it names)."""
        if found is None or found[0] == self._oom_shown:
            return
        self._oom_shown = found[0]
        head = '<div class="gm-title" role="alert">Out of memory: why, and what frees it (the actions above)</div>'
        self.oom.value = head + render_html(found[1])
        self.oom.layout.display = "block"

    def show_report(self, serial: Any) -> None:
        record = self._records.get(serial) if isinstance(serial, int) else None
        self.report.value = "" if record is None else _STYLE + CellReport(record)._repr_html_()
