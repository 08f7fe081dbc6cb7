"""What a script asks a :class:`~gpumem.core.monitoring.monitor.Monitor` for: tags, scopes, step metrics, writers.

Tags and step metrics are streams of one :class:`~gpumem.core.monitoring.spans.IntervalClock`, so each has
exact peaks since its own previous point; so are scopes, whose opening and closing are points too.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any

from gpumem.core.monitoring.spans import SpanRecord, Stream, classify_error, clock_for
from gpumem.core.readers.readings import Snapshot
from gpumem.core.readers.sources import MemorySource
from gpumem.core.scripts.metric_writers import MetricsWriter

if TYPE_CHECKING:
    from typing_extensions import Self

    from gpumem.core.scripts.memory_report import MemoryReport

__all__ = ["Scope", "ScriptRecorder", "metrics_of"]

MAX_RECORDS = 10_000


def metrics_of(record: SpanRecord, prefix: str = "gpumem") -> dict[str, float]:
    """A flat dict to log beside loss and accuracy; peaks are since the previous ``metrics()``."""
    values: dict[str, float] = {}
    for device in record.devices:
        key = f"{prefix}/cuda{device.device}"
        values[f"{key}/allocated_bytes"] = device.allocated_bytes
        values[f"{key}/reserved_bytes"] = device.reserved_bytes
        values[f"{key}/peak_allocated_bytes"] = device.peak_allocated_bytes
        values[f"{key}/peak_reserved_bytes"] = device.peak_reserved_bytes
        values[f"{key}/peak_exact"] = 1.0 if device.peak_exact else 0.0
        if device.used_bytes is not None and device.total_bytes is not None:
            values[f"{key}/used_bytes"] = device.used_bytes
            values[f"{key}/total_bytes"] = device.total_bytes
    if record.host is not None:
        values[f"{prefix}/host/rss_bytes"] = record.host.rss_bytes
        values[f"{prefix}/host/peak_rss_bytes"] = record.host.peak_rss_bytes
    return values


class Scope:
    """``with monitor.track("forward") as scope:`` ... ``scope.record`` once the block is done.

    A scope is a stream of the monitor's interval clock: opening and closing it are points, so an outer
    scope's peak takes in its inner scopes' and every one of them is exact (unless something else, such as
    a ``gpumem.measure`` block or ``torch.cuda.reset_peak_memory_stats``, owns the counters meanwhile).
    """

    def __init__(self, recorder: ScriptRecorder, label: str) -> None:
        self._recorder = recorder
        self.label = label
        self.record: SpanRecord | None = None
        self._stream: Stream | None = None
        self._path: tuple[str, ...] = ()

    def __enter__(self) -> Self:
        if self._stream is not None:
            raise RuntimeError(f"the scope {self.label!r} is already open; nest a new monitor.track(...) instead")
        self._path, self._stream = self._recorder.open_scope(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            self.record = self._recorder.close_scope(self, stream, self._path, exc)

    @property
    def report(self) -> Any:
        """The record as ``gpumem.measure`` renders it: ``print`` gives text, notebooks render HTML."""
        if self.record is None:
            raise RuntimeError(f"the scope {self.label!r} has not finished yet")
        from gpumem.core.cells.report import CellReport

        return CellReport(self.record)


class ScriptRecorder:
    """Tags, scopes and step metrics of one monitor (created on first use)."""

    def __init__(self, source: MemorySource, add_listener: Callable[[Callable[[Snapshot], None]], None]) -> None:
        self.source = source
        self.clock = clock_for(source)
        self._tags = self.clock.stream("tags")
        self._steps = self.clock.stream("metrics")
        self._lock = threading.Lock()
        self.tags: deque[SpanRecord] = deque(maxlen=MAX_RECORDS)
        self.scopes: deque[SpanRecord] = deque(maxlen=MAX_RECORDS)
        self.writers: list[MetricsWriter] = []
        self.writer_errors: list[str] = []
        self.gathered: Any = None  # the last gather()'s per-rank figures, for report()
        self._stacks = threading.local()
        self.step_count = 0
        self.every_steps = 0
        self.last_metrics: dict[str, float] = {}
        add_listener(self._on_sample)

    # Tags -------------------------------------------------------------------------------------
    def tag(self, label: str) -> SpanRecord:
        _check_label("snapshot", label)
        record = self._tags.point(label)
        with self._lock:
            self.tags.append(record)
        return record

    # Scopes -----------------------------------------------------------------------------------
    def track(self, label: str) -> Scope:
        _check_label("track", label)
        return Scope(self, label)

    def _stack(self) -> list[Scope]:
        stack: list[Scope] | None = getattr(self._stacks, "stack", None)
        if stack is None:
            stack = self._stacks.stack = []
        return stack

    def open_scope(self, scope: Scope) -> tuple[tuple[str, ...], Stream]:
        stack = self._stack()
        path = (*(outer.label for outer in stack), scope.label)
        stream = self.clock.stream(scope.label)
        stream.point(scope.label)
        stack.append(scope)
        return path, stream

    def close_scope(self, scope: Scope, stream: Stream, path: tuple[str, ...], exc: BaseException | None) -> SpanRecord:
        stack = self._stack()
        if scope in stack:
            stack.remove(scope)
        status, error = classify_error(exc)  # as a cell's
        try:
            record = stream.point(scope.label)._replace(kind="scope", path=path, status=status, error=error)
        finally:
            stream.close()
        with self._lock:
            self.scopes.append(record)
        return record

    # Step metrics -----------------------------------------------------------------------------
    def metrics(self, prefix: str = "gpumem") -> dict[str, float]:
        """Current figures and the peaks since the previous call (the first call: the counters' values)."""
        record = self._steps.point(f"step {self.step_count}")
        self.last_metrics = metrics_of(record, prefix)
        return dict(self.last_metrics)

    def step(self) -> dict[str, float] | None:
        """Count one step; every ``every_steps``-th, measure, hand the metrics to the writers, return them."""
        self.step_count += 1
        if self.every_steps <= 0 or self.step_count % self.every_steps:
            return None
        values = self.metrics()
        step = self.step_count
        for writer in list(self.writers):
            self._guarded(writer, partial(writer.write, step, values))
        return values

    def _guarded(self, writer: MetricsWriter, action: Callable[[], None]) -> None:
        """A writer that fails (a full disk) is noted in ``writer_errors``; training goes on."""
        try:
            action()
        except Exception as error:
            self.writer_errors.append(f"{type(writer).__name__}: {type(error).__name__}: {error}")

    def every(self, steps: int) -> Callable[[], dict[str, float] | None]:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"every() takes a whole number of steps (1 or more), not {steps!r}")
        self.every_steps = steps
        return self.step

    # Reporting --------------------------------------------------------------------------------
    def report(self, title: str = "gpumem") -> MemoryReport:
        from gpumem.core.scripts.memory_report import MemoryReport

        with self._lock:
            return MemoryReport(tuple(self.tags), tuple(self.scopes), self.gathered, title=title)

    def close(self) -> None:
        """End the open tag and step intervals (so other measurements may reset the counters again)."""
        self._tags.close()
        self._steps.close()
        for writer in list(self.writers):
            self._guarded(writer, writer.close)

    def _on_sample(self, snapshot: Snapshot) -> None:
        """Sampler thread: keep the sampled maxima of the open segment (lower bounds, should a peak not be exact)."""
        self.clock.take_sample(snapshot)


def _check_label(method: str, label: object) -> None:
    if not isinstance(label, str) or not label.strip():
        raise ValueError(f"{method}() takes a non-empty label such as 'after_model', not {label!r}")
