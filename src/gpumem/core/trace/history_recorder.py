"""Recording PyTorch's allocation history while one cell runs, and putting the user's setting back.

torch is only looked up in ``sys.modules``: with no torch imported there is nothing to record. If
the user already records (``torch._C._cuda_isHistoryEnabled()``) their setting and their entries
are left alone and the cell's part of their history is read: what follows their newest entry as the
cell started (a snapshot then, taken only in that case);
otherwise recording is switched on with stacks of Python frames, for allocations only
(``context="alloc"``), in a ring buffer of ``max_entries`` events, and off again after the cell,
which also frees the buffer. Where torch can skip actions (``skip_actions``, 2.9 and later), the
events the analysis never reads are not recorded: ``free_completed`` (a free counts when it is
requested, where ``memory_allocated`` drops), segment and snapshot events; that saves a third of the
entries of a training loop and their share of the snapshot. With ``--trace-save`` everything is
recorded, since PyTorch's memory_viz draws from those events.

The snapshot, millions of small dicts for a long cell, is taken with Python's cyclic garbage
collector paused: none of them can form a cycle, and the collector would otherwise walk the growing
heap again and again while torch builds it.
"""

from __future__ import annotations

import inspect
import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from gpumem.core.atomic_files import write_file
from gpumem.core.gc_pause import collector_paused
from gpumem.core.readers.allocator_backend import not_native_reason
from gpumem.core.readers.cuda_fault import cuda_faults, status_text
from gpumem.core.readers.torch_state import no_torch_reason

__all__ = ["DEFAULT_MAX_ENTRIES", "SKIPPED_ACTIONS", "CellSnapshot", "TraceRecorder", "save_snapshot"]

# PyTorch documents "several KB" per recorded event with stacks: 100,000 events stay within a few
# hundred MB of host memory in the worst case, and hold a 300-step training loop of a small model.
DEFAULT_MAX_ENTRIES = 100_000

# Trace actions the analysis never reads (it needs alloc, free_requested and oom).
SKIPPED_ACTIONS = ("free_completed", "segment_alloc", "segment_free", "snapshot")


@dataclass
class CellSnapshot:
    """The allocator snapshot taken as the cell ended, and how to read the cell's part of it."""

    snapshot: dict[str, Any]
    first_entry: dict[int, int]  # per device, the index of the cell's first trace entry (absent: 0)
    user_recording: bool
    truncated: list[int]  # devices whose oldest events may have been dropped
    max_entries: int | None


class _Memory(NamedTuple):
    """The three PyTorch calls used: underscored, but documented as the memory snapshot API."""

    record: Callable[..., None]
    snapshot: Callable[[], dict[str, Any]]
    enabled: Callable[[], bool] | None  # torch._C._cuda_isHistoryEnabled, where it exists


def _memory_api() -> tuple[_Memory | None, str | None]:
    """PyTorch's memory-history calls, or why the cell cannot be traced."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None, no_torch_reason("trace this one")
    faults = cuda_faults()
    if faults:  # recording would call CUDA, which fails there until a restart
        return None, "; ".join(status_text(fault) for fault in faults.values())
    memory = getattr(getattr(torch, "cuda", None), "memory", None)
    record = getattr(memory, "_record_memory_history", None)
    snapshot = getattr(memory, "_snapshot", None)
    if record is None or snapshot is None or "max_entries" not in _parameters(record):
        version = getattr(torch, "__version__", "?")
        return None, f"PyTorch {version} is too old to record allocation history (2.1 or later is needed)"
    try:
        available = bool(torch.cuda.is_available())
    except Exception:
        available = False
    if not available:
        return None, "no CUDA device is available to PyTorch (torch.cuda.is_available() is False)"
    other = not_native_reason("allocation sites")  # cudaMallocAsync records no history
    if other is not None:
        return None, other
    enabled = getattr(getattr(torch, "_C", None), "_cuda_isHistoryEnabled", None)
    return _Memory(record, snapshot, enabled), None


def _parameters(function: Callable[..., Any]) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return ()


class TraceRecorder:
    """``start()`` before the cell, ``stop()`` after it; ``stop()`` always restores the user's setting."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, *, every_action: bool = False) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be 1 or more, not {max_entries}")
        self.max_entries = max_entries
        self.every_action = every_action  # record the actions the analysis skips too (for memory_viz)
        self.skipped: tuple[str, ...] = ()  # the actions not recorded during the cell
        self._memory: _Memory | None = None
        self._enabled_here = False
        self._markers: dict[int, tuple[Any, ...]] | None = None  # the user's last entries as the cell started

    def start(self) -> str | None:
        """Start recording; returns None, or why the cell cannot be traced (one sentence)."""
        memory, reason = _memory_api()
        if memory is None:
            return reason
        try:
            was_recording = self._history_enabled(memory)
        except Exception as error:
            return f"PyTorch could not say whether it records already: {type(error).__name__}: {error}"
        if was_recording:
            with collector_paused():
                self._markers = _last_entries(memory.snapshot())
        else:
            self._markers = None
            options: dict[str, Any] = {"enabled": "all", "context": "alloc", "stacks": "python"}
            if not self.every_action and "skip_actions" in _parameters(memory.record):
                options["skip_actions"] = list(SKIPPED_ACTIONS)
            try:
                memory.record(**options, max_entries=self.max_entries)
                self.skipped = tuple(options.get("skip_actions", ()))
            except Exception as error:
                return f"PyTorch could not start recording: {type(error).__name__}: {error}"
            self._enabled_here = True
        self._memory = memory
        return None

    @staticmethod
    def _history_enabled(memory: _Memory) -> bool:
        if memory.enabled is not None:
            return bool(memory.enabled())
        return any(memory.snapshot().get("device_traces") or ())

    @property
    def recording(self) -> bool:
        return self._memory is not None

    def abandon(self) -> None:
        """Stop recording without reading a snapshot (a user's own recording stays on)."""
        memory, self._memory, self._markers = self._memory, None, None
        if memory is not None and self._enabled_here:
            self._enabled_here = False
            memory.record(enabled=None)

    def stop(self) -> CellSnapshot | None:
        """The snapshot of the cell; recording is off again if it was off before. None if not started."""
        memory, self._memory = self._memory, None
        if memory is None:
            return None
        try:
            with collector_paused():
                snapshot = memory.snapshot()
        finally:
            if self._enabled_here:
                self._enabled_here = False
                memory.record(enabled=None)
        markers, self._markers = self._markers, None
        first_entry: dict[int, int] = {}
        truncated = []
        for device, entries in enumerate(snapshot.get("device_traces") or ()):
            if markers is None:
                if len(entries) >= self.max_entries:
                    truncated.append(device)
                continue
            marker = markers.get(device)
            position = _find(entries, marker) if marker is not None else -1
            if marker is not None and position < 0:
                truncated.append(device)  # the user's ring buffer went round during the cell
            first_entry[device] = position + 1
        return CellSnapshot(
            snapshot=snapshot,
            first_entry=first_entry,
            user_recording=markers is not None,
            truncated=truncated,
            max_entries=None if markers is not None else self.max_entries,
        )


def _key(entry: dict[str, Any]) -> tuple[Any, ...]:
    return (entry.get("action"), entry.get("addr"), entry.get("size"), entry.get("time_us"))


def _last_entries(snapshot: dict[str, Any]) -> dict[int, tuple[Any, ...]]:
    """Per device, the identity of the newest trace entry: the cell's part of the history follows it."""
    return {device: _key(entries[-1]) for device, entries in enumerate(snapshot.get("device_traces") or ()) if entries}


def _find(entries: list[dict[str, Any]], marker: tuple[Any, ...]) -> int:
    for position in range(len(entries) - 1, -1, -1):
        if _key(entries[position]) == marker:
            return position
    return -1


def save_snapshot(snapshot: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Pickle ``snapshot`` to ``path`` as ``torch.cuda.memory._dump_snapshot`` does, atomically."""
    target = Path(path).expanduser()
    write_file(target, lambda handle: pickle.dump(snapshot, handle), binary=True)
    return target
