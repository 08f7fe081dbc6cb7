"""The measurement core as one object: a source, its timeline and the sampler that feeds it.

Scripts use it directly; the IPython extension and the panel share one default instance so that
however many panels are open, one thread samples.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, overload

from gpumem.core.readers.readings import Snapshot
from gpumem.core.readers.sources import MemorySource, SystemSource
from gpumem.core.sampling.sampler import DEFAULT_RATE_HZ, Sampler
from gpumem.core.sampling.thresholds import DEFAULT_WARN_FRACTION, ThresholdEvent, Thresholds, ThresholdWatch
from gpumem.core.sampling.timeline import DEFAULT_LEVELS, Level, Timeline

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11 on

    from gpumem.core.monitoring.spans import SpanRecord
    from gpumem.core.scripts.memory_report import MemoryReport
    from gpumem.core.scripts.metric_writers import MetricsWriter
    from gpumem.core.scripts.script_recorder import Scope, ScriptRecorder

__all__ = ["Monitor", "default_monitor", "set_default_monitor"]


class Monitor:
    """Samples ``source`` in the background into a bounded timeline.

    >>> with Monitor() as monitor:   # doctest: +SKIP
    ...     train()
    >>> monitor.timeline.window()    # doctest: +SKIP

    In scripts: ``snapshot("after_model")`` records a tagged reading, ``track("forward")`` measures a
    block, ``every(100)`` / ``step()`` log step metrics, ``print(report())`` shows them all. ``warn_at``: warn
    (once per crossing) when a device is that full while the sampler runs; None: no warning.
    """

    def __init__(
        self,
        source: MemorySource | None = None,
        rate_hz: float = DEFAULT_RATE_HZ,
        levels: Sequence[Level] = DEFAULT_LEVELS,
        *,
        warn_at: float | None = DEFAULT_WARN_FRACTION,
    ) -> None:
        if source is not None:
            _check_source(source)
        self.source: MemorySource = source if source is not None else SystemSource()
        self.timeline = Timeline(levels)
        self.sampler = Sampler(self.source, self.timeline, rate_hz)
        self._rate_hz = self.sampler.rate_hz
        self._users_lock = threading.Lock()
        self._users: dict[Hashable, float | None] = {}  # user -> the sampling rate it asked for
        self._started_explicitly = False
        self.thresholds = Thresholds(self._capacity)
        self.thresholds.warn_at(warn_at)
        self.sampler.add_listener(self.thresholds.listen)
        self._recorder: ScriptRecorder | None = None
        self._recorder_lock = threading.Lock()

    def start(self) -> Self:
        """Sample until :meth:`stop`, whatever shared users acquire and release meanwhile."""
        with self._users_lock:
            self._started_explicitly = True
            self.sampler.start()
        return self

    def stop(self) -> None:
        """Stop sampling now, whoever asked for it (scripts); shared users should ``release``.

        Open tag and step intervals end, so other measurements may reset the peak counters again.
        """
        with self._users_lock:
            self._users.clear()
            self._apply_rate_locked()
            self._started_explicitly = False
        self.sampler.stop()
        self.thresholds.stop()
        if self._recorder is not None:
            self._recorder.close()

    @property
    def rate_hz(self) -> float:
        """The monitor's own sampling rate: the sampler never runs slower, a user may ask it to run faster."""
        return self._rate_hz

    @rate_hz.setter
    def rate_hz(self, value: float) -> None:
        with self._users_lock:
            self.sampler.rate_hz = value  # checks the value
            self._rate_hz = value
            self._apply_rate_locked()

    def acquire(self, user: Hashable, rate_hz: float | None = None) -> None:
        """Keep the sampler running on behalf of ``user`` (a panel, automatic mode) until it releases.

        ``rate_hz``: how often ``user`` needs a sample; the sampler runs at the fastest rate its users ask
        for, and at the monitor's own rate when none asks for more. Acquiring again changes the rate asked.
        """
        if rate_hz is not None and not (math.isfinite(rate_hz) and rate_hz > 0):
            raise ValueError(f"rate_hz must be a positive number of samples per second, not {rate_hz!r}")
        with self._users_lock:
            self._users[user] = rate_hz
            self._apply_rate_locked()
            self.sampler.start()

    def _apply_rate_locked(self) -> None:
        asked = [rate for rate in self._users.values() if rate is not None]
        rate = max([self._rate_hz, *asked])
        if rate != self.sampler.rate_hz:
            self.sampler.rate_hz = rate

    def release(self, user: Hashable) -> None:
        """Drop ``user``'s claim; the sampler stops when no claim is left. Unknown users are ignored."""
        with self._users_lock:
            if user not in self._users:
                return
            del self._users[user]
            self._apply_rate_locked()
            last = not self._users and not self._started_explicitly
        if last:
            self.sampler.stop()
            self.thresholds.stop()

    @property
    def users(self) -> frozenset[Hashable]:
        """Who currently keeps the sampler running through :meth:`acquire`."""
        with self._users_lock:
            return frozenset(self._users)

    @property
    def running(self) -> bool:
        return self.sampler.running

    @overload
    def snapshot(self, tag: None = None, *, process_memory: bool = False) -> Snapshot: ...

    @overload
    def snapshot(self, tag: str, *, process_memory: bool = False) -> SpanRecord: ...

    def snapshot(self, tag: str | None = None, *, process_memory: bool = False) -> Snapshot | SpanRecord:
        """Read everything now, on the calling thread.

        With a ``tag``, record the reading for :meth:`report`: allocated, reserved and the exact peaks
        since the previous tag (this resets PyTorch's peak counters, as ``gpumem.measure`` does).
        """
        if tag is None:
            return self.source.snapshot(process_memory=process_memory)
        return self.recorder.tag(tag)

    @property
    def recorder(self) -> ScriptRecorder:
        """Tags, scopes and step metrics (made on first use)."""
        recorder = self._recorder  # the per-step path: no lock once it exists
        if recorder is not None:
            return recorder
        with self._recorder_lock:
            if self._recorder is None:
                from gpumem.core.scripts.script_recorder import ScriptRecorder

                self._recorder = ScriptRecorder(self.source, self.sampler.add_listener)
            return self._recorder

    def track(self, label: str) -> Scope:
        """``with monitor.track("forward"):`` measures the block; scopes nest, each with its own peak."""
        return self.recorder.track(label)

    def report(self, *, file: Any = None, title: str = "gpumem") -> MemoryReport:
        """The tags, scopes and gathered ranks, as an object: IPython and Jupyter display it (HTML there),
        ``print(monitor.report())`` writes its text (in a script). Nothing is printed by this call itself,
        unless ``file`` is given (e.g. ``sys.stderr``): then the text is written there too.
        """
        report = self.recorder.report(title)
        if file is not None:
            file.write(str(report))
        return report

    def to_dataframe(self) -> Any:
        """The report's rows as a pandas DataFrame (needs pandas)."""
        return self.recorder.report().to_dataframe()

    def metrics(self, prefix: str = "gpumem") -> dict[str, float]:
        """A flat dict to log (``gpumem/cuda0/peak_allocated_bytes`` ...): now, and peaks since the last call."""
        return self.recorder.metrics(prefix)

    def step(self) -> dict[str, float] | None:
        """Count a training step; every N-th (see :meth:`every`) returns the metrics and writes them."""
        return self.recorder.step()

    def every(self, steps: int) -> Callable[[], dict[str, float] | None]:
        """Measure every ``steps`` steps: call the returned function (or :meth:`step`) once per step."""
        return self.recorder.every(steps)

    def add_writer(self, writer: MetricsWriter) -> MetricsWriter:
        """Send every measured step's metrics to ``writer`` (CsvWriter, JsonlWriter, TensorBoardWriter)."""
        self.recorder.writers.append(writer)
        return writer

    def on_threshold(
        self, fraction: float, callback: Callable[[ThresholdEvent], object] | None = None, *, rearm: float | None = None
    ) -> ThresholdWatch:
        """Call ``callback(event)`` once each time a device's use crosses ``fraction`` of its capacity.

        It fires again only after use falls below ``rearm`` (default 5 points lower). Checked on every
        sample while the sampler runs; callbacks run in order on one gpumem thread, never the sampler's.
        The first threshold replaces the default warning; without a callback, the action is that warning.
        """
        from gpumem.core.sampling.thresholds import warn_about

        watch = ThresholdWatch(fraction, callback if callback is not None else warn_about, rearm)
        self.thresholds.add(watch)
        return watch

    def gather(self, *, group: Any = None, all_ranks: bool = False) -> Any:
        """Collect every rank's figures on rank 0 (on every rank with ``all_ranks``) with torch.distributed."""
        from gpumem.core.scripts.ranks import gather

        ranks = gather(self, group=group, all_ranks=all_ranks)
        if ranks is not None:
            self.recorder.gathered = ranks
        return ranks

    def _capacity(self, device: int) -> int | None:
        try:
            info = self.source.device_info(device)
        except Exception:
            return None
        return info.total_bytes if info is not None else None

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
            f"Monitor(source=...) takes a memory source such as gpumem.core.readers.sources.SystemSource() or "
            f"gpumem.testing.FakeSource(); {type(source).__name__} has no {', '.join(missing)}"
        )


_default_lock = threading.Lock()
_default: Monitor | None = None


def default_monitor() -> Monitor:
    """The process-wide monitor the extension and panels share (created, not started, on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Monitor(warn_at=None)  # the extension has its own capacity warnings, under the cell
        return _default


def set_default_monitor(monitor: Monitor | None) -> Monitor | None:
    """Replace the shared monitor (tests use a fake source); returns the previous one, stopped."""
    global _default
    with _default_lock:
        previous, _default = _default, monitor
    if previous is not None and previous is not monitor:
        previous.stop()
    return previous
