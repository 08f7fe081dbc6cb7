"""The one writer thread every open panel shares, the list of open panels, and when a panel pushes next.

``hold_sync`` and trait changes are not thread-safe, so after a panel is built only this thread sets
its widget traits. It runs each panel's service function, sleeps until the earliest time one of them
asked to come back (or until woken), and stops when the last panel leaves.

The thread keeps to a CPU budget: a push costs a millisecond or two of CPU (several on a machine whose
main thread is busy: each hand-over of the GIL to this thread costs a wake-up and cold caches), so the
pushes are spaced by what they cost, up to :data:`MAX_SPACING_S`. A command (Free, a control changed)
is answered at once whatever the budget.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

__all__ = [
    "MAX_SPACING_S",
    "WRITER_CPU_BUDGET",
    "PushSchedule",
    "Writer",
    "close_all",
    "open_panels",
    "register",
    "shared_writer",
    "unregister",
]

# Service functions return when to be called again (time.monotonic() seconds).
Service = Callable[[], float]
IDLE_WAIT_S = 1.0
# The CPU the writer thread may spend on all open panels together: 0.8 ms a second (0.08% of a core).
WRITER_CPU_BUDGET = 0.0008
# However costly its pushes, a panel shown is brought up to date at least this often.
MAX_SPACING_S = 5.0
_COSTS_KEPT = 7  # the latest passes whose CPU time sets the spacing


class Writer:
    """Runs every open panel's updates on one daemon thread; stops when the last panel leaves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._services: list[Service] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def add(self, service: Service) -> None:
        with self._lock:
            if service not in self._services:
                self._services.append(service)
            if self._thread is None or not self._thread.is_alive():
                self._stop = threading.Event()
                self._thread = threading.Thread(
                    target=self._run, args=(self._stop,), name="gpumem-panel-writer", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def remove(self, service: Service) -> None:
        with self._lock:
            if service in self._services:
                self._services.remove(service)
            thread = self._thread if not self._services else None
            if thread is not None:
                self._thread = None
                self._stop.set()
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)

    def wake(self) -> None:
        self._wake.set()

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._wake.clear()
            with self._lock:
                services = list(self._services)
            next_due = time.monotonic() + MAX_SPACING_S  # a panel that is due sooner says so
            for service in services:
                if stop.is_set():
                    return
                next_due = min(next_due, service())
            self._wake.wait(max(0.0, min(MAX_SPACING_S, next_due - time.monotonic())))


shared_writer = Writer()


class PushSchedule:
    """When a panel's header and curves are due; the writer reads and advances it, nobody else."""

    def __init__(self) -> None:
        self.next_header = 0.0
        self.next_curves = 0.0
        self.curves_dirty = True
        self._costs: deque[float] = deque(maxlen=_COSTS_KEPT)
        self._first = True

    @property
    def push_cpu_s(self) -> float:
        """A pass's usual CPU time: the median of the latest ones (0 until one is known)."""
        return statistics.median(self._costs) if self._costs else 0.0

    def note_push_cost(self, cpu_s: float) -> None:
        """The CPU time (this thread's clock) of a pass that pushed something. The first pass builds
        what the later ones reuse, so it does not count; a median shrugs off a pass a collection slowed."""
        if self._first:
            self._first = False
        elif cpu_s >= 0:
            self._costs.append(cpu_s)

    def spacing_s(self, panels: int) -> float:
        """The least time between two pushes that keeps ``panels`` panels like this one within the budget."""
        return min(MAX_SPACING_S, self.push_cpu_s * max(1, panels) / WRITER_CPU_BUDGET)

    def invalidate(self) -> None:
        """Something changed what is shown: push both at the next pass."""
        self.curves_dirty = True
        self.next_header = 0.0

    def header_due(self, now: float) -> bool:
        return now >= self.next_header

    def curves_due(self, now: float) -> bool:
        return self.curves_dirty or now >= self.next_curves

    def pushed_header(self, now: float, interval_s: float) -> None:
        self.next_header = now + interval_s

    def pushed_curves(self, now: float, interval_s: float) -> None:
        self.next_curves = now + interval_s
        self.curves_dirty = False

    @property
    def next_due(self) -> float:
        return min(self.next_header, self.next_curves)


class Closable(Protocol):
    def close(self) -> None: ...


_registry_lock = threading.Lock()
_open: list[Closable] = []


def register(panel: Closable) -> None:
    with _registry_lock:
        _open.append(panel)


def unregister(panel: Closable) -> None:
    with _registry_lock:
        if panel in _open:
            _open.remove(panel)


def open_panels() -> list[Closable]:
    """The panels not closed yet, oldest first."""
    with _registry_lock:
        return list(_open)


def close_all() -> None:
    """Close every open panel: stops the writer thread, and the sampler where a panel started it."""
    for panel in open_panels():
        panel.close()
