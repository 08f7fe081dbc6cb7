"""``gpumem.measure``: what ``%%gpumem`` reports for a cell, for any block of a script.

with gpumem.measure("epoch 1") as m:
    train_one_epoch()
print(m.report)          # before -> after, exact peak, host memory, warnings
gpumem.measured()        # every block measured so far, oldest first
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from gpumem.core.cells.record import CellOptions, CellRecord
from gpumem.core.cells.tracker import ActiveCell, CellTracker
from gpumem.core.monitoring.monitor import default_monitor

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Measurement", "measure", "measured"]

_lock = threading.Lock()
_tracker: CellTracker | None = None


def _script_tracker() -> CellTracker:
    global _tracker
    with _lock:
        if _tracker is None or _tracker.monitor is not default_monitor():
            _tracker = CellTracker(default_monitor(), start_sampler=True)
        return _tracker


def measured() -> tuple[CellRecord, ...]:
    """Every block measured with :func:`measure` in this process, oldest first."""
    return _script_tracker().history


class Measurement:
    """A context manager; after the block, ``record`` holds the figures and ``report`` renders them."""

    def __init__(
        self,
        label: str,
        *,
        devices: Iterable[int] | int | None = None,
        keep_peaks: bool = False,
        namespace: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(label, str) or not label.strip():
            raise ValueError("measure() needs a non-empty label naming the block, such as 'epoch 1'")
        if namespace is not None and not isinstance(namespace, Mapping):
            raise TypeError(f"measure(namespace=...) takes a mapping such as globals(), not {type(namespace).__name__}")
        self.label = label
        self.options = CellOptions(
            devices=_device_indices(devices),
            keep_peaks=bool(keep_peaks),
            attribute=namespace is not None,
            mode="magic",
        )
        self.namespace = namespace
        self.record: CellRecord | None = None
        self._active: ActiveCell | None = None

    def __enter__(self) -> Self:
        if self._active is not None:
            raise RuntimeError(
                f"the block {self.label!r} is already being measured; nest a new gpumem.measure(...) instead"
            )
        tracker = _script_tracker()
        with _lock:
            self._active = tracker.begin(self.label, options=self.options, namespace=self.namespace, concurrent=True)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        active, self._active = self._active, None
        if active is None:
            return
        tracker = _script_tracker()
        with _lock:
            try:
                self.record = tracker.end(active, error=exc, namespace=self.namespace, options=self.options)
            finally:
                if tracker.active is None:
                    tracker.release_sampler()  # a script pays for sampling only inside measured blocks

    @property
    def report(self) -> Any:
        """The record as a report: ``print`` gives text, notebooks render HTML."""
        if self.record is None:
            raise RuntimeError("the measured block has not finished yet")
        from gpumem.core.cells.report import CellReport

        return CellReport(self.record)

    def __repr__(self) -> str:
        if self.record is None:
            state = "running" if self._active is not None else "not started (use it in a with statement)"
            return f"<gpumem.measure {self.label!r}: {state}>"
        return repr(self.report)


def _device_indices(devices: Iterable[int] | int | None) -> tuple[int, ...] | None:
    if devices is None:
        return None
    listed = [devices] if isinstance(devices, int) else devices
    try:
        indices = sorted({int(device) for device in listed})
    except (TypeError, ValueError):
        raise TypeError(f"measure(devices=...) takes CUDA device indices such as [0, 1], not {devices!r}") from None
    if any(index < 0 for index in indices):
        raise ValueError(f"measure(devices=...) takes CUDA device indices (0 or more), not {devices!r}")
    return tuple(indices)


def measure(
    label: str,
    *,
    devices: Iterable[int] | int | None = None,
    keep_peaks: bool = False,
    namespace: Mapping[str, Any] | None = None,
) -> Measurement:
    """Measure a block like ``%%gpumem`` measures a cell.

    ``devices`` limits the report to those CUDA indices; ``keep_peaks`` leaves PyTorch's peak counters
    alone (by default they are reset when the block starts, which makes the peak exact but also resets
    what ``torch.cuda.max_memory_allocated()`` returns); ``namespace`` (e.g. ``globals()``) also names
    the variables that now hold more memory. Blocks may nest or run on several threads; a block that
    starts while another is measured leaves the counters alone, as with ``keep_peaks``, so that the
    outer peak stays exact.
    """
    return Measurement(label, devices=devices, keep_peaks=keep_peaks, namespace=namespace)
