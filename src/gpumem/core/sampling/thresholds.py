"""Alerts when a device fills up: once per crossing, re-armed only after use falls back below a lower mark.

The check runs on the sampler thread on every sample (a few comparisons); what to do about a crossing
(a warning, a checkpoint) runs on one separate daemon thread, in order, so that a slow callback never
delays sampling and never runs while the sampler holds its locks.
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable
from typing import NamedTuple

from gpumem.core.readers.readings import Snapshot
from gpumem.core.units import format_bytes

__all__ = [
    "DEFAULT_WARN_FRACTION",
    "GpuMemoryWarning",
    "ThresholdEvent",
    "ThresholdWatch",
    "Thresholds",
    "warn_about",
]

DEFAULT_WARN_FRACTION = 0.9
REARM_MARGIN = 0.05  # the default hysteresis: re-arm 5 points of capacity below the threshold


class GpuMemoryWarning(UserWarning):
    """A device crossed a memory threshold (gpumem's default: 90% of its capacity)."""


class ThresholdEvent(NamedTuple):
    """One crossing: the figures of the sample that crossed."""

    device: int
    threshold: float  # fraction of capacity
    fraction: float  # use / capacity at the crossing
    used_bytes: int  # NVML: every process on the device (what runs out); else this process's reserved
    total_bytes: int
    allocated_bytes: int | None  # this process's tensors, when its allocator is readable
    reserved_bytes: int | None
    measure: str  # "device use (NVML, all processes)" or "PyTorch reserved (this process)"
    wall_time_s: float

    def describe(self) -> str:
        return (
            f"cuda:{self.device} is {self.fraction:.0%} full ({format_bytes(self.used_bytes)} of "
            f"{format_bytes(self.total_bytes)}, {self.measure}), past the {self.threshold:.0%} threshold"
        )


def warn_about(event: ThresholdEvent) -> None:
    """The default action: one warning per crossing, saying what to do."""
    tensors = f"; this process's tensors: {format_bytes(event.allocated_bytes)}" if event.allocated_bytes else ""
    message = (
        f"gpumem: {event.describe()}{tensors}. Free what you no longer need (del, gpumem.free()), "
        f"lower the batch size, or save a checkpoint before an out-of-memory error."
    )
    # warn_explicit with no registry: a second crossing with the same figures is still shown.
    warnings.warn_explicit(message, GpuMemoryWarning, "gpumem", 0)


Callback = Callable[[ThresholdEvent], object]


class ThresholdWatch:
    """One threshold on every device: fires when use reaches ``fraction``, re-arms below ``rearm``."""

    def __init__(self, fraction: float, callback: Callback, rearm: float | None = None) -> None:
        _check_fraction("threshold", fraction)
        rearm = fraction - REARM_MARGIN if rearm is None else rearm
        _check_fraction("rearm", rearm, allow_zero=True)
        if rearm >= fraction:
            raise ValueError(f"rearm ({rearm}) must be below the threshold ({fraction}) so that it can fire again")
        self.fraction, self.rearm, self.callback = fraction, rearm, callback
        self._armed: dict[int, bool] = {}

    def crossed(self, device: int, fraction: float) -> bool:
        """Whether this reading is a new crossing (and disarm until use falls below ``rearm``)."""
        armed = self._armed.get(device, True)
        if armed and fraction >= self.fraction:
            self._armed[device] = False
            return True
        if not armed and fraction < self.rearm:
            self._armed[device] = True
        return False


def _check_fraction(name: str, value: object, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} is a fraction of device capacity such as 0.9, not {value!r}")
    low_ok = value >= 0 if allow_zero else value > 0
    if not (low_ok and value <= 1):
        raise ValueError(f"{name} is a fraction of device capacity between 0 and 1, not {value!r}")


class Thresholds:
    """The watches of one monitor; :meth:`listen` is its sampler listener."""

    def __init__(self, capacity: Callable[[int], int | None]) -> None:
        self._capacity = capacity  # total bytes of a CUDA index when NVML is not readable
        self._lock = threading.Lock()
        self._watches: list[ThresholdWatch] = []
        self._default: ThresholdWatch | None = None
        self._queue: queue.SimpleQueue[tuple[Callback, ThresholdEvent] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self.errors: list[str] = []  # callbacks that raised, as text (never raised into the sampler)

    def warn_at(self, fraction: float | None) -> None:
        """The default warning's threshold; None removes it."""
        with self._lock:
            if self._default is not None and self._default in self._watches:
                self._watches.remove(self._default)
            self._default = ThresholdWatch(fraction, warn_about) if fraction is not None else None
            if self._default is not None:
                self._watches.append(self._default)

    def add(self, watch: ThresholdWatch) -> None:
        """A user's threshold; the first one replaces the default warning (call ``warn_at`` to keep it)."""
        with self._lock:
            if self._default is not None and self._default in self._watches:
                self._watches.remove(self._default)
                self._default = None
            self._watches.append(watch)

    def remove(self, watch: ThresholdWatch) -> None:
        with self._lock:
            if watch in self._watches:
                self._watches.remove(watch)

    @property
    def watches(self) -> tuple[ThresholdWatch, ...]:
        with self._lock:
            return tuple(self._watches)

    def listen(self, snapshot: Snapshot) -> None:
        """The sampler's listener."""
        self.check(snapshot)

    def check(self, snapshot: Snapshot) -> list[ThresholdEvent]:
        """Compare one sample with every watch; crossings are queued for the worker thread."""
        with self._lock:
            watches = list(self._watches)
        if not watches:
            return []
        events = []
        for event_base in self._readings(snapshot):
            for watch in watches:
                if watch.crossed(event_base.device, event_base.fraction):
                    event = event_base._replace(threshold=watch.fraction)
                    events.append(event)
                    self._dispatch(watch.callback, event)
        return events

    def _readings(self, snapshot: Snapshot) -> list[ThresholdEvent]:
        found: dict[int, ThresholdEvent] = {}
        for device in snapshot.devices:
            if device.total_bytes > 0:
                allocator = snapshot.allocator_for(device.device)
                found[device.device] = ThresholdEvent(
                    device.device, 0.0, device.used_bytes / device.total_bytes, device.used_bytes,
                    device.total_bytes, allocator.allocated_bytes if allocator else None,
                    allocator.reserved_bytes if allocator else None,
                    "device use (NVML, all processes)", snapshot.wall_time_s,
                )  # fmt: skip
        for reading in snapshot.allocator:
            total = None if reading.device in found else self._capacity(reading.device)
            if total:
                found[reading.device] = ThresholdEvent(
                    reading.device, 0.0, reading.reserved_bytes / total, reading.reserved_bytes, total,
                    reading.allocated_bytes, reading.reserved_bytes, "PyTorch reserved (this process)",
                    snapshot.wall_time_s,
                )  # fmt: skip
        return list(found.values())

    def _dispatch(self, callback: Callback, event: ThresholdEvent) -> None:
        with self._lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="gpumem-thresholds", daemon=True)
                self._worker.start()
        self._queue.put((callback, event))

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            callback, event = item
            try:
                callback(event)
            except Exception as error:
                self.errors.append(f"threshold callback {callback!r} failed: {type(error).__name__}: {error}")

    def stop(self, timeout_s: float = 2.0) -> None:
        """Run what is queued, then end the callback thread (the sampler stopped: nothing more will come)."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None and worker.is_alive():
            self._queue.put(None)
            if worker is not threading.current_thread():
                worker.join(timeout_s)

    def drain(self, timeout_s: float = 5.0) -> None:
        """Wait until every queued callback has run (tests, and before a script exits)."""
        done = threading.Event()
        self._queue.put((lambda _event: done.set(), ThresholdEvent(-1, 0, 0, 0, 0, None, None, "", 0.0)))
        with self._lock:
            worker = self._worker
        if worker is not None and worker.is_alive():
            done.wait(timeout_s)
        else:
            self._work_pending()

    def _work_pending(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                callback, event = item
                if event.device >= 0:
                    try:
                        callback(event)
                    except Exception as error:
                        self.errors.append(f"threshold callback failed: {type(error).__name__}: {error}")
