"""``%gpumem summary``: PyTorch's CUDA allocator, figure by figure, each line saying what it means.

A cleaner ``torch.cuda.memory_summary()``: the counters of ``torch.cuda.memory_stats(device)``
(allocated, reserved, active, inactive split, by pool, current and peak; segments; retries, OOMs,
device mallocs and frees) plus what only the segments tell (the largest free block, what
``empty_cache()`` would return: :mod:`gpumem.core.diagnoses.fragmentation`). Nothing here initializes CUDA:
torch is only looked up in ``sys.modules`` and read only once ``torch.cuda.is_initialized()``.
A memory source with its own ``memory_stats(device)`` (a test's fake) is read instead of torch.

Under ``backend:cudaMallocAsync`` (:mod:`gpumem.core.readers.allocator_backend`) CUDA's pool does the allocating:
pools, segments, rounding and the event counters are PyTorch's own allocator's and read 0 there, so only
allocated and reserved (current and peak) are shown, worded for CUDA's pool.
"""

from __future__ import annotations

import html
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TextIO

from gpumem.core.atomic_files import replace_file
from gpumem.core.cells.formatting import STYLE
from gpumem.core.diagnoses.fragmentation import FreeReserve, expandable_segments_on, free_reserve, read_segments
from gpumem.core.readers.allocator_backend import AllocatorBackend, allocator_backend
from gpumem.core.readers.cuda_fault import fault_for, status_text
from gpumem.core.units import format_bytes

__all__ = [
    "JSON_MARKER",
    "AllocatorSummary",
    "Figure",
    "SummaryUnavailableError",
    "build_summary",
    "is_stats_export",
    "read_stats",
    "summaries",
    "write_stats_json",
]

JSON_MARKER = "gpumem_memory_stats"
JSON_VERSION = 1


class SummaryUnavailableError(Exception):
    """The allocator cannot be read here without side effects; the message says why."""


class Figure(NamedTuple):
    """One line: a label, the current and peak values (exact), and what it means."""

    key: str  # the memory_stats key without .current/.peak (e.g. "allocated_bytes.large_pool"), or a name of ours
    label: str
    current: int | None
    peak: int | None
    meaning: str
    unit: str = "bytes"  # or "count"


# (label, memory_stats key prefix, meaning): bytes, current and peak, for all / large / small pool.
_POOLED = (
    ("allocated", "allocated_bytes", "in tensors now (torch.cuda.memory_allocated), rounded up to 512 B blocks"),
    ("reserved", "reserved_bytes", "taken from CUDA by the allocator, in tensors or cached (memory_reserved)"),
    ("active", "active_bytes", "allocated, plus freed blocks still waiting for another stream's work"),
    ("inactive split", "inactive_split_bytes", "free pieces of split blocks: reusable, not returnable to CUDA"),
)
_POOLS = (("", "all"), ("  large pool", "large_pool"), ("  small pool", "small_pool"))  # indented under "all"
_POOL_MEANING = {
    "large_pool": "requests over 1 MiB; segments of 20 MiB, or the request rounded up to 2 MiB above 10 MiB",
    "small_pool": "requests of 1 MiB or less; 2 MiB segments",
}
_EXPANDABLE_POOL_MEANING = {  # expandable_segments:True: segments grow in place, page by page
    "large_pool": "requests over 1 MiB; expandable segments that grow and shrink in place",
    "small_pool": "requests of 1 MiB or less; expandable segments that grow and shrink in place",
}
# cudaMallocAsync: CUDA's pool allocates; PyTorch counts what it asked for and what the pool holds.
_ASYNC = (
    ("allocated", "allocated_bytes", "in tensors now (torch.cuda.memory_allocated)"),
    ("reserved", "reserved_bytes", "held by CUDA's memory pool for this process, in tensors or kept for reuse"),
)
# (label, key, meaning): counters of events since the process started.
_COUNTERS = (
    (
        "allocation retries",
        "num_alloc_retries",
        "cudaMalloc failed, the cache was freed and it retried (memory is tight)",
    ),
    ("out-of-memory errors", "num_ooms", "allocations that raised torch.OutOfMemoryError"),
    ("device mallocs", "num_device_alloc", "cudaMalloc (or cuMemMap) calls: each is slow and may synchronize"),
    ("device frees", "num_device_free", "cudaFree (or cuMemUnmap) calls: empty_cache() and retries cause these"),
)


def _stat(stats: Mapping[str, Any], key: str) -> int | None:
    value = stats.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _async_figures(stats: Mapping[str, Any]) -> list[Figure]:
    figures: list[Figure] = []
    for label, prefix, meaning in _ASYNC:
        current = _stat(stats, f"{prefix}.all.current")
        peak = _stat(stats, f"{prefix}.all.peak")
        if current is not None or peak is not None:
            figures.append(Figure(f"{prefix}.all", label, current, peak, meaning))
    allocated = _stat(stats, "allocated_bytes.all.current")
    reserved = _stat(stats, "reserved_bytes.all.current")
    if allocated is not None and reserved is not None:
        meaning = "reserved minus allocated: kept by CUDA's pool for reuse"
        figures.append(Figure("free_reserve", "free reserve", reserved - allocated, None, meaning))
    return figures


def _figures(stats: Mapping[str, Any], reserve: FreeReserve | None, *, expandable: bool = False) -> list[Figure]:
    figures: list[Figure] = []
    pool_meaning = _EXPANDABLE_POOL_MEANING if expandable else _POOL_MEANING
    for label, prefix, meaning in _POOLED:
        for pool_label, pool in _POOLS:
            current = _stat(stats, f"{prefix}.{pool}.current")
            peak = _stat(stats, f"{prefix}.{pool}.peak")
            if current is None and peak is None:
                continue
            text = meaning if pool == "all" else pool_meaning[pool]
            figures.append(Figure(f"{prefix}.{pool}", pool_label or label, current, peak, text))
    allocated = _stat(stats, "allocated_bytes.all.current")
    reserved = _stat(stats, "reserved_bytes.all.current")
    if allocated is not None and reserved is not None:
        meaning = "reserved minus allocated: cached for reuse"
        figures.append(Figure("free_reserve", "free reserve", reserved - allocated, None, meaning))
    if reserve is not None:
        figures += [
            Figure(
                "largest_free_block",
                "largest free block",
                reserve.largest_free_bytes,
                None,
                "the largest request over 1 MiB the reserve serves without a new cudaMalloc (from the segments)",
            ),
            Figure(
                "releasable",
                "empty_cache() frees",
                reserve.releasable_bytes,
                None,
                "what torch.cuda.empty_cache() would return to CUDA now: segments with no live block",
            ),
        ]
    for pool_label, pool in _POOLS:
        current = _stat(stats, f"segment.{pool}.current")
        peak = _stat(stats, f"segment.{pool}.peak")
        if current is not None or peak is not None:
            meaning = "chunks reserved from CUDA" if pool == "all" else pool_meaning[pool]
            figures.append(Figure(f"segment.{pool}", pool_label or "segments", current, peak, meaning, "count"))
    for label, key, meaning in _COUNTERS:
        value = _stat(stats, key)
        if value is not None:
            figures.append(Figure(key, label, value, None, meaning, "count"))
    return figures


class AllocatorSummary:
    """One device's allocator figures (exact, in :attr:`figures`) and the table that shows them."""

    def __init__(
        self,
        device: int,
        stats: Mapping[str, Any],
        reserve: FreeReserve | None,
        backend: AllocatorBackend | None = None,
    ) -> None:
        self.device = device
        self.stats = dict(stats)
        self.reserve = reserve
        self.backend = backend if backend is not None else allocator_backend()
        if self.backend.native:
            expandable = (reserve is not None and reserve.expandable) or expandable_segments_on()
            self.figures = _figures(stats, reserve, expandable=expandable)
        else:
            self.figures = _async_figures(stats)

    @property
    def title(self) -> str:
        return f"gpumem summary of cuda:{self.device} ({self.backend.title})"

    def figure(self, key: str) -> Figure:
        """The figure of ``key`` (``"allocated_bytes.all"``, ``"num_ooms"``; KeyError if not reported)."""
        for figure in self.figures:
            if figure.key == key:
                return figure
        raise KeyError(key)

    def notes(self) -> list[str]:
        fault = fault_for(self.device)
        if fault is not None:  # the counters still read, but the device cannot be used until a restart
            return [f"{status_text(fault)}: these are PyTorch's last counts, not memory it can use."]
        if not self.backend.native:
            setting = f"{self.backend.variable}={self.backend.setting}" if self.backend.variable else "its setting"
            return [
                (
                    f"CUDA's pool allocates here ({setting}): PyTorch's pools, segments, 512 B rounding, "
                    "fragmentation and event counters do not apply, so only allocated and reserved are shown."
                )
            ]
        notes = []
        if self.reserve is None:
            notes.append("The segments could not be read, so the largest free block is not shown.")
        missing = [label for label, key, _ in _COUNTERS if _stat(self.stats, key) is None]
        if missing:
            notes.append(f"This PyTorch does not count: {', '.join(missing)}.")
        if not self.stats:
            notes.append("The allocator reported no statistics (an allocator other than the caching one?).")
        return notes

    def _rows(self) -> list[list[str]]:
        return [[f.label, _value(f.current, f.unit), _value(f.peak, f.unit), f.meaning] for f in self.figures]

    def __repr__(self) -> str:
        table = [["", "current", "peak", ""], *self._rows()]
        widths = [max(len(row[i]) for row in table) for i in range(3)]
        lines = [self.title]
        for label, current, peak, meaning in table:
            line = f"  {label.ljust(widths[0])}  {current.rjust(widths[1])}  {peak.rjust(widths[2])}  {meaning}"
            lines.append(line.rstrip())
        lines.extend(self.notes())
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(value)}</td>" for value in row) + "</tr>" for row in self._rows()
        )
        notes = "".join(f"<p>{html.escape(note)}</p>" for note in self.notes())
        title = self.title
        return (
            f"{STYLE}<div class='gpumem-report'><b>{html.escape(title)}</b><table><thead><tr><th></th>"
            f"<th>current</th><th>peak</th><th></th></tr></thead><tbody>{body}</tbody></table>{notes}</div>"
        )


def _value(value: int | None, unit: str) -> str:
    if value is None:
        return ""
    return f"{value:,}" if unit == "count" else format_bytes(value)


def build_summary(stats: Mapping[str, Any], device: int, segments: Sequence[Any] | None) -> AllocatorSummary:
    """The summary of ``memory_stats`` for ``device``; ``segments`` from ``memory_snapshot()`` (None: unread)."""
    reserve = None
    if segments is not None:
        reserve = free_reserve(segments).get(device) or FreeReserve(device, 0, 0, 0, 0, 0, 0, 0, 0, 0, expandable=False)
    return AllocatorSummary(device, stats, reserve)


def read_stats(source: Any, device: int) -> dict[str, Any]:
    """``memory_stats(device)``, never initializing CUDA; SummaryUnavailableError says why not."""
    own = getattr(source, "memory_stats", None)
    if callable(own):
        return dict(own(device))
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if torch is None or cuda is None:
        raise SummaryUnavailableError("PyTorch is not imported in this process")
    if not cuda.is_initialized():
        built = getattr(getattr(torch, "version", None), "cuda", None) is not None
        why = "no tensor has been put on a GPU yet" if built else "this PyTorch build has no CUDA support"
        raise SummaryUnavailableError(f"CUDA is not initialized in this process ({why}); nothing to summarize")
    count = int(cuda.device_count())
    if not 0 <= device < count:
        raise SummaryUnavailableError(f"no such device cuda:{device}; this process sees {count} CUDA device(s)")
    stats: dict[str, Any] = cuda.memory_stats(device)
    return stats


def summaries(source: Any, devices: Sequence[int]) -> list[AllocatorSummary]:
    """The summary of each device (segments read once, for all of them; none under cudaMallocAsync)."""
    stats = [read_stats(source, device) for device in devices]
    segments = read_segments(source) if allocator_backend().native else None
    return [build_summary(found, device, segments) for found, device in zip(stats, devices, strict=True)]


def write_stats_json(
    stats: Mapping[int, Mapping[str, Any]], path: str | os.PathLike[str], *, force: bool = False
) -> bool:
    """``{"gpumem_memory_stats": 1, "devices": {"0": {...}}}`` to ``path``, atomically; True if it replaced one."""

    def write(handle: TextIO) -> None:
        devices = {str(device): dict(found) for device, found in stats.items()}
        json.dump({JSON_MARKER: JSON_VERSION, "devices": devices}, handle, indent=1, sort_keys=False)
        handle.write("\n")

    return replace_file(path, write, recognise=is_stats_export, force=force)


def is_stats_export(start: bytes) -> bool:
    text = start.decode("utf-8", errors="replace").lstrip()
    return re.match(r'\{\s*"' + JSON_MARKER + r'"\s*:', text) is not None
