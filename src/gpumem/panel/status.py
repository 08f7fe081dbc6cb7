"""The status bar's figures, taken from the shared monitor's snapshots.

The payload's shape is the front end's ``IStatusPayload`` (``js/src/protocol.ts``)::

    {"devices": [{"index": 0, "name": "NVIDIA H200", "allocated_bytes": 1, "reserved_bytes": 2,
                  "total_bytes": 3}],
     "host": {"rss_bytes": 4}, "cuda_in_use": true}

While the status bar is shown, a :class:`StatusReader` listens to the default monitor's sampler: when
the sampler runs (a panel is shown, cells are measured) the payload is the newest sample, read by the
sampler and by no one else. When it does not run, one snapshot is read through the monitor
(:meth:`gpumem.core.monitoring.monitor.Monitor.snapshot`), so the status bar never starts the sampler itself and
the monitor's source stays the one reader of torch, NVML and psutil.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpumem.core.monitoring.monitor import default_monitor
from gpumem.core.readers.sources import DeviceInfo, Snapshot
from gpumem.panel.monitor_feed import Readings, SampleBeat, capacities_of, describe_device

__all__ = ["FRESH_S", "StatusPayload", "StatusReader", "status_payload"]

StatusPayload = dict[str, Any]
# A sample younger than this answers a request; the sampler takes one every second by default.
FRESH_S = 2.5


def status_payload(snapshot: Snapshot, infos: Mapping[int, DeviceInfo | None]) -> StatusPayload:
    """PyTorch's figures per initialized device (none before the user's code initialized CUDA) and host RSS."""
    capacities = capacities_of(snapshot, infos)
    devices: list[dict[str, Any]] = []
    for reading in snapshot.allocator:
        info = infos.get(reading.device)
        devices.append(
            {
                "index": reading.device,
                "name": info.name if info is not None else f"cuda:{reading.device}",
                "allocated_bytes": reading.allocated_bytes,
                "reserved_bytes": reading.reserved_bytes,
                "total_bytes": capacities.get(reading.device),
            }
        )
    rss = snapshot.host.rss_bytes if snapshot.host is not None else None
    return {"devices": devices, "host": {"rss_bytes": rss}, "cuda_in_use": bool(snapshot.allocator)}


class StatusReader:
    """The default monitor's newest snapshot, for the status bar; follows ``set_default_monitor``.

    It listens to the sampler from the first ``start`` until as many ``stop`` calls (a publisher thread
    that is ending and its successor may overlap); neither starts or stops sampling.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._readings: Readings | None = None
        self._listener: Callable[[Snapshot], None] | None = None
        self._users = 0
        self._woken = threading.Event()
        self._beat = SampleBeat(self._woken.set)

    def wait_until_due(self, due: float, stop: threading.Event) -> bool:
        """Sleep until ``due``; while the sampler runs, until its first sample from half a period before
        ``due`` on instead (at most a sample period late), so that what is published is that fresh sample
        and this thread wakes with the sampler rather than on a clock of its own. False once ``stop`` is set.
        """
        lead = self._beat.lead_s(default_monitor().sampler)
        self._woken.clear()
        if stop.is_set():
            return False
        self._woken.wait(max(0.0, self._beat.arm(due, lead) - time.monotonic()))
        self._beat.disarm()
        return not stop.is_set()

    def interrupt(self) -> None:
        """End a wait_until_due now (the publisher is being stopped)."""
        self._woken.set()

    def start(self) -> None:
        with self._lock:
            self._users += 1
            self._follow_locked()

    def stop(self) -> None:
        with self._lock:
            self._users = max(0, self._users - 1)
            if not self._users:
                self._detach_locked()

    def sampled(self) -> StatusPayload | None:
        """From the sampler's newest snapshot; None while it has taken no recent one."""
        with self._lock:
            readings = self._follow_locked()
        if readings is None:
            return None
        snapshot = readings.latest(max_age_s=FRESH_S)
        return None if snapshot is None else status_payload(snapshot, readings.infos())

    def now(self) -> StatusPayload:
        """From a recent sample, else from one snapshot read now through the monitor (on this thread)."""
        payload = self.sampled()
        if payload is not None:
            return payload
        monitor = default_monitor()
        try:
            snapshot = monitor.snapshot()
        except Exception:
            return {"devices": [], "host": {"rss_bytes": None}, "cuda_in_use": False}  # nothing readable now
        infos = {reading.device: describe_device(monitor, reading.device) for reading in snapshot.allocator}
        return status_payload(snapshot, infos)

    def _follow_locked(self) -> Readings | None:
        """While started: listen to the current default monitor (again, if it was replaced)."""
        if not self._users:
            return None
        monitor = default_monitor()
        if self._readings is not None and self._readings.monitor is monitor:
            return self._readings
        self._detach_locked()
        readings = self._readings = Readings(monitor)

        def on_sample(snapshot: Snapshot) -> None:
            readings.note(snapshot)
            self._beat.sampled()

        self._listener = on_sample
        monitor.sampler.add_listener(on_sample)
        return readings

    def _detach_locked(self) -> None:
        readings, self._readings = self._readings, None
        listener, self._listener = self._listener, None
        if readings is not None and listener is not None:
            readings.monitor.sampler.remove_listener(listener)
