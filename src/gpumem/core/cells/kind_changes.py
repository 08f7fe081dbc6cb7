"""What a cell added by kind (parameters, gradients, optimizer state, ..., unattributed).

The kinds come from the holder walk the cell already ran for its variables; they are compared with
the kinds of the walk before (the cell's own start for ``%%gpumem``). Only walks that covered the
whole namespace count: a walk of the changed names alone cannot sum every kind, so it says nothing.
Automatic mode therefore walks the whole namespace after every cell that changed allocated memory by
at least :data:`KIND_LINE_MIN_BYTES` (and only after those: a trivial cell costs nothing more).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpumem.core.cells.record import CellRecord, KindChange
from gpumem.core.units import MIB, format_delta

__all__ = [
    "ESTIMATE",
    "KIND_LINE_MIN_BYTES",
    "KindChange",
    "Kinds",
    "kind_changes",
    "kinds_brief",
    "kinds_line",
    "kinds_since_earlier",
    "read_kinds",
    "shown_kinds",
]

KIND_LINE_MIN_BYTES = MIB  # a kind is shown in the report when it changed by at least this much
ESTIMATE = " (estimate)"  # after a kind inferred from sizes alone (workspaces the allocator's blocks did not confirm)

Kinds = tuple[tuple[str, int], ...]


def read_kinds(report: Any) -> Kinds:
    """A holders report's by-kind totals, read defensively (``kinds``: KindTotal-like objects)."""
    totals = getattr(report, "kinds", ())
    if not isinstance(totals, (list, tuple)):
        return ()
    found: list[tuple[str, int]] = []
    for total in totals:
        kind, nbytes = getattr(total, "kind", None), getattr(total, "nbytes", None)
        if isinstance(kind, str) and isinstance(nbytes, int):
            found.append((kind + ESTIMATE if getattr(total, "estimate", False) is True else kind, nbytes))
    return tuple(found)


def kind_changes(before: Kinds, after: Kinds) -> tuple[KindChange, ...]:
    """Every kind present before or after, in the walk's order (after's kinds first), changed or not; a kind
    that was an estimate on either side is labelled one."""
    old, new = _by_base(before), _by_base(after)
    estimated = {_base(kind) for kind, _ in (*before, *after) if kind.endswith(ESTIMATE)}
    order = list(new) + [kind for kind in old if kind not in new]
    return tuple(
        KindChange(kind + ESTIMATE if kind in estimated else kind, old.get(kind, 0), new.get(kind, 0)) for kind in order
    )


def _base(kind: str) -> str:
    return kind.removesuffix(ESTIMATE)


def _by_base(kinds: Kinds) -> dict[str, int]:
    return {_base(kind): nbytes for kind, nbytes in kinds}


def shown_kinds(changes: Sequence[KindChange], min_bytes: int = KIND_LINE_MIN_BYTES) -> list[KindChange]:
    """The kinds worth a word: changed by at least ``min_bytes``."""
    return [change for change in changes if abs(change.delta_bytes) >= min_bytes]


def kinds_line(changes: Sequence[KindChange], since: str) -> str:
    """``by kind (since the start of the cell): parameters +400 MiB, gradients +400 MiB``, or "" when none changed."""
    shown = shown_kinds(changes)
    if not shown:
        return ""
    parts = ", ".join(f"{_short(change.kind)} {format_delta(change.delta_bytes)}" for change in shown)
    return f"by kind ({since}): {parts}"


def kinds_brief(changes: Sequence[KindChange], limit: int = 2) -> str:
    """The ``limit`` largest kind changes for a one-line summary: ``optimizer state +8.0 MiB, gradients +4.0 MiB
    (+1 more)``; "" when none changed by :data:`KIND_LINE_MIN_BYTES`."""
    shown = sorted(shown_kinds(changes), key=lambda change: -abs(change.delta_bytes))
    if not shown:
        return ""
    text = ", ".join(f"{_short(change.kind)} {format_delta(change.delta_bytes)}" for change in shown[:limit])
    return f"{text} (+{len(shown) - limit} more)" if len(shown) > limit else text


def kinds_since_earlier(record: CellRecord) -> str:
    """``since cell [3]`` when the cell's kinds compare with a walk before the cell just before it, else "".

    Cells that change no memory are not walked, so what they moved (a tensor from a name to ``Out``) shows
    in the next walked cell's kinds: a one-line form must then say since when, as the full report does.
    """
    since = record.kinds_since
    if not record.kinds or not since or since == "since the start of the cell":
        return ""
    count = record.execution_count
    return "" if count is not None and since == f"since cell [{count - 1}]" else since


def _short(kind: str) -> str:
    """``activations (saved by autograd graphs)`` -> ``activations`` (the report is one line); an estimate
    stays labelled one."""
    return kind.split(" (", 1)[0] + (ESTIMATE if kind.endswith(ESTIMATE) else "")
