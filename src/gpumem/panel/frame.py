"""What the live panel shows, computed without any widget: curves, axis ranges and header figures.

Kept apart from the widgets so every number can be checked exactly from a fake source, and so the
writer thread only copies finished values into widgets. Nothing here imports IPython or ipywidgets.
"""

from __future__ import annotations

import html
import math
import re
import threading
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from gpumem.core.devices import parse_cuda_device as parse_device
from gpumem.core.sources import DeviceInfo, Snapshot
from gpumem.core.timeline import Timeline
from gpumem.core.units import GIB, MIB, format_bytes

__all__ = [
    "DEFAULT_BUDGET_BYTES_PER_S",
    "DEFAULT_POINTS_PER_LINE",
    "DEFAULT_RATE_HZ",
    "DEFAULT_THRESHOLD",
    "DEFAULT_WINDOW_S",
    "MAX_POINTS_PER_LINE",
    "WINDOW_PRESETS",
    "Curve",
    "CurveFrame",
    "DeviceFigures",
    "HeaderModel",
    "HostFigures",
    "PanelOptions",
    "PeakTracker",
    "RecentSamples",
    "build_curve_frame",
    "build_header",
    "choose_curves",
    "curve_interval_s",
    "decimate_arrays",
    "nice_axis",
    "parse_device",
    "parse_rate",
    "parse_threshold",
    "parse_window",
    "render_header",
    "render_legend",
    "window_label",
]


# The panel's four time windows; None means everything the timeline still holds.
WINDOW_PRESETS: tuple[tuple[str, float | None], ...] = (
    ("1 min", 60.0),
    ("10 min", 600.0),
    ("1 h", 3600.0),
    ("all", None),
)
DEFAULT_WINDOW_S = 600.0
DEFAULT_THRESHOLD = 0.9
# Curves and header are pushed at most this often; bqplot re-sends and redraws whole lines each time.
DEFAULT_RATE_HZ = 2.0
MIN_RATE_HZ = 0.2
MAX_RATE_HZ = 10.0
# A line is drawn across ~1000 px: min/max pairs at one per pixel keep every peak visible.
DEFAULT_POINTS_PER_LINE = 1000
MAX_POINTS_PER_LINE = 2000
# Curve data budget; with the header (sent only when its text changes) the panel stays under 50 KB/s.
DEFAULT_BUDGET_BYTES_PER_S = 36_000
# Pushing faster than the window scrolls by one pixel of this nominal width draws nothing new.
NOMINAL_PLOT_WIDTH_PX = 1000
# Marker labels beyond this many in the window are dropped, oldest first, to keep them readable.
MAX_CELL_MARKS = 40
# Bytes added to each pushed message on top of its arrays (JSON state and the Jupyter message header).
MESSAGE_OVERHEAD_BYTES = 900

_BLUE = "#2563eb"
_LIGHT_BLUE = "#7fb0f5"
_GREY = "#6b7280"
_GREEN = "#16a34a"
CAPACITY_COLOR = "#dc2626"
MARK_COLOR = "#9ca3af"
# Allocated curves per device in the all-devices view; reserved uses the same colour, fainter.
_DEVICE_COLORS = ("#2563eb", "#d97706", "#059669", "#7c3aed", "#db2777", "#0891b2", "#65a30d", "#b91c1c")


# ------------------------------------------------------------------------------------------------
# Options
# ------------------------------------------------------------------------------------------------


class PanelOptions(NamedTuple):
    """What one panel shows and how often it may send."""

    window_s: float | None = DEFAULT_WINDOW_S  # None: all history the timeline holds
    device: int | None = None  # None: every device
    threshold: float = DEFAULT_THRESHOLD  # fraction of capacity at which the header turns red
    rate_hz: float = DEFAULT_RATE_HZ
    show_host: bool = False
    full_scale: bool = False  # y axis up to the device capacity
    points_per_line: int = DEFAULT_POINTS_PER_LINE
    budget_bytes_per_s: int = DEFAULT_BUDGET_BYTES_PER_S


_DURATION = re.compile(
    r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|secs|second|seconds|m|min|mins|minute|minutes|h|hr|hour|hours)?\s*$"
)
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_window(value: str | float | None) -> float | None:
    """``'10min'``, ``'1 h'``, ``'90s'``, ``600`` (seconds) or ``'all'`` (None) -> seconds."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        if text in ("all", "everything"):
            return None
        match = _DURATION.match(text)
        if match is None:
            raise ValueError(f"window must be a duration such as 1min, 10min, 1h or all, not {value!r}")
        unit = (match.group(2) or "s")[0]
        seconds = float(match.group(1)) * _UNIT_S["h" if unit == "h" else unit]
    if not (math.isfinite(seconds) and seconds >= 5):
        raise ValueError(f"window must be at least 5 seconds, not {value!r}")
    return seconds


def window_label(window_s: float | None) -> str:
    """The preset's name, or a short duration (``'5 min'``, ``'90 s'``, ``'2 h'``)."""
    for label, seconds in WINDOW_PRESETS:
        if seconds == window_s:
            return label
    assert window_s is not None
    if window_s % 3600 == 0:
        return f"{window_s / 3600:g} h"
    if window_s % 60 == 0:
        return f"{window_s / 60:g} min"
    return f"{window_s:g} s"


def parse_threshold(value: str | float) -> float:
    """``0.9``, ``'90%'`` or ``90`` -> 0.9: the fraction of capacity that turns the header red."""
    text = str(value).strip()
    percent = text.endswith("%")
    try:
        number = float(text.rstrip("%").strip())
    except ValueError:
        raise ValueError(f"threshold must be a fraction (0.9) or a percentage (90%), not {value!r}") from None
    if percent or number > 1:
        number /= 100
    if not (math.isfinite(number) and 0 < number <= 1):
        raise ValueError(f"threshold must be between 0 and 100%, not {value!r}")
    return number


def parse_rate(value: str | float) -> float:
    """Updates per second, between 0.2 and 10."""
    try:
        rate = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"rate must be a number of updates per second, not {value!r}") from None
    if not (math.isfinite(rate) and MIN_RATE_HZ <= rate <= MAX_RATE_HZ):
        raise ValueError(f"rate must be between {MIN_RATE_HZ:g} and {MAX_RATE_HZ:g} updates per second, not {value!r}")
    return rate


# ------------------------------------------------------------------------------------------------
# Peaks since the panel opened
# ------------------------------------------------------------------------------------------------


class PeakTracker:
    """Highest value since a start instant, from samples and a monotone peak counter.

    The allocator's peak counter is exact but may predate the start (then it says nothing about
    the time since) or be reset by someone else. It is trusted once it rises above its value at the
    start, or once it drops (a reset happened after the start). Otherwise the highest sampled value
    is shown as a lower bound (``exact`` is False).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._sampled: float | None = None
        self._counter_start: float | None = None
        self._counter_last: float | None = None
        self._counter_peak: float | None = None
        self._was_reset = False

    def update(self, current: float, counter: float | None) -> None:
        self._sampled = current if self._sampled is None else max(self._sampled, current)
        if counter is None:
            return
        if self._counter_start is None:
            self._counter_start = self._counter_last = counter
            return
        last = self._counter_last if self._counter_last is not None else counter
        if counter < last:
            self._was_reset = True
        self._counter_last = counter
        if self._was_reset or counter > self._counter_start:
            self._counter_peak = counter if self._counter_peak is None else max(self._counter_peak, counter)

    @property
    def value(self) -> float | None:
        candidates = [v for v in (self._sampled, self._counter_peak) if v is not None]
        return max(candidates) if candidates else None

    @property
    def exact(self) -> bool:
        """True when the counter has covered the whole time since the start without a reset."""
        return self._counter_peak is not None and not self._was_reset and self._counter_peak >= (self._sampled or 0)


# ------------------------------------------------------------------------------------------------
# Header
# ------------------------------------------------------------------------------------------------


class DeviceFigures(NamedTuple):
    """One device's figures for the header; None means not measurable now (shown as n/a)."""

    device: int
    name: str | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    used_bytes: int | None  # whole device, NVML
    total_bytes: int | None
    peak_allocated_bytes: int | None  # since the panel opened (or Reset peak)
    peak_exact: bool

    @property
    def fragmentation_bytes(self) -> int | None:
        """Reserved but not allocated: cached by PyTorch, held from other processes, used by no tensor."""
        if self.allocated_bytes is None or self.reserved_bytes is None:
            return None
        return self.reserved_bytes - self.allocated_bytes

    @property
    def capacity_fraction(self) -> float | None:
        """Whole-device use over capacity (NVML), else PyTorch's reserved over capacity."""
        if not self.total_bytes:
            return None
        numerator = self.used_bytes if self.used_bytes is not None else self.reserved_bytes
        return None if numerator is None else numerator / self.total_bytes


class HostFigures(NamedTuple):
    rss_bytes: int
    peak_rss_bytes: int | None  # since the panel opened (or Reset peak)
    peak_exact: bool
    available_bytes: int
    total_bytes: int


class HeaderModel(NamedTuple):
    """Everything the header shows, ready to render."""

    devices: tuple[DeviceFigures, ...]
    host: HostFigures | None
    notes: tuple[str, ...]  # plain sentences: why something is not shown
    cuda_in_use: bool


def _reason(status: Mapping[str, str], key: str) -> str | None:
    value = status.get(key)
    if value is None or value == "ok":
        return None
    return value.removeprefix("unavailable: ")


def build_header(
    snapshot: Snapshot | None,
    infos: Mapping[int, DeviceInfo | None],
    device_peaks: Mapping[int, PeakTracker],
    host_peak: PeakTracker | None,
    status: Mapping[str, str],
    device: int | None = None,
) -> HeaderModel:
    """Figures per device (only ``device`` when given) and for the host, with plain-language notes."""
    notes: list[str] = []
    if snapshot is None:
        return HeaderModel((), None, ("Waiting for the first sample.",), False)
    indices = sorted({r.device for r in snapshot.allocator} | {d.device for d in snapshot.devices})
    torch_reason = _reason(status, "torch")
    nvml_reason = _reason(status, "nvml")
    cuda_in_use = bool(snapshot.allocator)
    if not indices:
        notes.append(_sentence(f"No CUDA device is in use: {torch_reason or 'no GPU is visible to this process'}"))
    elif not cuda_in_use:
        notes.append(
            f"PyTorch's figures appear once CUDA is in use ({torch_reason or 'not initialized'}); "
            "device used is the whole GPU, all processes."
        )
    elif nvml_reason:
        notes.append(f"Device used: unavailable ({nvml_reason.rstrip('.?')}); capacity from PyTorch.")
    if device is not None and indices and device not in indices:
        notes.append(f"cuda:{device} is not visible to this process; showing every device.")
        device = None
    figures: list[DeviceFigures] = []
    for index in indices:
        if device is not None and index != device:
            continue
        allocator = snapshot.allocator_for(index)
        nvml = snapshot.device_for(index)
        info = infos.get(index)
        total = nvml.total_bytes if nvml is not None else (info.total_bytes if info is not None else None)
        tracker = device_peaks.get(index)
        figures.append(
            DeviceFigures(
                device=index,
                name=info.name if info is not None else None,
                allocated_bytes=allocator.allocated_bytes if allocator is not None else None,
                reserved_bytes=allocator.reserved_bytes if allocator is not None else None,
                used_bytes=nvml.used_bytes if nvml is not None else None,
                total_bytes=total,
                peak_allocated_bytes=_int_or_none(tracker.value) if tracker is not None and allocator else None,
                peak_exact=tracker.exact if tracker is not None else False,
            )
        )
    host: HostFigures | None = None
    if snapshot.host is not None:
        host = HostFigures(
            rss_bytes=snapshot.host.rss_bytes,
            peak_rss_bytes=_int_or_none(host_peak.value) if host_peak is not None else None,
            peak_exact=host_peak.exact if host_peak is not None else False,
            available_bytes=snapshot.host.available_bytes,
            total_bytes=snapshot.host.total_bytes,
        )
    elif not indices:
        notes.append(_sentence(f"Host memory: {_reason(status, 'host') or 'unavailable'}"))
    return HeaderModel(tuple(figures), host, tuple(notes), cuda_in_use)


def _sentence(text: str) -> str:
    return text if text.endswith((".", "?", "!")) else text + "."


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def _size(value: int | None) -> str:
    return "n/a" if value is None else format_bytes(value)


def _peak(value: int | None, exact: bool) -> str:
    if value is None:
        return "n/a"
    return format_bytes(value) if exact else f"≥ {format_bytes(value)}"


_PEAK_TIP = (
    "Highest PyTorch allocation since the panel opened or Reset peak. Exact when PyTorch's own peak counter "
    "covers that time; '≥' marks the highest sampled value, a lower bound."
)
_FRAG_TIP = (
    "reserved - allocated: cached by PyTorch but used by no tensor (fragmentation). Free returns it to the driver."
)
_USED_TIP = "Whole device as NVML reports it: every process, CUDA contexts included."


def _card(label: str, value: str, tip: str, css: str = "", sub: str = "") -> str:
    sub_html = f'<div class="gm-sub">{html.escape(sub)}</div>' if sub else ""
    return (
        f'<div class="gm-card {css}" title="{html.escape(tip)}"><div class="gm-label">{html.escape(label)}</div>'
        f'<div class="gm-value">{html.escape(value)}</div>{sub_html}</div>'
    )


def _bar(figures: DeviceFigures, threshold: float, alert: bool) -> str:
    """A capacity bar: allocated, then reserved, then the rest of device used, with the threshold tick."""
    total = figures.total_bytes
    if not total:
        return ""
    allocated = figures.allocated_bytes or 0
    reserved = max(figures.reserved_bytes or 0, allocated)
    used = max(figures.used_bytes if figures.used_bytes is not None else reserved, reserved)
    parts = [(allocated, "gm-a"), (reserved - allocated, "gm-r"), (used - reserved, "gm-u")]
    segments = "".join(
        f'<span class="{css}" style="width:{100 * min(size, total) / total:.2f}%"></span>'
        for size, css in parts
        if size > 0
    )
    return (
        f'<div class="gm-bar{" gm-alert" if alert else ""}">{segments}'
        f'<span class="gm-tick" style="left:{100 * threshold:.1f}%" title="threshold {100 * threshold:.0f}%">'
        "</span></div>"
    )


def render_header(model: HeaderModel, threshold: float) -> tuple[str, bool]:
    """The header's HTML (classes styled by the panel's stylesheet) and whether any device is over threshold."""
    alert = any((f.capacity_fraction or 0) >= threshold for f in model.devices)
    parts: list[str] = ['<div class="gm-header">']
    if len(model.devices) == 1:
        parts.append(_render_single(model.devices[0], threshold))
    elif model.devices:
        parts.append(_render_table(model.devices, threshold))
    if model.host is not None:
        host = model.host
        if model.devices:
            parts.append(
                f'<div class="gm-host">Host: RSS {format_bytes(host.rss_bytes)} · peak since open '
                f"{_peak(host.peak_rss_bytes, host.peak_exact)} · machine {format_bytes(host.total_bytes)}, "
                f"{format_bytes(host.available_bytes)} available</div>"
            )
        else:
            fraction = 1 - host.available_bytes / host.total_bytes if host.total_bytes else 0.0
            parts.append('<div class="gm-title">Host memory</div>')
            parts.append('<div class="gm-cards">')
            parts.append(_card("process RSS", format_bytes(host.rss_bytes), "Resident memory of this kernel process."))
            parts.append(
                _card(
                    "peak since open",
                    _peak(host.peak_rss_bytes, host.peak_exact),
                    "Highest RSS since the panel opened or Reset peak ('≥': highest sampled value).",
                )
            )
            parts.append(
                _card(
                    "machine in use",
                    f"{100 * fraction:.0f} %",
                    "All processes on this machine, from the memory the OS reports as available.",
                    sub=f"{format_bytes(host.total_bytes - host.available_bytes)} of {format_bytes(host.total_bytes)}",
                )
            )
            parts.append("</div>")
    for note in model.notes:
        parts.append(f'<div class="gm-note">{html.escape(note)}</div>')
    parts.append("</div>")
    return "".join(parts), alert


def _device_title(figures: DeviceFigures) -> str:
    name = f" · {figures.name}" if figures.name else ""
    total = f" · {format_bytes(figures.total_bytes)}" if figures.total_bytes else ""
    return f"cuda:{figures.device}{name}{total}"


def _render_single(figures: DeviceFigures, threshold: float) -> str:
    fraction = figures.capacity_fraction
    alert = fraction is not None and fraction >= threshold
    percent = "n/a" if fraction is None else f"{100 * fraction:.1f} %"
    state = f"over the {100 * threshold:.0f} % threshold" if alert else f"threshold {100 * threshold:.0f} %"
    basis = "device used" if figures.used_bytes is not None else "reserved"
    cards = [
        _card("allocated", _size(figures.allocated_bytes), "Memory held by live PyTorch tensors.", "gm-c-a"),
        _card(
            "reserved",
            _size(figures.reserved_bytes),
            "Memory PyTorch's caching allocator holds from the driver.",
            "gm-c-r",
        ),
        _card(
            "device used",
            _size(figures.used_bytes),
            _USED_TIP,
            "gm-c-u",
            sub=f"of {_size(figures.total_bytes)}",
        ),
        _card(
            "of capacity",
            percent,
            f"{basis.capitalize()} over the device's capacity; the header turns red at the threshold.",
            "gm-c-alert" if alert else "",
            sub=state,
        ),
        _card("peak since open", _peak(figures.peak_allocated_bytes, figures.peak_exact), _PEAK_TIP),
        _card("fragmentation", _size(figures.fragmentation_bytes), _FRAG_TIP, sub="reserved - allocated"),
    ]
    return (
        f'<div class="gm-title">{html.escape(_device_title(figures))}</div>'
        f"{_bar(figures, threshold, alert)}"
        f'<div class="gm-cards">{"".join(cards)}</div>'
    )


def _render_table(devices: Sequence[DeviceFigures], threshold: float) -> str:
    head = "".join(
        f"<th>{h}</th>"
        for h in ("device", "allocated", "reserved", "device used", "of capacity", "peak since open", "fragmentation")
    )
    rows: list[str] = []
    for f in devices:
        fraction = f.capacity_fraction
        alert = fraction is not None and fraction >= threshold
        name = f" {html.escape(f.name)}" if f.name else ""
        cells = (
            f'<td title="{html.escape(_device_title(f))}">cuda:{f.device}<span class="gm-dim">{name}</span></td>',
            f"<td>{_size(f.allocated_bytes)}</td>",
            f"<td>{_size(f.reserved_bytes)}</td>",
            f'<td title="{html.escape(_USED_TIP)}">{_size(f.used_bytes)} / {_size(f.total_bytes)}</td>',
            f"<td>{'n/a' if fraction is None else f'{100 * fraction:.1f} %'}</td>",
            f"<td>{html.escape(_peak(f.peak_allocated_bytes, f.peak_exact))}</td>",
            f"<td>{_size(f.fragmentation_bytes)}</td>",
        )
        rows.append(f'<tr class="{"gm-row-alert" if alert else ""}">{"".join(cells)}</tr>')
    return (
        f'<div class="gm-title">{len(devices)} CUDA devices · threshold {100 * threshold:.0f} %</div>'
        f'<table class="gm-table"><tr>{head}</tr>{"".join(rows)}</table>'
    )


# ------------------------------------------------------------------------------------------------
# Curves
# ------------------------------------------------------------------------------------------------


class Curve(NamedTuple):
    """One plotted line: the timeline channel it reads and how it is drawn."""

    channel: str
    label: str
    color: str
    opacity: float


def choose_curves(channels: Sequence[str], device: int | None, show_host: bool) -> tuple[Curve, ...]:
    """Lines for the channels the timeline has: allocated, reserved and device used per device, host RSS.

    With every device shown and several of them, the device-used line is left out (one colour per
    device, reserved fainter) so that eight GPUs stay readable; the header still lists it.
    """
    present = set(channels)
    indices = sorted(
        {int(name.split("/")[0].removeprefix("cuda:")) for name in present if name.startswith("cuda:") and "/" in name}
    )
    if device is not None and device in indices:
        indices = [device]
    curves: list[Curve] = []
    several = len(indices) > 1
    for position, index in enumerate(indices):
        prefix = f"cuda:{index}"
        color = _DEVICE_COLORS[position % len(_DEVICE_COLORS)] if several else _BLUE
        tag = f"{prefix} " if several else ""
        if f"{prefix}/allocated" in present:
            curves.append(Curve(f"{prefix}/allocated", f"{tag}allocated", color, 1.0))
        if f"{prefix}/reserved" in present:
            curves.append(
                Curve(
                    f"{prefix}/reserved", f"{tag}reserved", color if several else _LIGHT_BLUE, 0.45 if several else 1.0
                )
            )
        if f"{prefix}/used" in present and not several:
            curves.append(Curve(f"{prefix}/used", "device used (all processes)", _GREY, 0.9))
    if "host/rss" in present and (show_host or not indices):
        curves.append(Curve("host/rss", "host RSS", _GREEN, 1.0))
    return tuple(curves)


class CurveFrame(NamedTuple):
    """One push of the plot: shared x, one row of y per curve, axis ranges, capacity and cell markers."""

    x_ms: np.ndarray  # float64 wall-clock milliseconds (the date scale's unit)
    y: np.ndarray  # float32, shape (len(curves), len(x_ms)), in ``unit``
    curves: tuple[Curve, ...]
    unit: str
    unit_bytes: int
    x_min_ms: float
    x_max_ms: float
    y_max: float
    y_ticks: tuple[float, ...]
    capacity: tuple[float, ...]  # per shown device, in ``unit``; only those within the y range
    capacity_off_scale: tuple[float, ...]  # capacities above the y range, in bytes
    mark_x_ms: np.ndarray
    mark_labels: tuple[str, ...]

    @property
    def points_per_line(self) -> int:
        return len(self.x_ms)

    @property
    def payload_bytes(self) -> int:
        """What one push sends: x, y, markers and a fixed allowance per message."""
        marks = self.mark_x_ms.size * (8 + 8 + 8) + sum(len(label) + 4 for label in self.mark_labels)
        return int(self.x_ms.nbytes + self.y.nbytes + marks + 6 * MESSAGE_OVERHEAD_BYTES)


def _unit_for(max_bytes: float) -> tuple[str, int]:
    return ("GiB", GIB) if max_bytes >= GIB else ("MiB", MIB)


def decimate_arrays(times: np.ndarray, data: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized min/max decimation: at most ``max_points`` per line, every bucket's extremes kept.

    Like :func:`gpumem.core.timeline.decimate_min_max`: each bucket becomes two points, its lowest and
    highest value in the order they occurred, at the bucket's first and middle time.
    """
    count = times.size
    if count <= max_points:
        return times, data
    buckets = max_points // 2
    size = -(-count // buckets)
    padded = buckets * size
    starts = np.arange(buckets) * size
    keep = starts < count
    starts = starts[keep]
    lines = data.shape[0]
    grid = np.full((lines, padded), np.nan)
    grid[:, :count] = data
    grid = grid.reshape(lines, buckets, size)[:, keep, :]
    empty = np.all(np.isnan(grid), axis=2)
    low_at = np.argmin(np.where(np.isnan(grid), np.inf, grid), axis=2)
    high_at = np.argmax(np.where(np.isnan(grid), -np.inf, grid), axis=2)
    low = np.take_along_axis(grid, low_at[..., None], axis=2)[..., 0]
    high = np.take_along_axis(grid, high_at[..., None], axis=2)[..., 0]
    low[empty] = np.nan
    high[empty] = np.nan
    low_first = low_at <= high_at
    out = np.empty((lines, starts.size * 2))
    out[:, 0::2] = np.where(low_first, low, high)
    out[:, 1::2] = np.where(low_first, high, low)
    middles = np.minimum(starts + size // 2, count - 1)
    out_times = np.empty(starts.size * 2)
    out_times[0::2] = times[starts]
    out_times[1::2] = times[middles]
    return out_times, out


class RecentSamples:
    """The newest raw samples of every channel in numpy rings, fed from the sampler's listener.

    The timeline answers any window but reads it row by row in Python; a panel pushing a 10-minute
    window about once a second would hold the GIL for ~10 ms each time. This copy makes that read a
    few numpy operations. It starts with the timeline's recent raw samples, so it can tell whether a
    window's start is within what it holds.
    """

    def __init__(self, capacity: int) -> None:
        self._lock = threading.Lock()
        self.capacity = max(16, int(capacity))
        self._times = np.full(self.capacity, np.nan)
        self._rows: dict[str, int] = {}
        self._values = np.full((0, self.capacity), np.nan)
        self._head = 0
        self._count = 0
        self._complete_from = math.inf  # everything the timeline has from here on is held

    def seed(self, timeline: Timeline, now_s: float, span_s: float) -> None:
        """Copy the timeline's raw samples of the last ``span_s`` seconds."""
        start = now_s - span_s
        series = timeline.window(start, now_s, max_points=self.capacity)
        older = timeline.window(-math.inf, start, max_points=4)
        with self._lock:
            # Samples the listener added meanwhile are newer than the seed: put the seed before them.
            order = (np.arange(self._count) + self._head - self._count) % self.capacity
            newer_times = self._times[order]
            newer = [{name: self._values[row, slot] for name, row in self._rows.items()} for slot in order]
            first_newer = float(newer_times[0]) if newer_times.size else math.inf
            self._head = self._count = 0
            for index, time_s in enumerate(series.times):
                if time_s < first_newer:
                    self._append_locked(time_s, {name: column[index] for name, column in series.values.items()})
            for time_s, values in zip(newer_times.tolist(), newer, strict=True):
                self._append_locked(time_s, values)
            oldest = self._oldest_locked()
            self._complete_from = -math.inf if not older.times else (oldest if oldest is not None else now_s)

    def append(self, time_s: float, values: Mapping[str, float]) -> None:
        with self._lock:
            self._append_locked(time_s, values)

    def _append_locked(self, time_s: float, values: Mapping[str, float]) -> None:
        if self._count and time_s <= self._times[(self._head - 1) % self.capacity]:
            return
        for name in values:
            if name not in self._rows:
                self._rows[name] = len(self._rows)
                self._values = np.vstack([self._values, np.full((1, self.capacity), np.nan)])
        slot = self._head
        self._times[slot] = time_s
        self._values[:, slot] = np.nan
        for name, value in values.items():
            self._values[self._rows[name], slot] = value
        self._head = (slot + 1) % self.capacity
        if self._count == self.capacity:
            self._complete_from = max(self._complete_from, self._times[self._head])
        self._count = min(self._count + 1, self.capacity)

    def _oldest_locked(self) -> float | None:
        if not self._count:
            return None
        return float(self._times[(self._head - self._count) % self.capacity])

    def covers(self, start_s: float) -> bool:
        """True when every sample the timeline has from ``start_s`` on is held here."""
        with self._lock:
            return self._count > 0 and start_s >= self._complete_from

    def window(
        self, start_s: float, end_s: float, max_points: int, channels: Sequence[str]
    ) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            order = (np.arange(self._count) + self._head - self._count) % self.capacity
            times = self._times[order]
            lo = int(np.searchsorted(times, start_s, side="left"))
            hi = int(np.searchsorted(times, end_s, side="right"))
            picked = order[lo:hi]
            times = self._times[picked]
            data = np.full((len(channels), picked.size), np.nan)
            for line, name in enumerate(channels):
                row = self._rows.get(name)
                if row is not None:
                    data[line] = self._values[row, picked]
        return decimate_arrays(times, data, max_points)


def nice_axis(top: float, target: int = 5) -> tuple[float, tuple[float, ...]]:
    """An axis from 0 covering ``top``: round steps (1, 2, 2.5 or 5 times a power of ten) and its ticks."""
    if not (top > 0 and math.isfinite(top)):
        return 1.0, (0.0, 0.5, 1.0)
    raw = top / target
    base = 10.0 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 2.5, 5, 10) if m * base >= raw * (1 - 1e-9))
    count = max(1, math.ceil(top / step - 1e-9))
    ticks = tuple(round(i * step, 10) for i in range(count + 1))
    return ticks[-1], ticks


def build_curve_frame(
    timeline: Timeline,
    options: PanelOptions,
    now_s: float,
    wall_offset_s: float,
    capacities: Mapping[int, int],
    recent: RecentSamples | None = None,
) -> CurveFrame:
    """Read the window, min/max-decimated to ``options.points_per_line``.

    From ``recent`` when it holds the whole window (cheap), else from the timeline. ``wall_offset_s``
    turns monotonic seconds into wall-clock seconds (for a time-of-day axis); ``capacities`` maps
    device index to total bytes.
    """
    curves = choose_curves(timeline.channels, options.device, options.show_host)
    start = -math.inf if options.window_s is None else now_s - options.window_s
    points = max(4, min(options.points_per_line, MAX_POINTS_PER_LINE))
    channels = [c.channel for c in curves]
    if recent is not None and recent.covers(start):
        times, data = recent.window(start, now_s, points, channels)
    else:
        series = timeline.window(start, now_s, points)
        times = np.asarray(series.times, dtype=np.float64)
        rows = [np.asarray(series.values.get(c, [math.nan] * len(times)), dtype=np.float64) for c in channels]
        data = np.vstack(rows) if rows else np.zeros((0, len(times)))
    finite = data[np.isfinite(data)]
    data_max = float(finite.max()) if finite.size else 0.0
    shown_devices = sorted({int(c.channel.split("/")[0][5:]) for c in curves if c.channel.startswith("cuda:")})
    caps = [capacities[d] for d in shown_devices if capacities.get(d)]
    top = data_max * 1.08
    if caps and (options.full_scale or max(caps) <= data_max * 1.6):
        top = max(top, max(caps) * 1.02)
    unit, unit_bytes = _unit_for(max(top, data_max))
    y_max, y_ticks = nice_axis(top / unit_bytes)
    visible_caps = tuple(sorted({c / unit_bytes for c in caps if c / unit_bytes <= y_max}))
    off_scale = tuple(sorted({float(c) for c in caps if c / unit_bytes > y_max}))
    x_max = now_s
    if options.window_s is None:
        x_min = float(times[0]) if times.size else now_s - 60
    else:
        x_min = now_s - options.window_s
        if times.size:
            x_min = max(x_min, float(times[0]))
    x_min = min(x_min, x_max - 10.0)
    marks = timeline.marks(x_min, x_max)[-MAX_CELL_MARKS:]
    return CurveFrame(
        x_ms=(times + wall_offset_s) * 1000.0,
        y=(data / unit_bytes).astype(np.float32),
        curves=curves,
        unit=unit,
        unit_bytes=unit_bytes,
        x_min_ms=(x_min + wall_offset_s) * 1000.0,
        x_max_ms=(x_max + wall_offset_s) * 1000.0,
        y_max=y_max,
        y_ticks=y_ticks,
        capacity=visible_caps,
        capacity_off_scale=off_scale,
        mark_x_ms=np.asarray([(m.time_s + wall_offset_s) * 1000.0 for m in marks], dtype=np.float64),
        mark_labels=tuple(_mark_label(m.label) for m in marks),
    )


def _mark_label(label: str) -> str:
    text = label.strip()
    return f"[{text}]" if text.isdigit() else text[:24]


def curve_interval_s(options: PanelOptions, payload_bytes: int) -> float:
    """Seconds until the next curve push: the rate cap, one pixel of scroll, and the byte budget."""
    interval = 1.0 / options.rate_hz
    if options.window_s is not None:
        interval = max(interval, options.window_s / NOMINAL_PLOT_WIDTH_PX)
    else:
        interval = max(interval, 5.0)
    return max(interval, payload_bytes / options.budget_bytes_per_s)


def render_legend(frame: CurveFrame) -> str:
    """Swatches for each curve, the capacity line and the cell markers, as HTML."""
    devices = {c.channel.split("/")[0] for c in frame.curves if c.channel.startswith("cuda:")}
    if len(devices) > 1:
        # One chip per device; the line style is explained once.
        items = [
            f'<span class="gm-key"><i style="background:{c.color}"></i>{html.escape(c.channel.split("/")[0])}</span>'
            for c in frame.curves
            if c.channel.endswith("/allocated")
        ]
        items.append('<span class="gm-key gm-dim">solid: allocated, faint: reserved</span>')
        items.extend(
            f'<span class="gm-key"><i style="background:{c.color}"></i>{html.escape(c.label)}</span>'
            for c in frame.curves
            if not c.channel.startswith("cuda:")
        )
    else:
        items = [
            f'<span class="gm-key"><i style="background:{c.color};opacity:{c.opacity}"></i>'
            f"{html.escape(c.label)}</span>"
            for c in frame.curves
        ]
    if frame.capacity:
        items.append(
            f'<span class="gm-key"><i class="gm-dash" style="border-color:{CAPACITY_COLOR}"></i>capacity</span>'
        )
    if frame.capacity_off_scale:
        text = ", ".join(format_bytes(c) for c in frame.capacity_off_scale)
        items.append(
            f'<span class="gm-key gm-dim" title="Tick Full scale to see it">capacity {text} (above the plot)</span>'
        )
    if frame.mark_labels:
        items.append(
            f'<span class="gm-key"><i class="gm-vline" style="border-color:{MARK_COLOR}"></i>cell start / Free</span>'
        )
    return '<div class="gm-legend">' + "".join(items) + "</div>"
