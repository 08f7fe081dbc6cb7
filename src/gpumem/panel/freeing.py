"""The panel's Free: :func:`gpumem.core.cleanup.free` on a short-lived worker thread, and its one-line message.

Free runs on its own thread so that a slow ``gc.collect`` never blocks the comm thread or the writer;
one Free runs at a time per panel. The message is :func:`gpumem.core.cleanup.describe_one_line`'s text
with the panel's framing (what came back in total, and how long it took).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from gpumem.core.cleanup import FreeResult, describe_one_line
from gpumem.core.cleanup import free as free_memory
from gpumem.core.readers.sources import MemorySource
from gpumem.core.units import format_bytes

__all__ = ["FreeOutcome", "FreeWorker", "free_message", "run_free"]

_DEEP_HINT = " (tick deep to release)"


class FreeOutcome(NamedTuple):
    """What one Free did: :class:`gpumem.core.cleanup.FreeResult` (None if it failed), the error, host RSS change."""

    result: FreeResult | None
    error: str | None
    elapsed_s: float
    host_rss_freed_bytes: int | None


def _host_rss(source: MemorySource) -> int | None:
    try:
        host = source.snapshot().host
    except Exception:
        return None
    return host.rss_bytes if host is not None else None


def run_free(deep: bool, shell: Any, source: MemorySource) -> FreeOutcome:
    """Free, measured: the host RSS before and after (the core result has the GPU side)."""
    began = time.perf_counter()
    rss_before = _host_rss(source)
    try:
        result = free_memory(deep=deep, shell=shell, source=source)
    except Exception as error:
        return FreeOutcome(None, f"{type(error).__name__}: {error}", time.perf_counter() - began, None)
    rss_after = _host_rss(source)
    host = rss_before - rss_after if rss_before is not None and rss_after is not None else None
    return FreeOutcome(result, None, time.perf_counter() - began, host)


def free_message(outcome: FreeOutcome) -> tuple[str, bool]:
    """One line for the panel, and whether Free worked: what came back in total, then the details."""
    result = outcome.result
    if result is None:
        return f"Free failed: {outcome.error}", False
    host = outcome.host_rss_freed_bytes
    if result.devices:
        head = f"Freed {format_bytes(max(result.reserved_reclaimed_bytes, 0))} of GPU memory"
    elif host is not None and host > 0:
        head = f"Freed {format_bytes(host)} of host memory"
    else:
        head = "Freed nothing"
    details = describe_one_line(result, host_rss_freed_bytes=host, deep_hint=_DEEP_HINT)
    return f"{head} ({outcome.elapsed_s:.2f} s): {details}", True


class FreeWorker:
    """At most one worker thread at a time (Free's, or the holders view's walk or action); remembers the last outcome.

    ``name`` names its threads, so that a thread list says which worker runs.
    """

    def __init__(self, name: str = "gpumem-free") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.last: FreeOutcome | None = None

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def start(
        self, work: Callable[[bool], None], deep: bool, announce: Callable[[], None]
    ) -> tuple[threading.Thread, bool]:
        """Run ``work(deep)`` on a new thread, after ``announce()``; or, while one runs, that one.

        Returns the thread and whether it was started now.
        """
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return self._thread, False
            announce()  # before the thread starts, so that its outcome always comes after the announcement
            thread = threading.Thread(target=work, args=(deep,), name=self._name, daemon=True)
            self._thread = thread
            thread.start()
            return thread, True

    def join(self, timeout_s: float) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
