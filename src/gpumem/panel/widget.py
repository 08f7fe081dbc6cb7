"""The live memory panel: ipywidgets + bqplot, kept up to date by one background writer thread.

Threads, and who may touch widget state:

* the sampler thread (shared through :func:`gpumem.core.monitor.default_monitor`) only records samples;
  a panel's listener copies the latest snapshot and updates its peak trackers, nothing else;
* the front end's messages (button clicks, option changes, view counts) arrive on the kernel's
  comm thread, which with JupyterLab >= 4.4 and ipykernel 7 runs *while a cell is executing*. Their
  handlers only queue a command and wake the writer;
* Free runs on its own short-lived worker thread, so a slow ``gc.collect`` never blocks the comm
  thread or the writer;
* one writer thread, shared by every open panel, is the only one that sets widget traits after a
  panel is built (``hold_sync`` is not thread-safe). It sends nothing while no view of a panel is
  shown, and pushes curves no faster than the rate, the scroll speed and the byte budget allow.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import html
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple

import bqplot
import ipywidgets as widgets
import numpy as np

from gpumem.core.cleanup import FreeResult
from gpumem.core.cleanup import free as free_memory
from gpumem.core.monitor import Monitor, default_monitor
from gpumem.core.sampler import channels_of
from gpumem.core.sources import DeviceInfo, MemorySource, Snapshot
from gpumem.core.units import format_bytes, format_delta
from gpumem.panel.frame import (
    CAPACITY_COLOR,
    DEFAULT_POINTS_PER_LINE,
    DEFAULT_RATE_HZ,
    DEFAULT_THRESHOLD,
    DEFAULT_WINDOW_S,
    MARK_COLOR,
    WINDOW_PRESETS,
    CurveFrame,
    PanelOptions,
    PeakTracker,
    RecentSamples,
    build_curve_frame,
    build_header,
    curve_interval_s,
    parse_device,
    parse_rate,
    parse_threshold,
    parse_window,
    render_header,
    render_legend,
    window_label,
)

__all__ = ["Panel", "PanelStats", "close_all", "open_panels"]

# A view that was just displayed but has not reported itself yet (older front ends report only
# once the running cell ends) is treated as shown for this long.
_UNREPORTED_VIEW_GRACE_S = 15.0
_IDLE_WAIT_S = 1.0
_ALL_DEVICES = -1
# Raw samples kept in the panel's own numpy copy: the 1 min and 10 min windows read from it.
_RECENT_SPAN_S = 660.0


class PanelStats(NamedTuple):
    """What a panel has sent so far, for tests and the traffic benchmark."""

    curve_pushes: int
    header_pushes: int
    points_per_line: int
    curves: int
    last_payload_bytes: int
    last_interval_s: float
    views: int
    visible: bool


_STYLE = """<style>
.gpumem-panel{border:1px solid var(--jp-border-color2,#e0e0e0);border-radius:6px;padding:8px 10px 4px;
 background:var(--jp-layout-color1,#fff);color:var(--jp-ui-font-color1,#1f2937);
 font-family:var(--jp-ui-font-family,system-ui,-apple-system,'Segoe UI',sans-serif);box-sizing:border-box}
.gpumem-panel .gm-title{font-weight:600;font-size:13px;margin:0 0 4px}
.gpumem-panel .gm-cards{display:flex;flex-wrap:wrap;gap:6px;margin-top:6px}
.gpumem-panel .gm-card{flex:1 1 86px;min-width:78px;padding:3px 7px 4px;border-radius:4px;
 background:var(--jp-layout-color2,#f3f4f6);border-left:3px solid var(--jp-border-color2,#d1d5db)}
.gpumem-panel .gm-c-a{border-left-color:#2563eb}.gpumem-panel .gm-c-r{border-left-color:#7fb0f5}
.gpumem-panel .gm-c-u{border-left-color:#6b7280}
.gpumem-panel .gm-c-alert{border-left-color:#dc2626;background:rgba(220,38,38,.12);color:#b91c1c}
.gpumem-panel .gm-label{font-size:11px;color:var(--jp-ui-font-color2,#6b7280)}
.gpumem-panel .gm-c-alert .gm-label,.gpumem-panel .gm-c-alert .gm-sub{color:#b91c1c}
body[data-jp-theme-light="false"] .gpumem-panel .gm-c-alert,
body[data-jp-theme-light="false"] .gpumem-panel .gm-c-alert .gm-label,
body[data-jp-theme-light="false"] .gpumem-panel .gm-c-alert .gm-sub,
body[data-jp-theme-light="false"] .gpumem-panel .gm-row-alert td,
body[data-jp-theme-light="false"] .gpumem-panel .gm-err{color:#f87171}
.gpumem-panel .gm-value{font-size:15px;font-weight:600;white-space:nowrap;font-variant-numeric:tabular-nums}
.gpumem-panel .gm-sub{font-size:10.5px;color:var(--jp-ui-font-color2,#6b7280);white-space:nowrap}
.gpumem-panel .gm-bar{position:relative;display:flex;height:8px;border-radius:4px;margin:4px 0 2px;
 background:var(--jp-layout-color3,#e5e7eb)}
.gpumem-panel .gm-bar span{display:block;height:100%}
.gpumem-panel .gm-bar span:first-child{border-radius:4px 0 0 4px}
.gpumem-panel .gm-bar .gm-a{background:#2563eb}.gpumem-panel .gm-bar .gm-r{background:#7fb0f5}
.gpumem-panel .gm-bar .gm-u{background:#9ca3af}
.gpumem-panel .gm-bar.gm-alert .gm-a{background:#dc2626}.gpumem-panel .gm-bar.gm-alert .gm-r{background:#f19999}
.gpumem-panel .gm-bar .gm-tick{position:absolute;top:-3px;bottom:-3px;width:2px;background:#dc2626;opacity:.8}
.gpumem-panel .gm-host,.gpumem-panel .gm-note{font-size:11.5px;color:var(--jp-ui-font-color2,#6b7280);margin-top:4px}
.gpumem-panel .gm-note{font-style:italic}
.gpumem-panel .gm-dim{color:var(--jp-ui-font-color2,#6b7280)}
.gpumem-panel .gm-table{border-collapse:collapse;font-size:12px;width:100%;font-variant-numeric:tabular-nums}
.gpumem-panel .gm-table th{font-weight:500;text-align:left;color:var(--jp-ui-font-color2,#6b7280);padding:1px 8px 1px 0}
.gpumem-panel .gm-table td{padding:1px 8px 1px 0;white-space:nowrap}
.gpumem-panel .gm-row-alert td{color:#b91c1c;font-weight:600}
.gpumem-panel .gm-legend{display:flex;flex-wrap:wrap;gap:4px 14px;font-size:11.5px;margin:6px 0 0 8px;
 color:var(--jp-ui-font-color1,#374151)}
.gpumem-panel .gm-key i{display:inline-block;width:16px;height:3px;margin-right:5px;vertical-align:middle;
 border-radius:1px}
.gpumem-panel .gm-key i.gm-dash{height:0;border-top:2px dashed;background:none}
.gpumem-panel .gm-key i.gm-vline{width:0;height:11px;border-left:1px dashed;background:none;border-radius:0}
.gpumem-panel .gm-msg{font-size:12px;min-height:18px;padding:2px 0}
.gpumem-panel .gm-ok{color:#15803d}.gpumem-panel .gm-err{color:#b91c1c}
.gpumem-panel .gm-paused{color:#b45309;font-weight:600}
.gpumem-panel .widget-toggle-buttons .widget-toggle-button{width:auto;padding:0 8px}
</style>"""

_DEEP_HELP = (
    "Deep also drops IPython's own references before collecting: the output cache (Out, _, __, ___, _N) "
    "and the last exception's traceback, which keep tensors alive that no variable names. Those values "
    "are gone afterwards, so it is off by default."
)
_FREE_HELP = (
    "gc.collect(), then torch.cuda.empty_cache() on every initialized device: returns PyTorch's cached, "
    "unused blocks to the driver. Tensors still referenced stay. Safe while a cell runs."
)


# ------------------------------------------------------------------------------------------------
# The one writer thread
# ------------------------------------------------------------------------------------------------


class _Writer:
    """Runs every open panel's updates on one daemon thread; stops when the last panel closes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._panels: list[Panel] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def add(self, panel: Panel) -> None:
        with self._lock:
            if panel not in self._panels:
                self._panels.append(panel)
            if self._thread is None or not self._thread.is_alive():
                self._stop = threading.Event()
                self._thread = threading.Thread(
                    target=self._run, args=(self._stop,), name="gpumem-panel-writer", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def remove(self, panel: Panel) -> None:
        with self._lock:
            if panel in self._panels:
                self._panels.remove(panel)
            thread = self._thread if not self._panels else None
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
                panels = list(self._panels)
            next_due = time.monotonic() + _IDLE_WAIT_S
            for panel in panels:
                if stop.is_set():
                    return
                due = panel._service()
                next_due = min(next_due, due)
            self._wake.wait(max(0.0, min(_IDLE_WAIT_S, next_due - time.monotonic())))


_writer = _Writer()
_registry_lock = threading.Lock()
_open: list[Panel] = []


def open_panels() -> list[Panel]:
    with _registry_lock:
        return list(_open)


def close_all() -> None:
    """Close every open panel: stops the writer thread, and the sampler where a panel started it."""
    for panel in open_panels():
        panel.close()


def _acquire_sampler(monitor: Monitor, panel: Panel) -> None:
    monitor.acquire(("panel", id(panel)))


def _release_sampler(monitor: Monitor, panel: Panel) -> None:
    monitor.release(("panel", id(panel)))


# ------------------------------------------------------------------------------------------------
# Free
# ------------------------------------------------------------------------------------------------


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


def _run_free(deep: bool, shell: Any, source: MemorySource) -> FreeOutcome:
    began = time.perf_counter()
    rss_before = _host_rss(source)
    try:
        result = free_memory(deep=deep, shell=shell, source=source)
    except Exception as error:
        return FreeOutcome(None, f"{type(error).__name__}: {error}", time.perf_counter() - began, None)
    rss_after = _host_rss(source)
    host = rss_before - rss_after if rss_before is not None and rss_after is not None else None
    return FreeOutcome(result, None, time.perf_counter() - began, host)


def describe_free(outcome: FreeOutcome) -> tuple[str, bool]:
    """One line for the panel: what Free gave back per device and on the host, or why it failed."""
    result = outcome.result
    if result is None:
        return f"Free failed: {outcome.error}", False
    parts: list[str] = []
    for d in result.devices:
        parts.append(
            f"cuda:{d.device} reserved {format_bytes(d.reserved_before_bytes)} → {format_bytes(d.reserved_after_bytes)}"
            f" ({format_delta(-d.reserved_reclaimed_bytes)}), allocated {format_delta(-d.allocated_reclaimed_bytes)}"
        )
    if outcome.host_rss_freed_bytes is not None:
        parts.append(f"host RSS {format_delta(-outcome.host_rss_freed_bytes)}")
    parts.append(f"gc collected {result.collected_objects} object{'' if result.collected_objects == 1 else 's'}")
    if result.released:
        parts.append("released " + ", ".join(result.released))
    if result.kept:
        held = "; ".join(result.kept[:3]) + ("; …" if len(result.kept) > 3 else "")
        parts.append(f"IPython still holds {held}" + ("" if result.deep else " (tick deep to release)"))
    if result.note:
        parts.append(result.note)
    reclaimed = result.reserved_reclaimed_bytes
    if result.devices:
        head = f"Freed {format_bytes(max(reclaimed, 0))} of GPU memory"
    elif outcome.host_rss_freed_bytes is not None and outcome.host_rss_freed_bytes > 0:
        head = f"Freed {format_bytes(outcome.host_rss_freed_bytes)} of host memory"
    else:
        head = "Freed nothing"
    return f"{head} ({outcome.elapsed_s:.2f} s): " + "; ".join(parts), True


# ------------------------------------------------------------------------------------------------
# The panel
# ------------------------------------------------------------------------------------------------


def _walk_widgets(root: Any) -> Iterator[Any]:
    """Every widget reachable from ``root`` through its traits (layouts, styles, scales, marks...)."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        widget = stack.pop()
        if id(widget) in seen:
            continue
        seen.add(id(widget))
        yield widget
        for name in widget.trait_names():
            if name in ("comm", "keys"):
                continue
            with contextlib.suppress(Exception):
                value = getattr(widget, name)
                values = (
                    value.values()
                    if isinstance(value, dict)
                    else value
                    if isinstance(value, (list, tuple))
                    else [value]
                )
                stack.extend(v for v in values if isinstance(v, widgets.Widget) and id(v) not in seen)


def _dates(values_ms: np.ndarray) -> np.ndarray:
    return np.asarray(values_ms, dtype=np.float64).astype("datetime64[ms]")


def _date(value_ms: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(value_ms / 1000.0)


class Panel(widgets.VBox):  # type: ignore[misc]
    """Live GPU memory: curves per device, a header of current figures, and a Free button.

    ``Panel()`` in a notebook cell (or ``%gpumem monitor``) shows it. Every panel reads the shared
    monitor, so several panels cost one sampler; ``close()`` releases what the panel holds. ``window``,
    ``device``, ``threshold`` and ``rate_hz`` take what ``%gpumem monitor`` takes; ``compact`` suits
    a narrow sidebar; ``autostart=False`` leaves the sampler to the caller (tests sample by hand).
    """

    def __init__(
        self,
        monitor: Monitor | None = None,
        *,
        window: str | float | None = DEFAULT_WINDOW_S,
        device: str | int | None = None,
        threshold: str | float = DEFAULT_THRESHOLD,
        rate_hz: str | float = DEFAULT_RATE_HZ,
        host: bool = False,
        full_scale: bool = False,
        points_per_line: int = DEFAULT_POINTS_PER_LINE,
        autostart: bool = True,
        compact: bool = False,
        shell: Any = None,
    ) -> None:
        if monitor is not None and not isinstance(monitor, Monitor):
            raise TypeError(f"Panel(monitor=...) takes a gpumem.Monitor, not {type(monitor).__name__}")
        if isinstance(points_per_line, bool) or not isinstance(points_per_line, int):
            raise TypeError(f"points_per_line must be a whole number between 4 and 2000, not {points_per_line!r}")
        options = PanelOptions(
            window_s=parse_window(window),
            device=parse_device(device),
            threshold=parse_threshold(threshold),
            rate_hz=parse_rate(rate_hz),
            show_host=bool(host),
            full_scale=bool(full_scale),
            points_per_line=points_per_line,
        )
        if not 4 <= options.points_per_line <= 2000:
            raise ValueError(f"points_per_line must be between 4 and 2000, not {points_per_line!r}")
        built = self._build(options, compact)
        super().__init__(children=built, _view_count=0)
        self.add_class("gpumem-panel")
        self.layout.width = "100%"
        self._options = options
        self._monitor = monitor if monitor is not None else default_monitor()
        self._autostart = autostart
        self._shell = shell if shell is not None else _current_shell()
        self._closed = False
        self._service_lock = threading.RLock()
        self._data_lock = threading.Lock()
        self._commands: deque[tuple[Any, ...]] = deque()
        self._latest: Snapshot | None = None
        self._device_peaks: dict[int, PeakTracker] = {}
        self._host_peak = PeakTracker()
        self._infos: dict[int, DeviceInfo | None] = {}
        self._paused = False
        self._acquired = False
        self._displayed_at: float | None = None
        self._views_reported = False
        self._next_header = 0.0
        self._next_curves = 0.0
        self._curves_dirty = True
        self._last_marks_key: tuple[Any, ...] | None = None
        self._last_devices: tuple[int, ...] | None = None
        self._message_until = 0.0
        self._free_lock = threading.Lock()
        self._free_thread: threading.Thread | None = None
        self._last_free: FreeOutcome | None = None
        self._stats = PanelStats(0, 0, 0, 0, 0, 0.0, 0, False)
        self._last_frame: CurveFrame | None = None
        self._error: str | None = None
        self._connect()
        rate_hz = self._monitor.sampler.rate_hz
        self._recent = RecentSamples(int(_RECENT_SPAN_S * rate_hz * 1.1) + 16)
        with _registry_lock:
            _open.append(self)
        self._monitor.sampler.add_listener(self._on_sample)
        self._recent.seed(self._monitor.timeline, time.monotonic(), _RECENT_SPAN_S)
        # The figures at opening: the baseline of "peak since open" and a header before the first tick.
        with contextlib.suppress(Exception):
            self._note_snapshot(self._monitor.snapshot())
        _writer.add(self)

    # Building -----------------------------------------------------------------------------------
    def _build(self, options: PanelOptions, compact: bool) -> list[Any]:
        self._style = widgets.HTML(_STYLE, layout=widgets.Layout(display="none"))
        self._header = widgets.HTML(
            '<div class="gm-header"><div class="gm-note">Waiting for the first sample.</div></div>'
        )
        self._legend = widgets.HTML("")
        self._x_scale = bqplot.DateScale()
        self._y_scale = bqplot.LinearScale(min=0.0, max=1.0)
        scales = {"x": self._x_scale, "y": self._y_scale}
        self._x_axis = bqplot.Axis(
            scale=self._x_scale, tick_format="%H:%M:%S", grid_lines="none", num_ticks=3 if compact else 5
        )
        self._y_axis = bqplot.Axis(
            scale=self._y_scale,
            side="left",
            label="GiB",
            tick_format=".4~g",
            grid_lines="dashed",
            label_offset="40px",
        )
        self._cell_lines = bqplot.Lines(
            x=np.zeros(0), y=np.zeros(0), scales=scales, colors=[MARK_COLOR], stroke_width=1.0,
            line_style="dashed", visible=False,
        )  # fmt: skip
        self._curves = bqplot.Lines(x=np.zeros(0), y=np.zeros(0), scales=scales, stroke_width=1.8, visible=False)
        self._capacity = bqplot.Lines(
            x=np.zeros(0), y=np.zeros(0), scales=scales, colors=[CAPACITY_COLOR], stroke_width=1.4,
            line_style="dashed", visible=False,
        )  # fmt: skip
        self._cell_labels = bqplot.Label(
            x=np.zeros(0), y=np.zeros(0), text=np.zeros(0, dtype=str), scales=scales, colors=[MARK_COLOR],
            default_size=11.0, align="end", x_offset=-3, y_offset=11, visible=False,
        )  # fmt: skip
        self._figure = bqplot.Figure(
            marks=[self._cell_lines, self._curves, self._capacity, self._cell_labels],
            axes=[self._x_axis, self._y_axis],
            fig_margin={"top": 10, "bottom": 26, "left": 56, "right": 30},
            padding_y=0.0,
            animation_duration=0,
            display_toolbar=False,
            min_aspect_ratio=0.0,
            max_aspect_ratio=100.0,
            layout=widgets.Layout(width="100%", height="250px", min_width="180px"),
        )
        auto_width = {"width": "auto"}
        self._free_button = widgets.Button(
            description="Free", icon="broom", tooltip=_FREE_HELP, button_style="primary", layout=auto_width
        )
        self._deep = widgets.Checkbox(
            value=False, description="deep", indent=False, tooltip=_DEEP_HELP,
            layout=widgets.Layout(width="auto", margin="0 12px 0 4px"),
        )  # fmt: skip
        self._pause_button = widgets.Button(
            description="Pause", icon="pause", tooltip="Freeze the panel (sampling goes on)", layout=auto_width
        )
        self._reset_button = widgets.Button(
            description="Reset peak",
            icon="undo",
            tooltip="Restart 'peak since open' from now (PyTorch's own peak counters are left alone)",
            layout=auto_width,
        )
        presets = [label for label, _ in WINDOW_PRESETS]
        current = window_label(options.window_s)
        if current not in presets:
            presets.append(current)
        self._window_values = {label: seconds for label, seconds in WINDOW_PRESETS}
        self._window_values[current] = options.window_s
        self._window = widgets.ToggleButtons(
            options=presets, value=current, tooltips=["time window"] * len(presets),
            style={"button_width": "auto"}, layout=widgets.Layout(width="auto", margin="0 8px"),
        )  # fmt: skip
        device_value = _ALL_DEVICES if options.device is None else options.device
        device_options = [("all devices", _ALL_DEVICES)]
        if options.device is not None:
            device_options.append((f"cuda:{options.device}", options.device))
        self._device = widgets.Dropdown(
            options=device_options, value=device_value, layout=widgets.Layout(width="150px", display="none")
        )
        self._host = widgets.Checkbox(
            value=options.show_host, description="host RSS", indent=False,
            layout=widgets.Layout(width="auto", margin="0 8px 0 0"),
        )  # fmt: skip
        self._full_scale = widgets.Checkbox(
            value=options.full_scale, description="full scale", indent=False,
            tooltip="y axis up to the device's capacity",
            layout=widgets.Layout(width="auto"),
        )  # fmt: skip
        self._controls = widgets.HBox(
            [self._free_button, self._deep, self._pause_button, self._reset_button, self._window, self._device,
             self._host, self._full_scale],
            layout=widgets.Layout(flex_flow="row wrap", align_items="center", width="100%"),
        )  # fmt: skip
        self._message = widgets.HTML('<div class="gm-msg"></div>')
        return [self._style, self._header, self._legend, self._figure, self._controls, self._message]

    def _connect(self) -> None:
        """Handlers run on the comm thread (possibly while a cell runs): they only queue work."""
        self._free_button.on_click(lambda _b: self.free(deep=bool(self._deep.value), wait=False))
        self._pause_button.on_click(lambda _b: self._post(("pause",)))
        self._reset_button.on_click(lambda _b: self._post(("reset_peak",)))
        for control in (self._window, self._device, self._host, self._full_scale):
            control.observe(lambda _change: self._post(("options",)), names="value")
        self.observe(self._on_views, names="_view_count")

    # Public API ---------------------------------------------------------------------------------
    @property
    def monitor(self) -> Monitor:
        return self._monitor

    @property
    def options(self) -> PanelOptions:
        return self._options

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def visible(self) -> bool:
        """Whether a view of this panel is shown somewhere (updates are sent only then)."""
        return self._is_visible(time.monotonic())

    def stats(self) -> PanelStats:
        return self._stats

    def refresh(self, timeout_s: float = 10.0) -> bool:
        """Have the writer push current figures now, shown or not; True once it has."""
        if self._closed:
            return False
        done = threading.Event()
        if threading.current_thread() is _writer.thread:
            self._service(force=True)
            return True
        self._post(("refresh", done))
        return done.wait(timeout_s)

    def free(self, deep: bool = False, *, wait: bool = True, timeout_s: float = 120.0) -> FreeOutcome | None:
        """Run Free on a worker thread (as the button does); with ``wait``, return its outcome."""
        with self._free_lock:
            running = self._free_thread is not None and self._free_thread.is_alive()
            if running:
                thread = self._free_thread
                if not wait:
                    self._post(("message", "Free is already running.", None))
                    return None
            else:
                self._post(("free_started", deep))
                thread = threading.Thread(target=self._free_worker, args=(deep,), name="gpumem-free", daemon=True)
                self._free_thread = thread
                thread.start()
        if not wait:
            return None
        assert thread is not None
        thread.join(timeout_s)
        return self._last_free

    def close(self) -> None:
        """Remove the panel: its widgets, its share of the sampler, and the writer when it was the last."""
        if getattr(self, "_closed", True):
            if getattr(self, "comm", None) is not None:
                super().close()
            return
        self._closed = True
        with _registry_lock:
            if self in _open:
                _open.remove(self)
        with self._service_lock:
            pass  # wait for an update in flight
        _writer.remove(self)
        self._monitor.sampler.remove_listener(self._on_sample)
        if self._acquired:
            self._acquired = False
            _release_sampler(self._monitor, self)
        thread = self._free_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(10.0)
        for widget in list(_walk_widgets(self))[1:]:
            with contextlib.suppress(Exception):
                widget.close()
        super().close()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        if not self._closed:
            self._displayed_at = time.monotonic()
            self._acquire()
            _writer.wake()
        return super()._repr_mimebundle_(**kwargs)

    # Threads other than the writer: only queue and wake --------------------------------------------
    def _post(self, command: tuple[Any, ...]) -> None:
        self._commands.append(command)
        _writer.wake()

    def _on_views(self, change: dict[str, Any]) -> None:
        self._views_reported = True
        if (change.get("new") or 0) > 0:
            self._acquire()
        self._post(("views",))

    def _on_sample(self, snapshot: Snapshot) -> None:
        """Sampler thread: keep the latest snapshot, recent samples and the peaks since open up to date."""
        self._recent.append(snapshot.monotonic_s, channels_of(snapshot))
        self._note_snapshot(snapshot)

    def _note_snapshot(self, snapshot: Snapshot) -> None:
        with self._data_lock:
            self._latest = snapshot
            for reading in snapshot.allocator:
                tracker = self._device_peaks.get(reading.device)
                if tracker is None:
                    tracker = self._device_peaks[reading.device] = PeakTracker()
                tracker.update(reading.allocated_bytes, reading.peak_allocated_bytes)
            if snapshot.host is not None:
                self._host_peak.update(snapshot.host.rss_bytes, snapshot.host.peak_rss_bytes)

    def _free_worker(self, deep: bool) -> None:
        outcome = _run_free(deep, self._shell, self._monitor.source)
        self._last_free = outcome
        self._post(("free_done", outcome))

    def _acquire(self) -> None:
        if self._autostart and not self._acquired and not self._closed:
            self._acquired = True
            _acquire_sampler(self._monitor, self)

    def _is_visible(self, now: float) -> bool:
        if (self._view_count or 0) > 0:
            return True
        return (
            not self._views_reported
            and self._displayed_at is not None
            and now - self._displayed_at < _UNREPORTED_VIEW_GRACE_S
        )

    # The writer thread --------------------------------------------------------------------------
    def _service(self, force: bool = False) -> float:
        """Apply queued commands, then push what is due; returns when to come back (monotonic s)."""
        if self.comm is None and not self._closed:
            # The front end or ipywidgets closed our comm: release everything.
            threading.Thread(target=self.close, name="gpumem-panel-close", daemon=True).start()
            return math.inf
        refreshed: list[threading.Event] = []
        with self._service_lock:
            if self._closed:
                return math.inf
            try:
                return self._service_locked(force, refreshed)
            except Exception as error:
                text = f"Panel update failed: {type(error).__name__}: {error}"
                if text != self._error:
                    self._error = text
                    with contextlib.suppress(Exception):
                        self._message.value = f'<div class="gm-msg gm-err">{html.escape(text)}</div>'
                return time.monotonic() + _IDLE_WAIT_S
            finally:
                for event in refreshed:
                    event.set()

    def _service_locked(self, force: bool, refreshed: list[threading.Event]) -> float:
        while self._commands:
            command = self._commands.popleft()
            kind = command[0]
            if kind == "refresh":
                force = True
                refreshed.append(command[1])
            else:
                self._apply(command)
        now = time.monotonic()
        visible = self._is_visible(now)
        self._stats = self._stats._replace(views=int(self._view_count or 0), visible=visible)
        if not force and (self._paused or not visible):
            return now + _IDLE_WAIT_S
        if force or now >= self._next_header:
            self._push_header()
            self._next_header = now + 1.0 / self._options.rate_hz
        if force or self._curves_dirty or now >= self._next_curves:
            interval = self._push_curves(now)
            self._next_curves = now + interval
            self._curves_dirty = False
        return min(self._next_header, self._next_curves)

    def _apply(self, command: tuple[Any, ...]) -> None:
        kind = command[0]
        if kind == "free_started":
            self._free_button.disabled = True
            self._free_button.description = "Freeing…"
            deep = " (deep: IPython's output cache and last exception too)" if command[1] else ""
            self._set_message(f"Freeing{deep}: gc.collect(), then empty_cache()…", None)
        elif kind == "free_done":
            outcome: FreeOutcome = command[1]
            text, ok = describe_free(outcome)
            self._free_button.disabled = False
            self._free_button.description = "Free"
            self._set_message(text, ok)
            self._curves_dirty = True
            self._next_header = 0.0
        elif kind == "message":
            self._set_message(command[1], command[2])
        elif kind == "pause":
            self._paused = not self._paused
            self._pause_button.description = "Resume" if self._paused else "Pause"
            self._pause_button.icon = "play" if self._paused else "pause"
            if self._paused:
                self._set_message(
                    "Paused: the panel is frozen; sampling goes on. Resume to catch up.", None, css="gm-paused"
                )
            else:
                self._set_message("", None)
                self._curves_dirty = True
                self._next_header = 0.0
        elif kind == "reset_peak":
            with self._data_lock:
                for tracker in self._device_peaks.values():
                    tracker.reset()
                self._host_peak.reset()
                latest = self._latest
            if latest is not None:
                self._note_snapshot(latest)  # the new baseline
            self._next_header = 0.0
        elif kind == "options":
            self._read_options()
        elif kind == "views":
            self._curves_dirty = True
            self._next_header = 0.0

    def _read_options(self) -> None:
        device = self._device.value
        self._options = self._options._replace(
            window_s=self._window_values.get(self._window.value, DEFAULT_WINDOW_S),
            device=None if device in (None, _ALL_DEVICES) else int(device),
            show_host=bool(self._host.value),
            full_scale=bool(self._full_scale.value),
        )
        self._curves_dirty = True
        self._next_header = 0.0

    def _set_message(self, text: str, ok: bool | None, css: str = "") -> None:
        kind = css or ("gm-ok" if ok else "gm-err" if ok is False else "")
        self._message.value = f'<div class="gm-msg {kind}">{html.escape(text)}</div>'

    def _device_info(self, device: int) -> DeviceInfo | None:
        if device not in self._infos:
            try:
                self._infos[device] = self._monitor.source.device_info(device)
            except Exception:
                self._infos[device] = None
        return self._infos[device]

    def _push_header(self) -> None:
        with self._data_lock:
            snapshot = self._latest
            peaks = {index: _frozen(tracker) for index, tracker in self._device_peaks.items()}
            host_peak = _frozen(self._host_peak)
        devices: tuple[int, ...] = ()
        if snapshot is not None:
            devices = tuple(sorted({r.device for r in snapshot.allocator} | {d.device for d in snapshot.devices}))
            for index in devices:
                self._device_info(index)
        self._sync_device_choice(devices)
        try:
            status = self._monitor.status()
        except Exception as error:
            status = {"torch": f"unavailable: {error}"}
        model = build_header(snapshot, self._infos, peaks, host_peak, status, self._options.device)
        text, _alert = render_header(model, self._options.threshold)
        if text != self._header.value:
            self._header.value = text
            self._stats = self._stats._replace(header_pushes=self._stats.header_pushes + 1)

    def _sync_device_choice(self, devices: tuple[int, ...]) -> None:
        if devices == self._last_devices:
            return
        self._last_devices = devices
        options: list[tuple[str, int]] = [("all devices", _ALL_DEVICES)]
        for index in devices:
            info = self._infos.get(index)
            options.append((f"cuda:{index}" + (f" · {info.name}" if info is not None else ""), index))
        current = self._device.value
        if current not in [value for _label, value in options]:
            current = _ALL_DEVICES
        with self._device.hold_sync():
            self._device.options = options
            self._device.value = current
        self._device.layout.display = "flex" if len(devices) > 1 else "none"

    def _capacities(self) -> dict[int, int]:
        capacities: dict[int, int] = {}
        snapshot = self._latest
        if snapshot is not None:
            for reading in snapshot.devices:
                capacities[reading.device] = reading.total_bytes
            for allocator in snapshot.allocator:
                info = self._infos.get(allocator.device)
                if allocator.device not in capacities and info is not None:
                    capacities[allocator.device] = info.total_bytes
        return capacities

    def _push_curves(self, now: float) -> float:
        wall_offset = time.time() - time.monotonic()
        frame = build_curve_frame(
            self._monitor.timeline, self._options, now, wall_offset, self._capacities(), self._recent
        )
        self._apply_frame(frame)
        self._last_frame = frame
        interval = curve_interval_s(self._options, frame.payload_bytes)
        self._stats = self._stats._replace(
            curve_pushes=self._stats.curve_pushes + 1,
            points_per_line=frame.points_per_line,
            curves=len(frame.curves),
            last_payload_bytes=frame.payload_bytes,
            last_interval_s=interval,
        )
        return interval

    def _apply_frame(self, frame: CurveFrame) -> None:
        x = _dates(frame.x_ms)
        with self._x_scale.hold_sync():
            self._x_scale.min = _date(frame.x_min_ms)
            self._x_scale.max = _date(frame.x_max_ms)
        tick_format = "%H:%M:%S" if (frame.x_max_ms - frame.x_min_ms) <= 15 * 60_000 else "%H:%M"
        if self._x_axis.tick_format != tick_format:
            self._x_axis.tick_format = tick_format
        if self._y_scale.max != frame.y_max:
            with self._y_axis.hold_sync():
                self._y_scale.max = frame.y_max
                self._y_axis.tick_values = np.asarray(frame.y_ticks, dtype=np.float64)
        if self._y_axis.label != frame.unit:
            self._y_axis.label = frame.unit
        if frame.curves and frame.points_per_line >= 2:  # one point is no line (and bqplot squeezes it away)
            with self._curves.hold_sync():
                self._curves.x = x
                self._curves.y = frame.y
                self._curves.colors = [c.color for c in frame.curves]
                self._curves.opacities = [c.opacity for c in frame.curves]
                self._curves.labels = [c.label for c in frame.curves]
                self._curves.visible = True
        elif self._curves.visible:
            self._curves.visible = False
        with self._capacity.hold_sync():
            if frame.capacity:
                self._capacity.x = _dates(np.array([frame.x_min_ms, frame.x_max_ms]))
                self._capacity.y = np.array([[c, c] for c in frame.capacity], dtype=np.float32)
                self._capacity.visible = True
            elif self._capacity.visible:
                self._capacity.visible = False
        marks_key = (tuple(frame.mark_x_ms.tolist()), frame.mark_labels, frame.y_max)
        if marks_key != self._last_marks_key:
            self._last_marks_key = marks_key
            count = len(frame.mark_labels)
            with self._cell_lines.hold_sync():
                if count:
                    self._cell_lines.x = _dates(np.repeat(frame.mark_x_ms[:, None], 2, axis=1))
                    self._cell_lines.y = np.tile(np.array([0.0, frame.y_max], dtype=np.float32), (count, 1))
                self._cell_lines.visible = count > 0
            with self._cell_labels.hold_sync():
                if count:
                    self._cell_labels.x = _dates(frame.mark_x_ms)
                    self._cell_labels.y = np.full(count, frame.y_max, dtype=np.float32)
                    self._cell_labels.text = np.array(frame.mark_labels)
                self._cell_labels.visible = count > 0
        legend = render_legend(frame)
        if legend != self._legend.value:
            self._legend.value = legend


def _frozen(tracker: PeakTracker) -> PeakTracker:
    """A copy the writer can read while the sampler thread keeps updating the original."""
    copy = PeakTracker()
    copy.__dict__.update(tracker.__dict__)
    return copy


def _current_shell() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()
