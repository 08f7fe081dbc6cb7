"""A measured stretch of a script (between two tags, or inside ``with monitor.track(...)``).

A span follows the process-wide peak rule of :mod:`gpumem.core.peaks`, like ``gpumem.measure``: it
resets the raised peak counters when it starts unless another measurement runs (then the outer one
keeps its exact peak and this one's peak is exact only if the counter rose above its earlier value),
and a reset by anyone else during the span makes its peak a labelled lower bound.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

from gpumem.core.peaks import PEAK_RESETS, RUNNING, cell_peak, reset_raised_peaks
from gpumem.core.readings import AllocatorReading, Snapshot
from gpumem.core.sources import MemorySource

__all__ = ["FIRST_TAG_NOTE", "DeviceFigures", "HostFigures", "Span", "SpanRecord", "first_tag_record"]

FIRST_TAG_NOTE = "first tag: the counter's value since CUDA started or the counters were last reset"


class DeviceFigures(NamedTuple):
    """One CUDA device over a span: current use, use at the span's start and the span's peak."""

    device: int
    allocated_bytes: int
    reserved_bytes: int
    allocated_before_bytes: int
    reserved_before_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_exact: bool  # False: the peak is a lower bound (peak_note says why)
    peak_note: str
    used_bytes: int | None  # NVML, every process on the device
    total_bytes: int | None


class HostFigures(NamedTuple):
    """This process's resident memory over a span; the peak is exact when the lifetime peak rose in it."""

    rss_bytes: int
    rss_before_bytes: int
    peak_rss_bytes: int
    peak_exact: bool


class SpanRecord(NamedTuple):
    """A finished span: a tag (figures since the previous tag) or a scope (figures inside the block)."""

    label: str
    kind: str  # "tag" or "scope"
    path: tuple[str, ...]  # the enclosing scopes' labels and this one's; (label,) for tags
    started_wall_s: float
    wall_time_s: float  # when it ended (a tag: when it was taken)
    monotonic_s: float
    duration_s: float
    devices: tuple[DeviceFigures, ...]
    host: HostFigures | None
    error: str | None = None  # a scope left by an exception: its type and message

    @property
    def depth(self) -> int:
        return len(self.path) - 1

    def device(self, index: int) -> DeviceFigures | None:
        return next((figures for figures in self.devices if figures.device == index), None)


class Span:
    """Between :meth:`begin` and :meth:`end`; ``finished`` is what :data:`gpumem.core.peaks.RUNNING` reads."""

    def __init__(self, source: MemorySource, *, keep_peaks: bool = False) -> None:
        self.source = source
        self.keep_peaks = keep_peaks
        self.finished = False
        self.start: Snapshot | None = None
        self.reset_devices: frozenset[int] = frozenset()
        self.resets_at_start: dict[int | None, int] = {}
        self._lock = threading.Lock()
        self._sampled_allocated: dict[int, int] = {}
        self._sampled_reserved: dict[int, int] = {}
        self._sampled_rss = 0
        self._began_perf_s = 0.0
        self._began_wall_s = 0.0

    def begin(self, start: Snapshot | None = None) -> Span:
        """Read the start (or take ``start``) and reset the raised counters unless another measurement runs."""
        RUNNING.add(self)
        keep = self.keep_peaks or RUNNING.others_running(self)
        try:
            start = start if start is not None else self.source.snapshot()
            reset = [] if keep else reset_raised_peaks(self.source, start.allocator)
            PEAK_RESETS.install()
            self.resets_at_start = PEAK_RESETS.snapshot()
        except BaseException:
            self.finished = True
            raise
        self.start, self.reset_devices = start, frozenset(reset)
        self._began_perf_s, self._began_wall_s = time.perf_counter(), time.time()
        self.take_sample(start)
        return self

    def take_sample(self, snapshot: Snapshot) -> None:
        """Fold one sample into the running maxima (sampler thread and caller alike)."""
        with self._lock:
            for reading in snapshot.allocator:
                device = reading.device
                self._sampled_allocated[device] = max(self._sampled_allocated.get(device, 0), reading.allocated_bytes)
                self._sampled_reserved[device] = max(self._sampled_reserved.get(device, 0), reading.reserved_bytes)
            if snapshot.host is not None:
                self._sampled_rss = max(self._sampled_rss, snapshot.host.rss_bytes)

    def end(
        self, label: str, kind: str, path: tuple[str, ...], error: str | None = None
    ) -> tuple[SpanRecord, Snapshot]:
        """Read the end and build the record; the counter wrapper goes when nothing else is measured."""
        duration_s = time.perf_counter() - self._began_perf_s
        try:
            end = self.source.snapshot()
        finally:
            self.finished = True
        self.take_sample(end)
        start = self.start
        assert start is not None
        devices = tuple(self._device(reading, start, end) for reading in end.allocator)
        PEAK_RESETS.release()
        record = SpanRecord(
            label, kind, path, self._began_wall_s, end.wall_time_s, end.monotonic_s, duration_s,
            devices, self._host(start, end), error,
        )  # fmt: skip
        return record, end

    def _device(self, after: AllocatorReading, start: Snapshot, end: Snapshot) -> DeviceFigures:
        device = after.device
        before = start.allocator_for(device)
        with self._lock:
            sampled_allocated = self._sampled_allocated.get(device, 0)
            sampled_reserved = self._sampled_reserved.get(device, 0)
        peak = cell_peak(
            before,
            after,
            sampled_allocated,
            sampled_reserved,
            reset_at_start=device in self.reset_devices,
            reset_in_cell=PEAK_RESETS.reset_since(device, self.resets_at_start),
        )
        nvml = end.device_for(device)
        return DeviceFigures(
            device,
            after.allocated_bytes,
            after.reserved_bytes,
            before.allocated_bytes if before is not None else 0,
            before.reserved_bytes if before is not None else 0,
            peak.allocated_bytes,
            peak.reserved_bytes,
            peak.exact,
            peak.note,
            nvml.used_bytes if nvml is not None else None,
            nvml.total_bytes if nvml is not None else None,
        )

    def _host(self, start: Snapshot, end: Snapshot) -> HostFigures | None:
        if start.host is None or end.host is None:
            return None
        before, after = start.host, end.host
        if after.peak_rss_bytes > before.peak_rss_bytes:
            return HostFigures(after.rss_bytes, before.rss_bytes, after.peak_rss_bytes, True)
        with self._lock:
            sampled = max(self._sampled_rss, before.rss_bytes, after.rss_bytes)
        return HostFigures(after.rss_bytes, before.rss_bytes, sampled, False)


def first_tag_record(label: str, snapshot: Snapshot) -> SpanRecord:
    """The first tag has no earlier tag: its peak is the counter's own value, whatever it covers."""
    devices = []
    for reading in snapshot.allocator:
        nvml = snapshot.device_for(reading.device)
        devices.append(
            DeviceFigures(
                reading.device, reading.allocated_bytes, reading.reserved_bytes,
                reading.allocated_bytes, reading.reserved_bytes,
                reading.peak_allocated_bytes, reading.peak_reserved_bytes, True, FIRST_TAG_NOTE,
                nvml.used_bytes if nvml is not None else None, nvml.total_bytes if nvml is not None else None,
            )
        )  # fmt: skip
    host = snapshot.host
    host_figures = HostFigures(host.rss_bytes, host.rss_bytes, host.peak_rss_bytes, True) if host is not None else None
    return SpanRecord(
        label, "tag", (label,), snapshot.wall_time_s, snapshot.wall_time_s, snapshot.monotonic_s, 0.0,
        tuple(devices), host_figures,
    )  # fmt: skip


def combine(earlier: SpanRecord, later: SpanRecord, label: str) -> SpanRecord:
    """One record for two back-to-back spans: the start of the first, the end of the second, the higher peak.

    Exact only where both peaks are; a device that appeared in the second span alone keeps its figures.
    """
    devices = []
    for second in later.devices:
        first = earlier.device(second.device)
        if first is None:
            devices.append(second)
            continue
        exact = first.peak_exact and second.peak_exact
        devices.append(
            second._replace(
                allocated_before_bytes=first.allocated_before_bytes,
                reserved_before_bytes=first.reserved_before_bytes,
                peak_allocated_bytes=max(first.peak_allocated_bytes, second.peak_allocated_bytes),
                peak_reserved_bytes=max(first.peak_reserved_bytes, second.peak_reserved_bytes),
                peak_exact=exact,
                peak_note="" if exact else (first.peak_note or second.peak_note),
            )
        )
    host = later.host
    if host is not None and earlier.host is not None:
        host = host._replace(
            rss_before_bytes=earlier.host.rss_before_bytes,
            peak_rss_bytes=max(earlier.host.peak_rss_bytes, host.peak_rss_bytes),
            peak_exact=(host.peak_exact and host.peak_rss_bytes >= earlier.host.peak_rss_bytes)
            or (earlier.host.peak_exact and earlier.host.peak_rss_bytes >= host.peak_rss_bytes),
        )
    return later._replace(
        label=label,
        path=(label,),
        started_wall_s=earlier.started_wall_s,
        duration_s=earlier.duration_s + later.duration_s,
        devices=tuple(devices),
        host=host,
    )
