"""What one measured cell did to memory: its record, how a cell is measured and named, its status.

Nothing here measures; :mod:`gpumem.core.cells.tracker` fills the records in. A cell's record is the record
of any measured block (:class:`~gpumem.core.monitoring.spans.SpanRecord`, here also named ``CellRecord``):
the figures of its stretch (:class:`~gpumem.core.monitoring.spans.DeviceChange`,
:class:`~gpumem.core.monitoring.spans.HostChange`) and what only a cell has.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from gpumem.core.monitoring.spans import (
    STATUS_ERROR,
    STATUS_INTERRUPTED,
    STATUS_OK,
    STATUS_OUT_OF_MEMORY,
    STATUSES,
    CellWarning,
    DeviceChange,
    HostChange,
    KindChange,
    SpanRecord,
    VariableChange,
    classify_error,
)

__all__ = [
    "STATUSES",
    "STATUS_ERROR",
    "STATUS_INTERRUPTED",
    "STATUS_OK",
    "STATUS_OUT_OF_MEMORY",
    "CellOptions",
    "CellRecord",
    "CellWarning",
    "DeviceChange",
    "HeldVariable",
    "HostChange",
    "KindChange",
    "VariableChange",
    "classify_error",
    "first_line_of",
    "source_key",
]


CellRecord = SpanRecord  # a cell's record is a measured block's: one type for cells, blocks, scopes and tags


class CellOptions(NamedTuple):
    """How to measure one cell."""

    devices: tuple[int, ...] | None = None  # None: every device in use
    keep_peaks: bool = False
    attribute: bool | None = None  # None: only when CUDA allocated memory changed by attribute_threshold_bytes
    mode: str = "auto"
    quiet: bool = False


class HeldVariable(NamedTuple):
    """The part of a holder report the tracker uses (independent of the holders module's classes)."""

    name: str
    type_name: str
    device: str
    nbytes: int
    graph_paths: tuple[str, ...]
    hidden: bool
    graph_saved_bytes: int = 0  # activations only this name's autograd graphs keep (not in nbytes)
    gradient_bytes: int = 0  # the part of nbytes that is parameters' .grad


def first_line_of(source: str, limit: int = 80) -> str:
    """The first non-blank line of a cell that is not a cell magic's header, shortened for tables."""
    lines = [line.strip() for line in source.splitlines() if line.strip()]
    code = [line for line in lines if not line.startswith("%%")]
    text = (code or lines or [""])[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def source_key(source: str) -> str:
    """Identifies a cell's source across re-runs, ignoring trailing spaces and blank lines around it."""
    normal = "\n".join(line.rstrip() for line in source.strip("\n").splitlines()).strip()
    return hashlib.blake2b(normal.encode("utf-8", "replace"), digest_size=8).hexdigest()
