"""What one measured cell did to memory: the immutable records the tracker keeps, and how a cell is named.

Nothing here measures; :mod:`gpumem.core.cells.tracker` fills these in, with the figures of a measured
stretch (:class:`~gpumem.core.monitoring.spans.DeviceChange`, :class:`~gpumem.core.monitoring.spans.HostChange`).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from gpumem.core.monitoring.spans import DeviceChange, HostChange  # a cell's figures are a measured stretch's

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


STATUS_OK = "ok"
STATUS_ERROR = "error"
STATUS_INTERRUPTED = "interrupted"
STATUS_OUT_OF_MEMORY = "out of memory"
STATUSES = (STATUS_OK, STATUS_ERROR, STATUS_INTERRUPTED, STATUS_OUT_OF_MEMORY)

_ERROR_LIMIT = 200  # characters of an error's description kept in a record


class VariableChange(NamedTuple):
    """A name that holds CUDA memory after the cell and is new, or holds more than before."""

    name: str
    type_name: str
    device: str
    nbytes: int
    previous_bytes: int | None  # None: not holding CUDA memory at the last attribution
    hidden: bool  # one of IPython's own references (Out, _N, the last exception)

    @property
    def grown_bytes(self) -> int:
        return self.nbytes - (self.previous_bytes or 0)


class CellWarning(NamedTuple):
    """Something the user should act on; ``kind``: leak, graph, staircase, output-cache, peak-reset, capacity,
    fragmentation."""

    kind: str
    message: str


class KindChange(NamedTuple):
    """One kind (as :data:`gpumem.core.holders.model` names them) before and after a cell."""

    kind: str
    before_bytes: int
    after_bytes: int

    @property
    def delta_bytes(self) -> int:
        return self.after_bytes - self.before_bytes


class CellRecord(NamedTuple):
    """What one measured cell did to memory. Immutable; the tracker keeps a bounded history of them."""

    serial: int  # 1-based position among this session's measured cells
    execution_count: int | None
    first_line: str
    source_hash: str
    started_wall_s: float
    duration_s: float
    status: str
    error: str | None
    devices: tuple[DeviceChange, ...]
    host: HostChange | None
    variables: tuple[VariableChange, ...]
    variables_note: str  # what the variable list means, or why there is none
    warnings: tuple[CellWarning, ...]
    cuda_note: str | None  # why no CUDA device is reported, when none is
    keep_peaks: bool
    mode: str  # "magic" (asked for with %%gpumem) or "auto"
    quiet: bool
    kinds: tuple[KindChange, ...] = ()  # by kind, from the cell's holder walk; empty when none covered it all
    kinds_since: str = ""  # what ``kinds`` compares with: "since the start of the cell", "since cell [3]"
    notes: tuple[str, ...] = ()  # findings worth knowing that call for no action (not warnings)

    def largest_change_bytes(self) -> int:
        """The biggest absolute change of any figure (CUDA allocated/reserved/peak, host RSS)."""
        largest = 0
        for change in self.devices:
            largest = max(
                largest,
                abs(change.allocated_delta_bytes),
                abs(change.reserved_delta_bytes),
                change.peak_above_start_bytes,
            )
        return largest if self.host is None else max(largest, abs(self.host.rss_delta_bytes))


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


def classify_error(error: BaseException | None) -> tuple[str, str | None]:
    """(status, one-line description). Recognises torch's OutOfMemoryError without importing torch."""
    if error is None:
        return STATUS_OK, None
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    description = f"{type(error).__name__}: {text}" if text else type(error).__name__
    if len(description) > _ERROR_LIMIT:
        description = description[: _ERROR_LIMIT - 1] + "…"
    if isinstance(error, KeyboardInterrupt):
        return STATUS_INTERRUPTED, description
    if _is_out_of_memory(error):
        return STATUS_OUT_OF_MEMORY, description
    return STATUS_ERROR, description


def _is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, MemoryError):
        return True
    for cls in type(error).__mro__:
        if cls.__name__ == "OutOfMemoryError" and cls.__module__.split(".")[0] == "torch":
            return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error)[:300].lower()
