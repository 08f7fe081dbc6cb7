"""What the panel and the status bar take from the shared monitor, without reading anything themselves.

The monitor's sampler is the one reader of torch, NVML and psutil. A :class:`Readings` listens to it
and keeps the newest snapshot and the names and capacities of the devices it saw; a
:class:`PeaksSinceOpen` folds every snapshot into the measured stretch since a panel opened; a
:class:`SamplerClaim` keeps the sampler running while someone shows its figures.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable, Mapping

from gpumem.core.monitoring.monitor import Monitor
from gpumem.core.monitoring.peaks import RunningPeak
from gpumem.core.monitoring.spans import Stretch
from gpumem.core.readers.sources import DeviceInfo, Snapshot
from gpumem.core.sampling.sampler import Sampler

__all__ = [
    "SAMPLE_LATE_S",
    "PeaksSinceOpen",
    "Readings",
    "SampleBeat",
    "SamplerClaim",
    "capacities_of",
    "describe_device",
    "device_indices",
]


class PeaksSinceOpen:
    """Per device and for the host: the peak since the panel opened (or Reset peak). A measured stretch of
    core's (:class:`gpumem.core.monitoring.spans.Stretch`) that never resets the peak counters and is not counted as a
    running measurement; each peak is judged by core's one rule (:class:`gpumem.core.monitoring.peaks.RunningPeak`)."""

    OPENED = "panel opened"
    RESET = "peak reset"

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the stretch and its label change together (Reset peak)
        self._stretch = Stretch(counters=True)
        self._since_label = self.OPENED

    def span(self) -> tuple[float | None, str]:
        """Since when the peaks count (None before the first snapshot) and what happened then, for the
        mark on the curves: the timeline holds samples from before the panel opened, the peaks do not."""
        with self._lock:
            start, label = self._stretch.start, self._since_label
        return (start.monotonic_s if start is not None else None), label

    def note(self, snapshot: Snapshot) -> None:
        """Sampler thread (and the panel's own first read): fold one snapshot in."""
        self._stretch.take_sample(snapshot)

    def restart(self, baseline: Snapshot | None) -> None:
        """Forget every peak; ``baseline`` (the newest snapshot) is the first value of the new stretch."""
        stretch = Stretch(counters=True)
        if baseline is not None:
            stretch.take_sample(baseline)
        with self._lock:
            self._stretch, self._since_label = stretch, self.RESET

    def frozen(self) -> tuple[dict[int, RunningPeak], RunningPeak]:
        """Copies the writer can read while the sampler thread keeps updating the originals."""
        return self._stretch.running_peaks()


class Readings:
    """The newest snapshot the sampler took, and what each device it showed is (name, capacity).

    Device descriptions are looked up once per device, on the thread that delivers the first snapshot
    showing it (the sampler's, for every snapshot after the first), so readers never call the source.
    """

    def __init__(self, monitor: Monitor) -> None:
        self._monitor = monitor
        self._lock = threading.Lock()
        self._latest: Snapshot | None = None
        self._noted_at = -1.0
        self._infos: dict[int, DeviceInfo | None] = {}

    @property
    def monitor(self) -> Monitor:
        return self._monitor

    def note(self, snapshot: Snapshot) -> None:
        """The sampler's listener: keep the snapshot and describe devices seen for the first time."""
        for index in device_indices(snapshot):
            if index not in self._infos:
                info = describe_device(self._monitor, index)
                with self._lock:
                    self._infos[index] = info
        with self._lock:
            self._latest = snapshot
            self._noted_at = time.monotonic()

    def latest(self, max_age_s: float | None = None) -> Snapshot | None:
        """The newest snapshot, or None when there is none (or none newer than ``max_age_s``)."""
        with self._lock:
            if max_age_s is not None and time.monotonic() - self._noted_at > max_age_s:
                return None
            return self._latest

    def infos(self) -> dict[int, DeviceInfo | None]:
        with self._lock:
            return dict(self._infos)

    def capacities(self) -> dict[int, int]:
        """Total bytes per device of the newest snapshot (see :func:`capacities_of`)."""
        snapshot = self.latest()
        return capacities_of(snapshot, self.infos()) if snapshot is not None else {}


def capacities_of(snapshot: Snapshot, infos: Mapping[int, DeviceInfo | None]) -> dict[int, int]:
    """Total bytes per device: NVML's figure, else the device description's (PyTorch's properties)."""
    capacities = {reading.device: reading.total_bytes for reading in snapshot.devices}
    for index in device_indices(snapshot):
        info = infos.get(index)
        if index not in capacities and info is not None:
            capacities[index] = info.total_bytes
    return capacities


def describe_device(monitor: Monitor, index: int) -> DeviceInfo | None:
    """Name and capacity of one device, or None when the source cannot say."""
    try:
        return monitor.source.device_info(index)
    except Exception:
        return None


def device_indices(snapshot: Snapshot) -> tuple[int, ...]:
    """The devices a snapshot shows, PyTorch's and NVML's together, in order."""
    return tuple(sorted({r.device for r in snapshot.allocator} | {d.device for d in snapshot.devices}))


# How long after it was due a job that waits for a sample stops waiting and runs without one.
SAMPLE_LATE_S = 0.25


class SampleBeat:
    """Runs a periodic job (a panel push, a status publication) with the sampler's first sample from half
    a period before the job is due, rather than on a clock of its own that may fire just before it: what
    the job shows is then fresh from the sampler, never shown twice, and its thread wakes with the sampler.

    :meth:`arm` returns when to run anyway (a sampler that stalls); :meth:`sampled`, called by a sampler
    listener, calls ``wake`` once the job is due.
    """

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._at = math.inf  # monotonic s: a sample from then on wakes the job

    @staticmethod
    def lead_s(sampler: Sampler) -> float:
        """Half a sample period while ``sampler`` runs (a job due that soon goes with this sample), else 0."""
        return 0.5 / sampler.rate_hz if sampler.running else 0.0

    def arm(self, due: float, lead: float) -> float:
        """Wait for the first sample from ``due - lead`` on; the time to run anyway (``due`` without a lead)."""
        if not lead:
            self._at = math.inf
            return due
        self._at = due - lead
        return due + lead + SAMPLE_LATE_S

    def disarm(self) -> None:
        self._at = math.inf

    def sampled(self) -> None:
        """Sampler thread: wake the job if it is waiting for this sample."""
        if time.monotonic() >= self._at:
            self._at = math.inf
            self._wake()


class SamplerClaim:
    """One user's claim on the monitor's sampler, taken and given back at most once each."""

    def __init__(self, monitor: Monitor, user: Hashable, enabled: bool = True, rate_hz: float | None = None) -> None:
        self._monitor = monitor
        self._user = user
        self._enabled = enabled
        self._rate_hz = rate_hz  # how often the claimant needs a sample (None: the monitor's own rate)
        self._lock = threading.Lock()
        self._held = False

    @property
    def held(self) -> bool:
        return self._held

    def take(self) -> None:
        with self._lock:
            if not self._enabled or self._held:
                return
            self._held = True
        self._monitor.acquire(self._user, self._rate_hz)

    def ask_rate(self, rate_hz: float | None) -> None:
        """Change the rate asked for; a claim held now asks the monitor at once."""
        with self._lock:
            self._rate_hz = rate_hz
            held = self._held
        if held:
            self._monitor.acquire(self._user, rate_hz)

    def give_back(self) -> None:
        with self._lock:
            if not self._held:
                return
            self._held = False
        self._monitor.release(self._user)
