"""The measurement core as one object: a source, its timeline and the sampler that feeds it.

Scripts use it directly; the IPython extension and the panel share one default instance so that
however many panels are open, one thread samples.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from gpumem.core.readings import Snapshot
from gpumem.core.sampler import DEFAULT_RATE_HZ, Sampler
from gpumem.core.sources import MemorySource, SystemSource
from gpumem.core.timeline import DEFAULT_LEVELS, Level, Timeline

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11 on

__all__ = ["Monitor", "default_monitor", "set_default_monitor"]


class Monitor:
    """Samples ``source`` in the background into a bounded timeline.

    >>> with Monitor() as monitor:   # doctest: +SKIP
    ...     train()
    >>> monitor.timeline.window()    # doctest: +SKIP
    """

    def __init__(
        self,
        source: MemorySource | None = None,
        rate_hz: float = DEFAULT_RATE_HZ,
        levels: Sequence[Level] = DEFAULT_LEVELS,
    ) -> None:
        if source is not None:
            _check_source(source)
        self.source: MemorySource = source if source is not None else SystemSource()
        self.timeline = Timeline(levels)
        self.sampler = Sampler(self.source, self.timeline, rate_hz)
        self._users_lock = threading.Lock()
        self._users: set[Hashable] = set()
        self._started_explicitly = False

    def start(self) -> Self:
        """Sample until :meth:`stop`, whatever shared users acquire and release meanwhile."""
        with self._users_lock:
            self._started_explicitly = True
            self.sampler.start()
        return self

    def stop(self) -> None:
        """Stop sampling now, whoever asked for it (scripts); shared users should ``release``."""
        with self._users_lock:
            self._users.clear()
            self._started_explicitly = False
        self.sampler.stop()

    def acquire(self, user: Hashable) -> None:
        """Keep the sampler running on behalf of ``user`` (a panel, automatic mode) until it releases."""
        with self._users_lock:
            self._users.add(user)
            self.sampler.start()

    def release(self, user: Hashable) -> None:
        """Drop ``user``'s claim; the sampler stops when no claim is left. Unknown users are ignored."""
        with self._users_lock:
            if user not in self._users:
                return
            self._users.discard(user)
            last = not self._users and not self._started_explicitly
        if last:
            self.sampler.stop()

    @property
    def users(self) -> frozenset[Hashable]:
        """Who currently keeps the sampler running through :meth:`acquire`."""
        with self._users_lock:
            return frozenset(self._users)

    @property
    def running(self) -> bool:
        return self.sampler.running

    def snapshot(self, *, process_memory: bool = False) -> Snapshot:
        """Read everything now, on the calling thread."""
        return self.source.snapshot(process_memory=process_memory)

    def mark(self, label: str, time_s: float | None = None) -> None:
        """Label an instant on the timeline (the panel draws these as vertical markers)."""
        self.timeline.add_mark(time.monotonic() if time_s is None else time_s, label)

    def status(self) -> dict[str, str]:
        return self.source.status()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


_SOURCE_METHODS = ("snapshot", "cuda_devices", "device_info", "reset_peaks", "empty_cache", "status")


def _check_source(source: object) -> None:
    missing = [name for name in _SOURCE_METHODS if not callable(getattr(source, name, None))]
    if missing:
        raise TypeError(
            f"Monitor(source=...) takes a memory source such as gpumem.core.sources.SystemSource() or "
            f"gpumem.testing.FakeSource(); {type(source).__name__} has no {', '.join(missing)}"
        )


_default_lock = threading.Lock()
_default: Monitor | None = None


def default_monitor() -> Monitor:
    """The process-wide monitor the extension and panels share (created, not started, on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Monitor()
        return _default


def set_default_monitor(monitor: Monitor | None) -> Monitor | None:
    """Replace the shared monitor (tests use a fake source); returns the previous one, stopped."""
    global _default
    with _default_lock:
        previous, _default = _default, monitor
    if previous is not None and previous is not monitor:
        previous.stop()
    return previous
