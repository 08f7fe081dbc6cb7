"""The one background thread: reads the memory source on a fixed schedule into the timeline.

The schedule runs on the monotonic clock (ticks that fall behind are skipped, never bunched),
the thread sleeps between ticks rather than spinning, and it records what its own reads cost.
A forked child (a DataLoader worker, say) starts with the sampler stopped and usable.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from gpumem.core.readers.cuda_fault import record_fault
from gpumem.core.readers.readings import Snapshot
from gpumem.core.readers.sources import MemorySource
from gpumem.core.sampling.timeline import Timeline

__all__ = ["DEFAULT_RATE_HZ", "MAX_RATE_HZ", "Sampler", "SamplerCost", "channel_device", "channels_of"]

# Next to a busy training loop one sample costs about 0.4 ms of CPU (cold caches and a GIL hand-off,
# not the reads themselves: BENCHMARKS.md), so the sampler runs only as fast as its users need. 1 Hz
# gives the panel's default 10-minute window 600 samples; a view that needs more asks for it
# (``Monitor.acquire(user, rate_hz=...)``). Exact per-cell peaks come from the allocator's counters.
DEFAULT_RATE_HZ = 1.0
MAX_RATE_HZ = 10.0  # the fastest a view asks for (a 1-minute window); scripts may choose any rate
RECENT_READS = 256  # read durations kept for the typical and slowest recent read (about 4 min at 1 Hz)

Listener = Callable[[Snapshot], None]


class SamplerCost(NamedTuple):
    """What sampling has cost so far, measured around each read.

    The mean includes the first reads (NVML starting, the fast path being looked up), which cost ten
    times a warm one: the typical read is the median of the last :data:`RECENT_READS`.
    """

    samples: int
    total_s: float
    max_s: float
    skipped_ticks: int
    recent_reads: int = 0  # how many reads recent_median_s and recent_max_s are taken over
    recent_median_s: float = 0.0
    recent_max_s: float = 0.0

    @property
    def mean_s(self) -> float:
        return self.total_s / self.samples if self.samples else 0.0


def channels_of(snapshot: Snapshot) -> dict[str, float]:
    """Flatten a snapshot into the timeline's channels (bytes)."""
    values: dict[str, float] = {}
    for reading in snapshot.allocator:
        values[f"cuda:{reading.device}/allocated"] = float(reading.allocated_bytes)
        values[f"cuda:{reading.device}/reserved"] = float(reading.reserved_bytes)
    for device in snapshot.devices:
        values[f"cuda:{device.device}/used"] = float(device.used_bytes)
    if snapshot.host is not None:
        values["host/rss"] = float(snapshot.host.rss_bytes)
    return values


def channel_device(name: str) -> int | None:
    """The CUDA device of a channel named by :func:`channels_of` (``cuda:1/reserved`` is 1); None for the host."""
    if not name.startswith("cuda:") or "/" not in name:
        return None
    return int(name[len("cuda:") : name.index("/")])


_live_samplers: weakref.WeakSet[Sampler] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for sampler in list(_live_samplers):
        sampler._forget_thread_after_fork()  # noqa: SLF001 - this module's own fork hook for its own class


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _check_rate(rate_hz: object) -> None:
    if isinstance(rate_hz, bool) or not isinstance(rate_hz, (int, float)):
        raise TypeError(f"rate_hz must be a number of samples per second, not {rate_hz!r}")
    if not (rate_hz > 0 and math.isfinite(rate_hz)):
        raise ValueError(f"rate_hz must be a positive number, not {rate_hz!r}")


class Sampler:
    """Reads ``source`` every ``1 / rate_hz`` seconds into ``timeline`` and notifies listeners."""

    def __init__(self, source: MemorySource, timeline: Timeline, rate_hz: float = DEFAULT_RATE_HZ) -> None:
        _check_rate(rate_hz)
        self.source = source
        self.timeline = timeline
        self._period_s = 1.0 / rate_hz
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set to end the current wait early: stopping, or a faster rate
        self._thread: threading.Thread | None = None
        self._listeners: list[Listener] = []
        self._samples = 0
        self._total_s = 0.0
        self._max_s = 0.0
        self._recent: deque[float] = deque(maxlen=RECENT_READS)
        self._skipped = 0
        self._last_error: str | None = None
        _live_samplers.add(self)

    @property
    def rate_hz(self) -> float:
        return 1.0 / self._period_s

    @rate_hz.setter
    def rate_hz(self, value: float) -> None:
        """A faster rate takes effect at once (the thread wakes), a slower one after the next sample."""
        _check_rate(value)
        faster = 1.0 / value < self._period_s
        self._period_s = 1.0 / value
        if faster:
            self._wake.set()

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def last_error(self) -> str | None:
        """The last exception a read raised, as text; sampling goes on regardless."""
        return self._last_error

    def start(self) -> None:
        """Start the thread; starting a running sampler does nothing."""
        with self._lock:
            if self.running:
                return
            self._stop = threading.Event()
            thread = threading.Thread(target=self._run, args=(self._stop,), name="gpumem-sampler", daemon=True)
            self._thread = thread
            thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and wait for it; stopping a stopped sampler does nothing."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
            self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(snapshot)`` on the sampler thread after every sample; keep it cheap."""
        with self._lock:
            if listener not in self._listeners:
                self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def sample_once(self) -> Snapshot:
        """Take one sample now, on the calling thread, and record it like a scheduled one."""
        began = time.perf_counter()
        snapshot = self.source.snapshot()
        spent = time.perf_counter() - began
        self.timeline.append(snapshot.monotonic_s, channels_of(snapshot))
        with self._lock:
            self._samples += 1
            self._total_s += spent
            self._max_s = max(self._max_s, spent)
            self._recent.append(spent)
            listeners = list(self._listeners)
        for listener in listeners:
            self._notify(listener, snapshot)
        return snapshot

    def _notify(self, listener: Listener, snapshot: Snapshot) -> None:
        """One listener's failure is recorded and does not keep the others from hearing."""
        try:
            listener(snapshot)
        except Exception as error:
            self._last_error = f"listener failed: {type(error).__name__}: {error}"

    def cost(self) -> SamplerCost:
        with self._lock:
            recent = list(self._recent)
            totals = (self._samples, self._total_s, self._max_s, self._skipped)
        if not recent:
            return SamplerCost(*totals)
        return SamplerCost(*totals, len(recent), statistics.median(recent), max(recent))

    def _run(self, stop: threading.Event) -> None:
        next_tick = time.monotonic()
        self._wake.clear()
        while not stop.is_set():
            try:
                self._last_error = None
                self.sample_once()
            except Exception as error:
                self._last_error = f"{type(error).__name__}: {error}"
                record_fault(error, None)  # a sticky CUDA error: that device is not read again
            next_tick += self._period_s
            now = time.monotonic()
            if now > next_tick:
                missed = int((now - next_tick) / self._period_s) + 1
                self._skipped += missed
                next_tick += missed * self._period_s
            if self._wake.wait(next_tick - now):
                self._wake.clear()  # a faster rate: sample now and keep the new schedule from here
                next_tick = time.monotonic()

    def _forget_thread_after_fork(self) -> None:
        """In a forked child the thread does not exist: drop it and the (possibly held) locks."""
        self._lock = threading.Lock()
        self._thread = None
        self._stop = threading.Event()
        self._wake = threading.Event()
