"""What a cell's figures say the user should act on: its warnings.

Each check is a function of the figures; the one thing kept between cells is :class:`RerunLog`, the
growth of each cell's recent runs, which the leak-on-re-run check reads. Conditions of a device that
outlast the cell (nearly full, fragmented) are :mod:`~gpumem.core.cells.conditions`'.
"""

from __future__ import annotations

import re
import statistics
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence

from gpumem.core.cells.record import STATUS_OK, CellWarning, DeviceChange, VariableChange
from gpumem.core.holders.model import MAX_GRAPH_PATHS
from gpumem.core.monitoring.peaks import PEAK_RESET_NOTE
from gpumem.core.units import format_bytes, format_delta

__all__ = [
    "HOST",
    "RerunLog",
    "graph_warning",
    "host_leak_warning",
    "leak_warnings",
    "output_cache_warning",
    "peak_reset_warnings",
    "variable_warnings",
]

_REMEMBERED_CELLS = 1_000  # sources whose runs the leak check keeps
_SHOWN_PATHS = 3  # graph-holding paths (or groups of them) named in the warning
_GROUPED_FROM = 3  # consecutive elements of one container shown as a range
_INDEXED = re.compile(r"^(.*)\[(-?\d+)\]$")
HOST = -1  # the key of host RSS growth in a run's growth figures (CUDA devices are 0, 1, ...)
_OUTLIVES = "something it creates outlives the cell (a list it appends to, a cache, or IPython's Out history)"


def peak_reset_warnings(devices: Sequence[DeviceChange]) -> list[CellWarning]:
    return [
        CellWarning("peak-reset", f"cuda:{change.device}: {PEAK_RESET_NOTE}")
        for change in devices
        if change.peak_note == PEAK_RESET_NOTE
    ]


class RerunLog:
    """Per cell source (:func:`~gpumem.core.cells.record.source_key`): how often it ran, and how much
    each of its recent successful runs grew each device's allocated memory and host RSS (key :data:`HOST`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: OrderedDict[str, deque[dict[int, int]]] = OrderedDict()
        self._counts: dict[str, int] = {}

    def add(
        self, key: str, devices: Sequence[DeviceChange], status: str, keep: int, host_bytes: int | None = None
    ) -> tuple[int, list[dict[int, int]] | None]:
        """Count one run; returns how often ``key`` ran and the growth of its last ``keep`` successful
        runs, this one included (None when this run failed or measured nothing: it does not count).
        ``host_bytes``: how much the run grew host RSS, None when unknown."""
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1
            total = self._counts[key]
            if status != STATUS_OK or (not devices and host_bytes is None):
                return total, None
            runs = self._runs.get(key)
            if runs is None:
                runs = deque(maxlen=max(2, keep))
                self._runs[key] = runs
                if len(self._runs) > _REMEMBERED_CELLS:
                    stale, _ = self._runs.popitem(last=False)
                    self._counts.pop(stale, None)
            else:
                self._runs.move_to_end(key)
            growth = {change.device: change.allocated_delta_bytes for change in devices}
            if host_bytes is not None:
                growth[HOST] = host_bytes
            runs.append(growth)
            return total, list(runs)[-keep:]

    def clear(self) -> None:
        with self._lock:
            self._runs.clear()
            self._counts.clear()


def leak_warnings(
    devices: Sequence[DeviceChange],
    recent: Sequence[dict[int, int]],
    runs_total: int,
    *,
    runs: int,
    min_bytes: int,
    tolerance: float,
) -> list[CellWarning]:
    """A device whose allocated memory grew alike (within ``tolerance`` of the median, by at least
    ``min_bytes``) in each of the last ``runs`` runs of the same cell."""
    if len(recent) < runs:
        return []
    warnings: list[CellWarning] = []
    for change in devices:
        warning = _leak_warning(recent, change.device, runs_total, runs, min_bytes, tolerance)
        if warning is not None:
            warnings.append(warning)
    return warnings


def host_leak_warning(
    recent: Sequence[dict[int, int]], runs_total: int, *, runs: int, min_bytes: int, tolerance: float
) -> CellWarning | None:
    """Host RSS that grew alike (within ``tolerance``, by at least ``min_bytes``) in each of the last ``runs`` runs."""
    if len(recent) < runs:
        return None
    return _leak_warning(recent, HOST, runs_total, runs, min_bytes, tolerance)


def _leak_warning(
    recent: Sequence[dict[int, int]], key: int, runs_total: int, runs: int, min_bytes: int, tolerance: float
) -> CellWarning | None:
    growth = [delta for delta in (run.get(key) for run in recent) if delta is not None]
    if len(growth) < runs or min(growth) < min_bytes:
        return None
    typical = statistics.median(growth)
    if max(growth) - min(growth) > tolerance * typical:
        return None
    what = "host memory (RSS)" if key == HOST else f"cuda:{key} allocated memory"
    each = ", ".join(format_delta(d) for d in growth)
    return CellWarning(
        "leak",
        f"possible leak on re-run: this cell has run {runs_total} times and each of the last "
        f"{len(growth)} runs left {what} higher by about {format_bytes(typical)} ({each}); {_OUTLIVES}",
    )


def variable_warnings(
    changes: Sequence[VariableChange], graph_paths: Sequence[str], graph_saved_bytes: int = 0
) -> list[CellWarning]:
    """Autograd graphs kept alive by variables, and values IPython itself keeps (``Out``, ``_N``)."""
    warnings = [graph_warning(graph_paths, graph_saved_bytes)] if graph_paths else []
    hidden = [change.name for change in changes if change.hidden]
    if hidden:
        warnings.append(output_cache_warning(hidden))
    return warnings


def output_cache_warning(names: Sequence[str]) -> CellWarning:
    return CellWarning(
        "output-cache",
        f"IPython keeps references to {', '.join(names)}: end the cell with ';' or use %gpumem free --deep",
    )


def graph_warning(paths: Sequence[str], saved_bytes: int = 0) -> CellWarning:
    """``saved_bytes``: the activations only these graphs keep (0: not known, not said)."""
    groups = _group_indexed_paths(paths)
    shown = ", ".join(groups[:_SHOWN_PATHS])
    more = f" and {len(groups) - _SHOWN_PATHS} more" if len(groups) > _SHOWN_PATHS else ""
    what = (
        "keeps its whole autograd graph alive (a CUDA tensor with a grad_fn)"
        if len(paths) == 1
        else "keep their whole autograd graphs alive (CUDA tensors with a grad_fn)"
    )
    if saved_bytes > 0:
        what += f", {format_bytes(saved_bytes)} of saved activations"
    return CellWarning(
        "graph", f"{shown}{more} {what}: store `.item()` for a number or `.detach()` for a tensor instead"
    )


def _group_indexed_paths(paths: Sequence[str]) -> list[str]:
    """``losses[0]``, ``losses[1]``, ``losses[2]`` -> ``losses[0]`` ... ``losses[2]`` (3 elements)."""
    groups: list[tuple[str, list[str]]] = []
    for path in paths:
        match = _INDEXED.match(path)
        prefix = match.group(1) if match else None
        if prefix is not None and groups and groups[-1][0] == prefix:
            groups[-1][1].append(path)
        else:
            groups.append((prefix if prefix is not None else "\0" + path, [path]))
    shown: list[str] = []
    for _prefix, members in groups:
        if len(members) >= _GROUPED_FROM:
            # The walk keeps one path past MAX_GRAPH_PATHS for a name: that one says there are more.
            more = len(members) > MAX_GRAPH_PATHS
            count = f"more than {MAX_GRAPH_PATHS}" if more else str(len(members))
            last = members[MAX_GRAPH_PATHS - 1] if more else members[-1]
            shown.append(f"`{members[0]}` … `{last}` ({count} elements)")
        else:
            shown.extend(f"`{member}`" for member in members)
    return shown
