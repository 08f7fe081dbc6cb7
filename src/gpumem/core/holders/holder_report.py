"""The walk's report and how it reads: the ``%gpumem who`` table as plain text and as HTML.

:class:`HolderReport` lives here, beside its rendering, because its ``repr`` *is* the table: the data
types of :mod:`gpumem.core.holders.model` stay free of presentation and neither module imports the other.
"""

from __future__ import annotations

from typing import NamedTuple

from gpumem.core.diagnoses.device_split import DeviceSplit, device_split_text
from gpumem.core.holders.model import CATEGORY_ORDER, FREE_COMMAND, TENSORS, CycleReport, Holder, KindTotal
from gpumem.core.holders.remainder import Remainder
from gpumem.core.units import format_bytes, format_duration

__all__ = ["HolderReport", "escape_html", "render_html", "render_text"]

_NOTES_NAMED = 3  # names listed in a row's notes (shared with, graph paths)
_CYCLE_TYPES_NAMED = 5
_MIN_NAME_WIDTH = len("total named")
_MIN_TYPE_WIDTH = 4
_MIN_DEVICE_WIDTH = 6
_BYTES_WIDTH = 10


class HolderReport(NamedTuple):
    """The result of :func:`~gpumem.core.holders.find_holders`.

    ``total_bytes`` counts the rows in ``holders`` (user names); ``hidden_bytes`` the rows in ``hidden``
    (IPython's references). ``unattributed`` explains whatever ``memory_allocated`` holds beyond both;
    ``remainder`` splits it (graph-saved tensors, workspaces, rounding, unexplained) and ``kinds`` sums
    everything by kind. ``device_splits`` say how NVML's "device used" divides (one per CUDA device read).
    """

    holders: list[Holder]
    total_bytes: int
    hidden: list[Holder]
    unattributed: str
    truncated: bool
    elapsed_s: float
    hidden_bytes: int = 0
    device: str = "cuda"
    allocated_bytes: int | None = None
    unattributed_bytes: int | None = None
    truncation: tuple[str, ...] = ()
    torch_loaded: bool = True
    cycles: CycleReport | None = None
    kinds: tuple[KindTotal, ...] = ()
    remainder: Remainder | None = None
    device_splits: tuple[DeviceSplit, ...] = ()
    graph_saved_bytes: int = 0  # storages only autograd graphs keep, on the walked devices
    arrays: str = ""  # the numpy arrays the namespace names (host memory that no row counts), when asked for

    def __repr__(self) -> str:
        """The table ``%gpumem who`` prints, so that ``gpumem.holders()`` reads well on its own."""
        return render_text(self)

    def _repr_html_(self) -> str:
        return render_html(self)


def escape_html(text: str) -> str:
    """``text`` safe as HTML element content and inside a double-quoted attribute value."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


# ----------------------------------------------------------------------------------------------
# Pieces shared by both tables
# ----------------------------------------------------------------------------------------------


def _breakdown_text(row: Holder) -> str:
    if not row.breakdown or set(row.breakdown) == {TENSORS}:
        return ""
    parts = [f"{name} {format_bytes(row.breakdown[name])}" for name in CATEGORY_ORDER if row.breakdown.get(name)]
    return ", ".join(parts)


def _row_notes(row: Holder) -> list[str]:
    notes: list[str] = []
    breakdown = _breakdown_text(row)
    if breakdown:
        notes.append(breakdown)
    partners = ", ".join(row.shared_with[:_NOTES_NAMED])
    if row.shared_bytes:
        notes.append(f"{format_bytes(row.shared_bytes)} shared with {partners} (counted once)")
    elif row.shared_with:
        notes.append(f"shares storage with {partners}")
    if row.graph_saved_bytes:
        notes.append(
            f"{format_bytes(row.nbytes)} own + {format_bytes(row.graph_saved_bytes)} saved by its autograd graphs"
        )
    if row.graph_paths:
        notes.append("keeps an autograd graph alive: " + ", ".join(row.graph_paths[:_NOTES_NAMED]))
    if row.note:
        notes.append(row.note)
    return notes


def _bytes_text(nbytes: int, complete: bool) -> str:
    """A size, marked as a lower bound when the walk stopped early (see the "Walk truncated" line)."""
    return format_bytes(nbytes) if complete else f"\u2265 {format_bytes(nbytes)}"


def _nothing_found(report: HolderReport) -> str:
    where = "any device" if report.device == "all" else report.device
    if report.truncated:
        return f"no name was found holding tensor memory on {where} (the walk stopped early, see below)"
    return f"no name holds tensor memory on {where}"


def _cycles_text(cycles: CycleReport) -> str:
    if not cycles.object_count:
        return "Reference cycles: none were waiting for the garbage collector"
    members = ", ".join(f"{name} x{count}" for name, count in cycles.member_types[:_CYCLE_TYPES_NAMED])
    return (
        f"Reference cycles: {cycles.object_count} unreachable objects ({members}) held "
        f"{format_bytes(cycles.nbytes)} in {cycles.tensor_count} tensors; collected now"
    )


def _rest_bytes(report: HolderReport, limit: int) -> int:
    return sum(row.nbytes for row in report.holders[limit:])


def _kind_lines(report: HolderReport) -> list[tuple[str, str, str]]:
    """(kind, bytes, note) of the by-kind summary."""
    return [(total.kind, format_bytes(total.nbytes), total.note) for total in report.kinds]


def _device_lines(report: HolderReport) -> list[str]:
    if len(report.device_splits) == 1:
        return [device_split_text(report.device_splits[0])]
    return [f"cuda:{split.device}: {device_split_text(split)}" for split in report.device_splits]


def _allocated_line(report: HolderReport) -> str:
    if report.allocated_bytes is None:
        return report.unattributed
    return f"memory_allocated {format_bytes(report.allocated_bytes)}: {report.unattributed}"


# ----------------------------------------------------------------------------------------------
# Plain text
# ----------------------------------------------------------------------------------------------


class _Columns(NamedTuple):
    name: int
    type: int
    device: int

    @classmethod
    def fitting(cls, rows: list[Holder]) -> _Columns:
        return cls(
            max([len(row.name) for row in rows] + [_MIN_NAME_WIDTH]),
            max([len(row.type_name) for row in rows] + [_MIN_TYPE_WIDTH]),
            max([len(row.device) for row in rows] + [_MIN_DEVICE_WIDTH]),
        )

    def row_lines(self, row: Holder) -> list[str]:
        head = (
            f"  {row.name:<{self.name}}  {row.type_name:<{self.type}}  {row.device:<{self.device}}  "
            f"{_bytes_text(row.nbytes, row.complete):>{_BYTES_WIDTH}}"
        )
        indent = " " * (self.name + 4)
        return [head, *(indent + note for note in _row_notes(row))]

    def total_line(self, report: HolderReport) -> str:
        width = self.name + self.type + self.device + 6
        return f"  {'total named':<{width}}{_bytes_text(report.total_bytes, not report.truncated):>{_BYTES_WIDTH}}"


def render_text(report: HolderReport, *, limit: int = 20) -> str:
    """A plain-text table for terminals and ``text/plain``."""
    if not report.torch_loaded:
        return "\n".join(["gpumem who: " + report.unattributed, *([report.arrays] if report.arrays else [])])
    columns = _Columns.fitting([*report.holders[:limit], *report.hidden])
    lines = [f"Tensor memory held by names ({report.device}), walked in {format_duration(report.elapsed_s)}"]
    if report.kinds:
        width = max(len(kind) for kind, _, _ in _kind_lines(report))
        lines.append("By kind:")
        lines.extend(
            f"  {kind:<{width}}  {nbytes:>{_BYTES_WIDTH}}" + (f"  ({note})" if note else "")
            for kind, nbytes, note in _kind_lines(report)
        )
        lines.append("By name:")
    if not report.holders:
        hint = " (`%gpumem who --device cpu` lists CPU tensors)" if report.device.startswith("cuda") else ""
        lines.append(f"  {_nothing_found(report)}{hint}")
    for row in report.holders[:limit]:
        lines.extend(columns.row_lines(row))
    if len(report.holders) > limit:
        rest = format_bytes(_rest_bytes(report, limit))
        lines.append(f"  ... {len(report.holders) - limit} more names, {rest} (--all lists them)")
    lines.append(columns.total_line(report))
    if report.hidden:
        lines.append(f"Held by IPython (release with {FREE_COMMAND}):")
        for row in report.hidden:
            lines.extend(columns.row_lines(row))
    lines.append(_allocated_line(report))
    lines.extend(_device_lines(report))
    if report.arrays:
        lines.append(report.arrays)
    if report.cycles is not None:
        lines.append(_cycles_text(report.cycles))
    if report.truncated:
        lines.append("Walk truncated: " + "; ".join(report.truncation))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# HTML
# ----------------------------------------------------------------------------------------------

_LEFT = "style='text-align:left'"
_RIGHT = "style='text-align:right;white-space:nowrap'"  # a figure never breaks across lines
_HTML_HEAD = (
    f"<table><thead><tr><th {_LEFT}>name</th><th {_LEFT}>type</th>"
    f"<th>device</th><th {_RIGHT}>bytes</th><th {_LEFT}>notes</th></tr>"
    "</thead><tbody>"
)


def _row_html(row: Holder) -> str:
    notes = "<br>".join(escape_html(note) for note in _row_notes(row))
    return (
        f"<tr><td {_LEFT}><code>{escape_html(row.name)}</code></td>"
        f"<td {_LEFT}>{escape_html(row.type_name)}</td><td>{escape_html(row.device)}</td>"
        f"<td {_RIGHT}>{_bytes_text(row.nbytes, row.complete)}</td>"
        f"<td {_LEFT}>{notes}</td></tr>"
    )


def _table_html(report: HolderReport, limit: int) -> list[str]:
    parts = [_HTML_HEAD]
    if not report.holders:
        parts.append(f"<tr><td colspan=5>{escape_html(_nothing_found(report))}</td></tr>")
    parts.extend(_row_html(row) for row in report.holders[:limit])
    if len(report.holders) > limit:
        parts.append(
            f"<tr><td colspan=3>... {len(report.holders) - limit} more names</td>"
            f"<td {_RIGHT}>{format_bytes(_rest_bytes(report, limit))}</td><td></td></tr>"
        )
    parts.append(
        f"<tr><td colspan=3><b>total named</b></td><td {_RIGHT}>"
        f"<b>{_bytes_text(report.total_bytes, not report.truncated)}</b></td><td></td></tr>"
    )
    if report.hidden:
        parts.append(
            f"<tr><td colspan=5 {_LEFT}><b>Held by IPython</b> (release with <code>{FREE_COMMAND}</code>)</td></tr>"
        )
        parts.extend(_row_html(row) for row in report.hidden)
    parts.append("</tbody></table>")
    return parts


def _kinds_html(report: HolderReport) -> list[str]:
    if not report.kinds:
        return []
    head = f"<thead><tr><th {_LEFT}>kind</th><th {_RIGHT}>bytes</th><th {_LEFT}>notes</th></tr></thead>"
    parts = [f"<table class='gpumem-kinds'>{head}<tbody>"]
    parts.extend(
        f"<tr><td {_LEFT}>{escape_html(kind)}</td><td {_RIGHT}>{nbytes}</td><td {_LEFT}>{escape_html(note)}</td></tr>"
        for kind, nbytes, note in _kind_lines(report)
    )
    parts.append("</tbody></table>")
    return parts


def render_html(report: HolderReport, *, limit: int = 20) -> str:
    """An HTML table for notebooks."""
    if not report.torch_loaded:
        arrays = f"<div>{escape_html(report.arrays)}</div>" if report.arrays else ""
        return f"<div class='gpumem-who'><div>{escape_html(report.unattributed)}</div>{arrays}</div>"
    parts = [
        "<div class='gpumem-who'>",
        f"<b>Tensor memory held by names ({escape_html(report.device)})</b>",
        *_kinds_html(report),
        *_table_html(report, limit),
        f"<div>{escape_html(_allocated_line(report))}</div>",
        *(f"<div>{escape_html(line)}</div>" for line in _device_lines(report)),
        *([f"<div>{escape_html(report.arrays)}</div>"] if report.arrays else []),
    ]
    if report.cycles is not None:
        parts.append(f"<div>{escape_html(_cycles_text(report.cycles))}</div>")
    if report.truncated:
        parts.append(f"<div><i>Walk truncated: {escape_html('; '.join(report.truncation))}</i></div>")
    parts.append(f"<div style='opacity:.6'>walked in {format_duration(report.elapsed_s)}</div></div>")
    return "".join(parts)
