"""``monitor.report()``: the tags, the scopes and, after ``gather()``, every rank, as text, HTML or a table.

A peak that is a lower bound is written ``≥ 1.0 GiB`` with its reason below the table; exact ones plain.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from gpumem.core.monitoring.spans import DeviceChange, SpanRecord
from gpumem.core.units import format_bytes

__all__ = ["MemoryReport", "report_rows"]

_TAG_HEADER = (
    "tag", "device", "allocated", "reserved", "peak allocated", "peak reserved", "GPU used", "host RSS", "host peak",
)  # fmt: skip
_SCOPE_HEADER = ("scope", "device", "allocated", "peak allocated", "peak reserved", "host peak", "time")
_RANK_HEADER = ("rank", "host", "device", "allocated", "peak allocated", "peak reserved", "host peak")


class _Notes:
    """Footnote marks for lower-bound peaks, one per distinct reason."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def peak(self, nbytes: int, exact: bool, note: str) -> str:
        text = format_bytes(nbytes)
        if exact and not note:
            return text
        if note not in self.reasons:
            self.reasons.append(note)
        mark = "*" * (self.reasons.index(note) + 1)
        return f"{text}{mark}" if exact else f"≥ {text}{mark}"

    def lines(self) -> list[str]:
        return [f"{'*' * (index + 1)} {reason}" for index, reason in enumerate(self.reasons)]


def _host_cells(record: SpanRecord) -> tuple[str, str]:
    host = record.host
    if host is None:
        return "n/a", "n/a"
    peak = format_bytes(host.peak_rss_bytes)
    return format_bytes(host.rss_bytes), peak if host.peak_exact else f"≥ {peak}"


def _used_text(device: DeviceChange) -> str:
    """NVML's use of the whole device (every process), of its total."""
    if device.used_bytes is None or device.total_bytes is None:
        return "n/a"
    return f"{format_bytes(device.used_bytes)} / {format_bytes(device.total_bytes)}"


def _device_rows(record: SpanRecord) -> Sequence[DeviceChange | None]:
    return record.devices or (None,)


def _tag_rows(tags: Sequence[SpanRecord], notes: _Notes) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for record in tags:
        rss, rss_peak = _host_cells(record)
        for device in _device_rows(record):
            if device is None:
                rows.append((record.label, "(no CUDA)", "", "", "", "", "", rss, rss_peak))
                continue
            rows.append(
                (
                    record.label,
                    f"cuda:{device.device}",
                    format_bytes(device.allocated_bytes),
                    format_bytes(device.reserved_bytes),
                    notes.peak(device.peak_allocated_bytes, device.peak_exact, device.peak_note),
                    notes.peak(device.peak_reserved_bytes, device.peak_exact, device.peak_note),
                    _used_text(device),
                    rss,
                    rss_peak,
                )
            )
    return rows


def _scope_rows(scopes: Sequence[SpanRecord], notes: _Notes) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for record in sorted(scopes, key=lambda record: (record.started_wall_s, record.depth)):
        name = "  " * record.depth + record.label + (" (raised)" if record.error else "")
        _, rss_peak = _host_cells(record)
        for device in _device_rows(record):
            if device is None:
                rows.append((name, "(no CUDA)", "", "", "", rss_peak, f"{record.duration_s:.3f} s"))
                continue
            delta = device.allocated_bytes - device.allocated_before_bytes
            rows.append(
                (
                    name,
                    f"cuda:{device.device}",
                    f"{format_bytes(device.allocated_before_bytes)} -> {format_bytes(device.allocated_bytes)}"
                    + (f" ({'+' if delta >= 0 else ''}{format_bytes(delta)})" if delta else ""),
                    notes.peak(device.peak_allocated_bytes, device.peak_exact, device.peak_note),
                    notes.peak(device.peak_reserved_bytes, device.peak_exact, device.peak_note),
                    rss_peak,
                    f"{record.duration_s:.3f} s",
                )
            )
    return rows


def _rank_rows(ranks: Sequence[Any], notes: _Notes) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for rank in ranks:
        host_peak = format_bytes(rank.host_peak_rss_bytes) if rank.host_peak_rss_bytes is not None else "n/a"
        for device in rank.devices or (None,):
            if device is None:
                rows.append((str(rank.rank), rank.hostname, "(no CUDA)", "", "", "", host_peak))
                continue
            rows.append(
                (
                    str(rank.rank),
                    rank.hostname,
                    f"cuda:{device.device}",
                    format_bytes(device.allocated_bytes),
                    notes.peak(device.peak_allocated_bytes, device.peak_exact, device.peak_note),
                    notes.peak(device.peak_reserved_bytes, device.peak_exact, device.peak_note),
                    host_peak,
                )
            )
    return rows


def _table_text(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    return lines


def _table_html(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(cell)}</th>" for cell in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table class='gpumem-report'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class MemoryReport:
    """``print(report)`` for text, a notebook renders the HTML, ``to_dataframe()`` for pandas."""

    def __init__(
        self, tags: Sequence[SpanRecord], scopes: Sequence[SpanRecord], ranks: Any = None, *, title: str = "gpumem"
    ) -> None:
        self.tags = tuple(tags)
        self.scopes = tuple(scopes)
        self.ranks = ranks  # a gpumem.core.scripts.ranks.RankReport, or None
        self.title = title

    def _sections(self) -> tuple[list[tuple[str, Sequence[str], list[tuple[str, ...]]]], _Notes, list[str]]:
        notes = _Notes()
        sections: list[tuple[str, Sequence[str], list[tuple[str, ...]]]] = []
        if self.tags:
            sections.append(("memory at each tag (peaks since the previous tag)", _TAG_HEADER,
                             _tag_rows(self.tags, notes)))  # fmt: skip
        if self.scopes:
            sections.append(("memory in each scope", _SCOPE_HEADER, _scope_rows(self.scopes, notes)))
        extra: list[str] = []
        if self.ranks is not None:
            sections.append((f"memory per rank ({len(self.ranks.ranks)} ranks)", _RANK_HEADER,
                             _rank_rows(self.ranks.ranks, notes)))  # fmt: skip
            extra += [line for line in (self.ranks.imbalance_text(),) if line]
        return sections, notes, extra

    def __str__(self) -> str:
        sections, notes, extra = self._sections()
        if not sections:
            return (f"{self.title}: nothing recorded yet: take tagged snapshots with monitor.snapshot('name') "
                    "or measure blocks with `with monitor.track('name'):`")  # fmt: skip
        lines: list[str] = []
        for heading, header, rows in sections:
            lines += [f"{self.title}: {heading}", *_table_text(header, rows), ""]
        lines += [*extra, *notes.lines()]
        return "\n".join(lines).rstrip() + "\n"

    __repr__ = __str__

    def _repr_html_(self) -> str:
        sections, notes, extra = self._sections()
        if not sections:
            return f"<p>{html.escape(str(self))}</p>"
        parts = [
            f"<h4>{html.escape(self.title)}: {html.escape(heading)}</h4>{_table_html(header, rows)}"
            for heading, header, rows in sections
        ]
        parts += [f"<p>{html.escape(line)}</p>" for line in [*extra, *notes.lines()] if line]
        return "<div class='gpumem-script-report'>" + "".join(parts) + "</div>"

    def to_dataframe(self) -> Any:
        """One row per tag or scope and device (pandas is needed: pip install pandas)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("report().to_dataframe() needs pandas (pip install pandas)") from None
        return pd.DataFrame(report_rows(self.tags + self.scopes))


# A row's per-device columns (a span's "now" is the end of its stretch).
_ROW_FIELDS = (
    "device",
    "allocated_bytes",
    "reserved_bytes",
    "allocated_before_bytes",
    "reserved_before_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "peak_exact",
    "peak_note",
    "used_bytes",
    "total_bytes",
)


def report_rows(records: Sequence[SpanRecord]) -> list[dict[str, Any]]:
    """Plain rows (bytes, booleans, seconds) for a DataFrame or a JSON file."""
    rows = []
    for record in records:
        host = record.host
        base: dict[str, Any] = {
            "kind": record.kind,
            "label": record.label,
            "path": "/".join(record.path),
            "wall_time_s": record.wall_time_s,
            "duration_s": record.duration_s,
            "error": record.error,
            "host_rss_bytes": host.rss_bytes if host else None,
            "host_peak_rss_bytes": host.peak_rss_bytes if host else None,
            "host_peak_exact": host.peak_exact if host else None,
        }
        for device in _device_rows(record):
            figures = {name: getattr(device, name) for name in _ROW_FIELDS} if device is not None else {"device": None}
            rows.append({**base, **figures})
    return rows
