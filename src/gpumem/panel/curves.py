"""The plot of the panel: which lines, read from the monitor's timeline, on which axes, with which marks.

:func:`build_curve_frame` reads one window from :class:`gpumem.core.sampling.timeline.Timeline` (the one store
of samples, min/max-decimated there so that every sampled peak stays visible) and computes everything
one push of the plot needs, without any widget. :func:`curve_interval_s` says when the next push is due.
"""

from __future__ import annotations

import functools
import html
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from gpumem.core.sampling.sampler import MAX_RATE_HZ as MAX_SAMPLE_RATE_HZ
from gpumem.core.sampling.sampler import channel_device
from gpumem.core.sampling.timeline import Timeline
from gpumem.core.units import GIB, MIB, format_bytes
from gpumem.panel.options import MAX_POINTS_PER_LINE, MIN_POINTS_PER_LINE, PanelOptions

__all__ = [
    "CAPACITY_COLOR",
    "MARK_COLOR",
    "Curve",
    "CurveFrame",
    "build_curve_frame",
    "choose_curves",
    "curve_interval_s",
    "group_marks",
    "header_interval_s",
    "layout_marks",
    "nice_axis",
    "read_resolution_s",
    "render_legend",
    "sample_rate_hz",
    "with_span_mark",
]

# Pushing faster than the window scrolls by one pixel of this nominal width draws nothing new.
NOMINAL_PLOT_WIDTH_PX = 1000
# A window is sampled this many times over its span: 1 Hz for 10 minutes, a point per 1.7 px or less on
# the widest plot; a line between samples drawn closer than that looks the same. Next to a busy training
# loop each sample costs a few hundred microseconds of CPU (BENCHMARKS.md), so no more are taken.
SAMPLES_PER_WINDOW = 600
# The header's figures come from the newest sample: slower than this and they would lag visibly.
MIN_SAMPLE_RATE_HZ = 1.0
# Marker labels beyond this many in the window are dropped, oldest first, to keep them readable.
MAX_CELL_MARKS = 40
# Room between two cell-marker labels, and the width of one character of their 11 px font (a bound).
MARK_LABEL_GAP_PX = 6
MARK_LABEL_CHAR_PX = 7.0
# A label ends this far left of its line (the Label mark's x_offset) and takes this band at the plot's top
# (its text is centred 11 px below the top, the Label mark's y_offset; its box is about 15 px high).
MARK_LABEL_OFFSET_PX = 3
MARK_LABEL_BAND_PX = 20
# Cell marks closer than this to the first of a run of them are drawn as one line, labelled "[first-last]".
MARK_GROUP_PX = 8.0
# Bytes added to each pushed message on top of its arrays (JSON state and the Jupyter message header).
MESSAGE_OVERHEAD_BYTES = 900
# The window "all" is pushed at most this often; with no fixed span there is no scroll speed to follow.
_ALL_WINDOW_INTERVAL_S = 5.0
# Before the timeline holds this much, the x axis still spans this many seconds.
_MIN_X_SPAN_S = 10.0

_BLUE = "#2563eb"
_LIGHT_BLUE = "#7fb0f5"
_GREY = "#6b7280"
_GREEN = "#16a34a"
CAPACITY_COLOR = "#dc2626"
MARK_COLOR = "#9ca3af"
# Allocated curves per device in the all-devices view; reserved uses the same colour, fainter.
_DEVICE_COLORS = ("#2563eb", "#d97706", "#059669", "#7c3aed", "#db2777", "#0891b2", "#65a30d", "#b91c1c")


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
    indices = sorted({d for d in map(channel_device, present) if d is not None})
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


@functools.lru_cache(maxsize=16)
def _plotted(
    channels: tuple[str, ...], device: int | None, show_host: bool
) -> tuple[tuple[Curve, ...], tuple[int, ...]]:
    """The curves and the devices they show, for one set of channels and choices: the same every push
    until a channel appears or a choice changes, so they are worked out once per key, not per push."""
    curves = choose_curves(channels, device, show_host)
    shown = sorted({d for d in (channel_device(c.channel) for c in curves) if d is not None})
    return curves, tuple(shown)


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
    # Per mark, how high its line reaches, as a fraction of y_max (empty: all the way up). A line that
    # would cross another mark's label stops under the labels' band.
    mark_tops: tuple[float, ...] = ()
    # Per mark, whether its label is drawn right of its line (where it does not fit on the left).
    mark_label_right: tuple[bool, ...] = ()

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


@functools.lru_cache(maxsize=32)
def nice_axis(top: float, target: int = 5) -> tuple[float, tuple[float, ...]]:
    """An axis from 0 covering ``top``: round steps (1, 2, 2.5 or 5 times a power of ten) and its ticks.

    Kept per ``top``: the highest value of a window, and so ``top``, mostly stays the same from push to push.
    """
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
    host_total_bytes: int | None = None,
) -> CurveFrame:
    """Read the window from the timeline, min/max-decimated to ``options.points_per_line``.

    The window is read from the coarsest buckets :func:`read_resolution_s` allows: the default
    10 minutes come straight from the timeline's 1 s buckets, with no decimation left to do.

    ``wall_offset_s`` turns monotonic seconds into wall-clock seconds (for a time-of-day axis);
    ``capacities`` maps device index to total bytes; ``host_total_bytes`` is the machine's RAM, the
    full scale when only the host is plotted.
    """
    curves, shown_devices = _plotted(tuple(timeline.channels), options.device, options.show_host)
    start = -math.inf if options.window_s is None else now_s - options.window_s
    points = max(MIN_POINTS_PER_LINE, min(options.points_per_line, MAX_POINTS_PER_LINE))
    resolution_s = read_resolution_s(options.window_s)
    times, data = _read_window(timeline, start, now_s, points, [c.channel for c in curves], resolution_s)
    finite = data[np.isfinite(data)]
    data_max = float(finite.max()) if finite.size else 0.0
    caps = [capacities[d] for d in shown_devices if capacities.get(d)]
    # Room above the highest line for the marker labels' band: no curve or capacity line crosses a label.
    headroom = 1.0 / (1.0 - MARK_LABEL_BAND_PX / max(options.plot_height_px, 2 * MARK_LABEL_BAND_PX))
    top = data_max * max(1.08, headroom)
    if caps and (options.full_scale or max(caps) <= data_max * 1.6):
        top = max(top, max(caps) * max(1.02, headroom))
    elif options.full_scale and not shown_devices and host_total_bytes and any(c.channel == "host/rss" for c in curves):
        top = max(top, host_total_bytes * max(1.02, headroom))
    unit, unit_bytes = _unit_for(max(top, data_max))
    y_max, y_ticks = nice_axis(top / unit_bytes)
    x_min = _x_min(options.window_s, times, now_s)
    marks = timeline.marks(x_min, now_s)[-MAX_CELL_MARKS:]
    return CurveFrame(
        x_ms=(times + wall_offset_s) * 1000.0,
        y=(data / unit_bytes).astype(np.float32),
        curves=curves,
        unit=unit,
        unit_bytes=unit_bytes,
        x_min_ms=(x_min + wall_offset_s) * 1000.0,
        x_max_ms=(now_s + wall_offset_s) * 1000.0,
        y_max=y_max,
        y_ticks=y_ticks,
        capacity=tuple(sorted({c / unit_bytes for c in caps if c / unit_bytes <= y_max})),
        capacity_off_scale=tuple(sorted({float(c) for c in caps if c / unit_bytes > y_max})),
        mark_x_ms=np.asarray([(m.time_s + wall_offset_s) * 1000.0 for m in marks], dtype=np.float64),
        mark_labels=tuple(_mark_label(m.label) for m in marks),
    )


def with_span_mark(frame: CurveFrame, time_s: float | None, label: str, wall_offset_s: float) -> CurveFrame:
    """``frame`` with a mark where the header's peaks start counting (the panel opened, or Reset peak),
    when the curves show samples from before it: those are not in "peak since open"."""
    if time_s is None or not frame.x_ms.size:
        return frame
    x_ms = (time_s + wall_offset_s) * 1000.0
    if not (frame.x_min_ms < x_ms <= frame.x_max_ms and frame.x_ms[0] < x_ms):
        return frame
    marks = frame.mark_x_ms
    at = int(marks.searchsorted(x_ms))
    labels = (*frame.mark_labels[:at], label, *frame.mark_labels[at:])
    # What np.insert gives, without its generic path (every push passes here).
    return frame._replace(mark_x_ms=np.concatenate((marks[:at], (x_ms,), marks[at:])), mark_labels=labels)


_CELL_LABEL = re.compile(r"\[(\d+)\]")
_CELL_OR_GROUP_LABEL = re.compile(r"\[\d+(?:\u2013\d+)?\]")


def group_marks(frame: CurveFrame, plot_width_px: float) -> CurveFrame:
    """``frame`` with each run of cell marks closer than :data:`MARK_GROUP_PX` to the run's first one
    (at ``plot_width_px``, the narrowest the plot is drawn) drawn as one line at that first mark, labelled
    ``[first-last]``: dense cells make one readable mark, not a barcode. Other marks (the panel opened, a
    Free) stay apart."""
    span_ms = frame.x_max_ms - frame.x_min_ms
    if len(frame.mark_labels) < 2 or span_ms <= 0:  # noqa: PLR2004
        return frame
    positions = (frame.mark_x_ms - frame.x_min_ms) / span_ms * plot_width_px
    xs: list[float] = []
    labels: list[str] = []
    run: list[str] = []  # the cell numbers of the run being grouped
    run_at, run_px = -1, -math.inf  # its mark's index in ``labels`` and its position
    for x_ms, px, label in zip(frame.mark_x_ms.tolist(), positions.tolist(), frame.mark_labels, strict=True):
        cell = _CELL_LABEL.fullmatch(label)
        if cell is not None and run and px - run_px < MARK_GROUP_PX:
            run.append(cell.group(1))
            labels[run_at] = f"[{run[0]}\u2013{run[-1]}]"
            continue
        xs.append(x_ms)
        labels.append(label)
        if cell is not None:  # a named mark (a Free) inside a run of cells leaves the run going
            run, run_at, run_px = [cell.group(1)], len(labels) - 1, px
    if len(xs) == len(frame.mark_labels):
        return frame
    return frame._replace(mark_x_ms=np.asarray(xs, dtype=np.float64), mark_labels=tuple(labels), mark_tops=())


def layout_marks(frame: CurveFrame, plot_width_px: float, plot_height_px: float) -> CurveFrame:
    """``frame`` with its marks grouped (:func:`group_marks`), the labels that do not fit blanked ("" is
    drawn as nothing) and the lines that would cross a label shortened under the labels' band.

    A label ends just left of its line, or starts just right of it where the left has no room. Labels are
    placed in order of importance: where the peaks start (the panel opened, peak reset) and other named
    marks (a Free) first, then cells, newest first; one is kept only where it stays inside the plot and
    clear of the labels kept before it, at ``plot_width_px`` (a lower bound of the real width: a wider plot
    only spreads them further).
    """
    frame = group_marks(frame, plot_width_px)
    span_ms = frame.x_max_ms - frame.x_min_ms
    if not frame.mark_labels or span_ms <= 0:
        return frame
    positions = ((frame.mark_x_ms - frame.x_min_ms) / span_ms * plot_width_px).tolist()
    labels = list(frame.mark_labels)
    named = [i for i in range(len(labels) - 1, -1, -1) if not _CELL_OR_GROUP_LABEL.fullmatch(labels[i])]
    order = named + [i for i in range(len(labels) - 1, -1, -1) if i not in named]
    boxes: dict[int, tuple[float, float]] = {}
    on_right = [False] * len(labels)
    for index in order:
        width = len(labels[index]) * MARK_LABEL_CHAR_PX
        end = positions[index] - MARK_LABEL_OFFSET_PX
        start = positions[index] + MARK_LABEL_OFFSET_PX
        for left, right, is_right in ((end - width, end, False), (start, start + width, True)):
            if labels[index] and left >= 0 and right <= plot_width_px and _clear(left, right, boxes.values()):
                boxes[index], on_right[index] = (left, right), is_right
                break
        else:
            labels[index] = ""
    # A label keeps its pixel offset and width at any width while lines spread out: a line between a label's
    # own line and its far end may cross it at some wider drawing, so it stops under the band.
    reaches = {j: (min(lft, positions[j]) - 1, max(r, positions[j]) + 1) for j, (lft, r) in boxes.items()}
    under_band = 1.0 - MARK_LABEL_BAND_PX / max(plot_height_px, 2 * MARK_LABEL_BAND_PX)
    tops = tuple(
        under_band if any(lft <= px <= r for j, (lft, r) in reaches.items() if j != i) else 1.0
        for i, px in enumerate(positions)
    )
    return frame._replace(mark_labels=tuple(labels), mark_tops=tops, mark_label_right=tuple(on_right))


def _clear(left: float, right: float, boxes: Iterable[tuple[float, float]]) -> bool:
    """Whether the label box ``left..right`` keeps the gap from every box in ``boxes``."""
    return all(left >= r + MARK_LABEL_GAP_PX or right + MARK_LABEL_GAP_PX <= lft for lft, r in boxes)


def read_resolution_s(window_s: float | None) -> float:
    """The longest bucket a window may be read from: two nominal pixels' worth of time (0: raw samples).

    A bucket is drawn as two points (its extremes, in order), so buckets up to two pixels wide draw at
    least one point per pixel, as raw samples at one per pixel would: 10 minutes read 1 s buckets (1.2 s
    allowed), 1 minute raw samples. The window "all" reads raw samples where they are kept, as before.
    """
    return 0.0 if window_s is None else 2.0 * window_s / NOMINAL_PLOT_WIDTH_PX


def _read_window(
    timeline: Timeline, start_s: float, end_s: float, points: int, channels: Sequence[str], resolution_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """Shared times and one row per channel (NaN where a channel has no value); only these lines are read."""
    window = timeline.window_arrays(start_s, end_s, points, channels, resolution_s=resolution_s)
    if window.channels == tuple(channels):
        return window.times, window.values
    found = dict(zip(window.channels, window.values, strict=True))
    rows = [found.get(c, np.full(window.times.size, math.nan)) for c in channels]
    return window.times, (np.vstack(rows) if rows else np.zeros((0, window.times.size)))


def _x_min(window_s: float | None, times: np.ndarray, now_s: float) -> float:
    """The window's start, or the oldest sample when that is later; at least a few seconds back."""
    if window_s is None:
        x_min = float(times[0]) if times.size else now_s - 60
    else:
        x_min = now_s - window_s
        if times.size:
            x_min = max(x_min, float(times[0]))
    return min(x_min, now_s - _MIN_X_SPAN_S)


def _mark_label(label: str) -> str:
    text = label.strip()
    return f"[{text}]" if text.isdigit() else text[:24]


def sample_rate_hz(options: PanelOptions) -> float:
    """How often the panel needs a sample: :data:`SAMPLES_PER_WINDOW` across its window, at least
    :data:`MIN_SAMPLE_RATE_HZ`, at most the sampler's fastest view rate (1 minute asks for that; the
    default 10 minutes, for 1 Hz)."""
    per_window = SAMPLES_PER_WINDOW / options.window_s if options.window_s is not None else 0.0
    return min(MAX_SAMPLE_RATE_HZ, max(MIN_SAMPLE_RATE_HZ, per_window))


def header_interval_s(options: PanelOptions) -> float:
    """Seconds between header pushes: the refresh cap (``--refresh``), never faster than the panel's samples come."""
    return max(1.0 / options.refresh_hz, 1.0 / sample_rate_hz(options))


def curve_interval_s(options: PanelOptions, payload_bytes: int) -> float:
    """Seconds until the next curve push: the header's interval, one pixel of scroll, and the byte budget."""
    interval = header_interval_s(options)
    if options.window_s is not None:
        interval = max(interval, options.window_s / NOMINAL_PLOT_WIDTH_PX)
    else:
        interval = max(interval, _ALL_WINDOW_INTERVAL_S)
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
