"""The one writer thread every open panel shares, the list of open panels (closing them all, the widget last
docked), and when a panel pushes next.

``hold_sync`` and trait changes are not thread-safe, so after a panel is built only this thread sets
its widget traits. It runs each panel's service function, sleeps until the earliest time one of them
asked to come back (or until woken), and stops when the last panel leaves. Importing this module is cheap
(no widgets): the IPython layer lists and closes the panels through it without loading ipywidgets or bqplot.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

__all__ = [
    "PushSchedule",
    "Writer",
    "close_all",
    "docked_model_id",
    "note_docked",
    "open_panels",
    "register",
    "shared_writer",
    "unregister",
]

# Service functions return when to be called again (time.monotonic() seconds).
Service = Callable[[], float]
IDLE_WAIT_S = 1.0
# The longest the thread sleeps: a shown panel says when it is due; a hidden one, IDLE_WAIT_S from now.
_LONGEST_SLEEP_S = 5.0


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
            next_due = time.monotonic() + _LONGEST_SLEEP_S
            for service in services:
                if stop.is_set():
                    return
                next_due = min(next_due, service())
            self._wake.wait(max(0.0, min(_LONGEST_SLEEP_S, next_due - time.monotonic())))


shared_writer = Writer()


class PushSchedule:
    """When a panel's header and curves are due; the writer reads and advances it, nobody else."""

    def __init__(self) -> None:
        self.next_header = 0.0
        self.next_curves = 0.0
        self.curves_dirty = True

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


# The widget last docked (shown for the sidebar, or handed to a front end that asked), weakly: while it is
# open the status payload names it, so that a page that opens later (a new window, a reload) docks it
# again instead of calling its output stale.
_docked: weakref.ref[Any] | None = None


def note_docked(widget: Any) -> None:
    global _docked
    try:
        _docked = weakref.ref(widget)
    except TypeError:
        _docked = None


def docked_model_id() -> str | None:
    """The model id of the widget last docked while it is open (its comm alive), else None."""
    ref = _docked
    widget = ref() if ref is not None else None
    if widget is None or getattr(widget, "closed", False) or getattr(widget, "comm", None) is None:
        return None
    model_id = getattr(widget, "model_id", None)
    return model_id if isinstance(model_id, str) else None
