"""The panel's widgets: how they are laid out and how a finished model is drawn into them.

:class:`PanelView` is the VBox of the header, legend, plot, controls and message line. Its ``show_*``
methods copy values computed elsewhere (:mod:`gpumem.panel.header`, :mod:`gpumem.panel.curves`) into
widget traits, sending only what changed; they run on the writer thread only.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import html
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import bqplot
import ipywidgets as widgets
import numpy as np

from gpumem.core.readers.sources import DeviceInfo
from gpumem.panel.curves import CAPACITY_COLOR, MARK_COLOR, CurveFrame, render_legend
from gpumem.panel.options import (
    COMPACT_FIGURE_HEIGHT_PX,
    COMPACT_FIGURE_MIN_WIDTH_PX,
    DEFAULT_WINDOW_S,
    INLINE_FIGURE_HEIGHT_PX,
    INLINE_FIGURE_MIN_WIDTH_PX,
    PLOT_MARGIN_BOTTOM_PX,
    PLOT_MARGIN_LEFT_PX,
    PLOT_MARGIN_RIGHT_PX,
    PLOT_MARGIN_TOP_PX,
    WINDOW_PRESETS,
    PanelOptions,
    window_label,
)

__all__ = ["ALL_DEVICES", "ControlValues", "PanelView"]

# The device dropdown's value for "every device".
ALL_DEVICES = -1
# Above this span the x axis shows hours and minutes only.
_SECONDS_TICKS_UP_TO_MS = 15 * 60_000

_STYLE = """<style>
.gpumem-panel{border:1px solid var(--jp-border-color2,#e0e0e0);border-radius:6px;padding:8px 10px 4px;min-width:0;
 background:var(--jp-layout-color1,#fff);color:var(--jp-ui-font-color1,#1f2937);
 font-family:var(--jp-ui-font-family,system-ui,-apple-system,'Segoe UI',sans-serif);box-sizing:border-box}
.gpumem-panel>*{margin-left:0!important;margin-right:0!important;max-width:100%}
/* ipywidgets sets HTML content's line-height to a widget's 28px: too loose for text that wraps. */
.gpumem-panel .widget-html>.widget-html-content,
.gpumem-panel .jupyter-widget-html>.jupyter-widget-html-content{line-height:1.4}
.gpumem-panel .gm-title{font-weight:600;font-size:13px;margin:0 0 4px}
.gpumem-panel .gm-cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(112px,1fr));gap:6px;margin-top:6px}
.gpumem-panel .gm-card{min-width:0;padding:3px 6px 4px;border-radius:4px;
 background:var(--jp-layout-color2,#f3f4f6);border-left:3px solid var(--jp-border-color2,#d1d5db)}
.gpumem-panel .gm-c-a{border-left-color:#2563eb}.gpumem-panel .gm-c-r{border-left-color:#7fb0f5}
.gpumem-panel .gm-c-u{border-left-color:#6b7280}
.gpumem-panel .gm-c-alert{border-left-color:#dc2626;background:rgba(220,38,38,.12);color:#b91c1c}
.gpumem-panel .gm-label{font-size:11px;color:var(--jp-ui-font-color2,#6b7280);white-space:nowrap;overflow:hidden;
 text-overflow:ellipsis}
.gpumem-panel .gm-c-alert .gm-label,.gpumem-panel .gm-c-alert .gm-sub{color:#b91c1c}
body[data-jp-theme-light="false"] .gpumem-panel .gm-c-alert,
body[data-jp-theme-light="false"] .gpumem-panel .gm-c-alert .gm-label,
body[data-jp-theme-light="false"] .gpumem-panel .gm-c-alert .gm-sub,
body[data-jp-theme-light="false"] .gpumem-panel .gm-row-alert td,
body[data-jp-theme-light="false"] .gpumem-panel .gm-err{color:#f87171}
.gpumem-panel .gm-value{font-size:15px;font-weight:600;white-space:nowrap;font-variant-numeric:tabular-nums}
.gpumem-panel .gm-sub{font-size:10.5px;color:var(--jp-ui-font-color2,#6b7280);overflow-wrap:anywhere}
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
.gpumem-panel .gm-scroll{overflow-x:auto;max-width:100%}
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
.gpumem-panel .widget-toggle-buttons .widget-toggle-button{width:auto;padding:0 7px}
.gpumem-panel .widget-button{padding:0 8px}
.gpumem-panel .gm-controls{flex-flow:row wrap;align-items:center;gap:2px 0;max-width:100%}
.gpumem-panel .gm-controls>*{max-width:100%}
.gpumem-panel .widget-checkbox input:disabled+span{opacity:.8}
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

_FULL_SCALE_HELP = "y axis up to the device's capacity (the machine's RAM when only host RSS is plotted)"
_HOST_HELP = "Also plot this kernel's resident host memory (RSS)"
_HOST_ONLY_HELP = "No GPU in use: the host RSS curve is what the plot shows, so it cannot be hidden"

_PAUSED_TEXT = "Paused: the panel is frozen; sampling goes on. Resume to catch up."


class ControlValues(NamedTuple):
    """What the window, device, host and full-scale controls say now."""

    window_s: float | None
    device: int | None
    show_host: bool
    full_scale: bool



class PanelView(widgets.VBox):  # type: ignore[misc]
    """The panel's widget tree; the ``show_*`` methods are called on the writer thread only."""

    def __init__(self, options: PanelOptions, compact: bool) -> None:
        self._header = widgets.HTML(
            '<div class="gm-header"><div class="gm-note">Waiting for the first sample.</div></div>'
        )
        self._legend = widgets.HTML("")
        figure = self._build_plot(compact)
        actions, settings = self._build_controls(options)
        self._actions = actions  # a loaded (recorded) session hides them
        self._message = widgets.HTML('<div class="gm-msg"></div>')
        style = widgets.HTML(_STYLE, layout=widgets.Layout(display="none"))
        self._last_marks_key: tuple[Any, ...] | None = None
        self._last_devices: tuple[int, ...] | None = None
        self._last_curves: tuple[Any, ...] | None = None
        self._last_axes: tuple[Any, ...] | None = None  # x ends, tick format, y max, unit: as last set
        self._last_legend_key: tuple[Any, ...] | None = None
        super().__init__(
            # Free's result right under its button; the display settings after it.
            children=[style, self._header, self._legend, figure, actions, self._message, settings],
            _view_count=0,
        )
        self.add_class("gpumem-panel")
        self.layout.width = "100%"

    # Building -----------------------------------------------------------------------------------
    def _build_plot(self, compact: bool) -> Any:
        self._x_scale = bqplot.DateScale()
        self._y_scale = bqplot.LinearScale(min=0.0, max=1.0)
        scales = {"x": self._x_scale, "y": self._y_scale}
        self._x_axis = bqplot.Axis(
            scale=self._x_scale, tick_format="%H:%M:%S", grid_lines="none", num_ticks=3 if compact else 5
        )
        self._y_axis = bqplot.Axis(
            scale=self._y_scale, side="left", label="GiB", tick_format=".4~g", grid_lines="dashed",
            label_offset="40px",
        )  # fmt: skip
        self._cell_lines = bqplot.Lines(
            x=np.zeros(0), y=np.zeros(0), scales=scales, colors=[MARK_COLOR], stroke_width=1.0,
            line_style="dashed", visible=False,
        )  # fmt: skip
        self._curves = bqplot.Lines(x=np.zeros(0), y=np.zeros(0), scales=scales, stroke_width=1.8, visible=False)
        across = bqplot.LinearScale(min=0.0, max=1.0)
        self._capacity = bqplot.Lines(
            x=np.array([0.0, 1.0]), y=np.zeros(0), scales={"x": across, "y": self._y_scale},
            colors=[CAPACITY_COLOR], stroke_width=1.4, line_style="dashed", visible=False,
        )  # fmt: skip
        self._last_capacity: tuple[float, ...] = ()
        self._cell_labels = bqplot.Label(
            x=np.zeros(0), y=np.zeros(0), text=np.zeros(0, dtype=str), scales=scales, colors=[MARK_COLOR],
            default_size=11.0, align="end", x_offset=-3, y_offset=11, visible=False,
        )  # fmt: skip
        # The labels with no room left of their line, drawn right of it.
        self._cell_labels_right = bqplot.Label(
            x=np.zeros(0), y=np.zeros(0), text=np.zeros(0, dtype=str), scales=scales, colors=[MARK_COLOR],
            default_size=11.0, align="start", x_offset=3, y_offset=11, visible=False,
        )  # fmt: skip
        min_width = COMPACT_FIGURE_MIN_WIDTH_PX if compact else INLINE_FIGURE_MIN_WIDTH_PX
        height = COMPACT_FIGURE_HEIGHT_PX if compact else INLINE_FIGURE_HEIGHT_PX
        return bqplot.Figure(
            marks=[self._cell_lines, self._curves, self._capacity, self._cell_labels, self._cell_labels_right],
            axes=[self._x_axis, self._y_axis],
            fig_margin={
                "top": PLOT_MARGIN_TOP_PX,
                "bottom": PLOT_MARGIN_BOTTOM_PX,
                "left": PLOT_MARGIN_LEFT_PX,
                "right": PLOT_MARGIN_RIGHT_PX,
            },
            padding_y=0.0,
            animation_duration=0,
            display_toolbar=False,
            min_aspect_ratio=0.0,
            max_aspect_ratio=100.0,
            # Marker labels are spaced for the narrowest plot this min-width allows.
            layout=widgets.Layout(width="100%", height=f"{height}px", min_width=f"{min_width}px"),
        )

    def _build_controls(self, options: PanelOptions) -> tuple[Any, Any]:
        """Two wrapping rows: the actions (Free, Pause, Reset peak), then what the plot shows."""
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
            description="Reset peak", icon="undo",
            tooltip="Restart 'peak since open' from now (PyTorch's own peak counters are left alone)",
            layout=auto_width,
        )  # fmt: skip
        self._window = self._build_window_choice(options.window_s)
        device_options = [("all devices", ALL_DEVICES)]
        if options.device is not None:
            device_options.append((f"cuda:{options.device}", options.device))
        self._device = widgets.Dropdown(
            options=device_options,
            value=ALL_DEVICES if options.device is None else options.device,
            layout=widgets.Layout(width="150px", display="none"),
        )
        self._host = widgets.Checkbox(
            value=options.show_host, description="host RSS", indent=False, tooltip=_HOST_HELP,
            layout=widgets.Layout(width="auto", margin="0 8px 0 0"),
        )  # fmt: skip
        self._full_scale = widgets.Checkbox(
            value=options.full_scale, description="full scale", indent=False,
            tooltip=_FULL_SCALE_HELP, layout=widgets.Layout(width="auto"),
        )  # fmt: skip
        self._host_choice = bool(options.show_host)
        row = {"flex_flow": "row wrap", "align_items": "center", "width": "100%"}
        actions = widgets.HBox(
            [self._free_button, self._deep, self._pause_button, self._reset_button], layout=widgets.Layout(**row)
        )
        settings = widgets.HBox(
            [self._window, self._device, self._host, self._full_scale], layout=widgets.Layout(**row)
        )
        actions.add_class("gm-controls")
        settings.add_class("gm-controls")
        return actions, settings

    def _build_window_choice(self, window_s: float | None) -> Any:
        """The presets, plus the panel's own window when it is none of them."""
        presets = [label for label, _ in WINDOW_PRESETS]
        current = window_label(window_s)
        if current not in presets:
            presets.append(current)
        self._window_values = dict(WINDOW_PRESETS)
        self._window_values[current] = window_s
        return widgets.ToggleButtons(
            options=presets, value=current, tooltips=["time window"] * len(presets),
            style={"button_width": "auto"}, layout=widgets.Layout(width="auto", margin="0 8px 0 0"),
        )  # fmt: skip

    def control_widgets(self) -> tuple[Any, ...]:
        """The controls whose value changes what is shown."""
        return self._window, self._device, self._host, self._full_scale

    def control_values(self) -> ControlValues:
        device = self._device.value
        return ControlValues(
            window_s=self._window_values.get(self._window.value, DEFAULT_WINDOW_S),
            device=None if device in (None, ALL_DEVICES) else int(device),
            show_host=bool(self._host.value),
            full_scale=bool(self._full_scale.value),
        )

    # Drawing (writer thread) ----------------------------------------------------------------------
    def show_header(self, text: str) -> bool:
        """Set the header's HTML; True when it changed (and so was sent)."""
        if text == self._header.value:
            return False
        self._header.value = text
        return True

    def show_message(self, text: str, ok: bool | None, css: str = "") -> None:
        kind = css or ("gm-ok" if ok else "gm-err" if ok is False else "")
        self._message.value = f'<div class="gm-msg {kind}">{html.escape(text)}</div>'

    def show_free_running(self, deep: bool) -> None:
        self._free_button.disabled = True
        self._free_button.description = "Freeing…"
        scope = " (deep: IPython's output cache and last exception too)" if deep else ""
        self.show_message(f"Freeing{scope}: gc.collect(), then empty_cache()…", None)

    def show_free_done(self, text: str, ok: bool) -> None:
        self._free_button.disabled = False
        self._free_button.description = "Free"
        self.show_message(text, ok)

    def show_paused(self, paused: bool) -> None:
        self._pause_button.description = "Resume" if paused else "Pause"
        self._pause_button.icon = "play" if paused else "pause"
        if paused:
            self.show_message(_PAUSED_TEXT, None, css="gm-paused")
        else:
            self.show_message("", None)

    def show_devices(self, devices: tuple[int, ...], infos: Mapping[int, DeviceInfo | None]) -> None:
        """Offer one choice per device (the dropdown is shown only with several)."""
        if devices == self._last_devices:
            return
        self._last_devices = devices
        self._show_host_choice(host_only=not devices)
        options: list[tuple[str, int]] = [("all devices", ALL_DEVICES)]
        for index in devices:
            info = infos.get(index)
            options.append((f"cuda:{index}" + (f" · {info.name}" if info is not None else ""), index))
        current = self._device.value
        if current not in [value for _label, value in options]:
            current = ALL_DEVICES
        with self._device.hold_sync():
            self._device.options = options
            self._device.value = current
        self._device.layout.display = "flex" if len(devices) > 1 else "none"

    def _show_host_choice(self, host_only: bool) -> None:
        """Without a GPU the host curve is the plot: the box says so (ticked, disabled) instead of lying."""
        if host_only == bool(self._host.disabled):
            return
        with self._host.hold_sync():
            if host_only:
                self._host_choice = bool(self._host.value)
                self._host.value = True
            else:
                self._host.value = self._host_choice
            self._host.disabled = host_only
            self._host.tooltip = _HOST_ONLY_HELP if host_only else _HOST_HELP

    def show_frame(self, frame: CurveFrame) -> None:
        """Draw one push of the plot: axes, lines, capacity, cell marks and the legend."""
        self._show_axes(frame)
        self._show_lines(frame)
        self._show_marks(frame)
        # The legend is rendered again only when what it lists changed (most pushes change none of it).
        legend_key = (frame.curves, bool(frame.capacity), frame.capacity_off_scale, bool(frame.mark_labels))
        if legend_key != self._last_legend_key:
            self._last_legend_key = legend_key
            legend = render_legend(frame)
            if legend != self._legend.value:
                self._legend.value = legend

    def _show_axes(self, frame: CurveFrame) -> None:
        # While curves are drawn they carry the window's two ends (see _show_lines) and the date scale
        # fits itself to them: one message a push fewer. With nothing drawn, the ends are set here.
        x_ends = (None, None) if _draws_lines(frame) else (frame.x_min_ms, frame.x_max_ms)
        tick_format = "%H:%M:%S" if (frame.x_max_ms - frame.x_min_ms) <= _SECONDS_TICKS_UP_TO_MS else "%H:%M"
        axes = (x_ends, tick_format, frame.y_max, frame.unit)
        if axes == self._last_axes:
            return  # the usual push: nothing about the axes changed, no trait is read or set
        self._last_axes = axes
        ends = (None, None) if x_ends[0] is None else (_date(frame.x_min_ms), _date(frame.x_max_ms))
        if (self._x_scale.min, self._x_scale.max) != ends:
            with self._x_scale.hold_sync():
                self._x_scale.min, self._x_scale.max = ends
        if self._x_axis.tick_format != tick_format:
            self._x_axis.tick_format = tick_format
        # The ticks and their unit in one message: apart, a page could draw MiB ticks labelled GiB.
        with self._y_axis.hold_sync():
            if self._y_scale.max != frame.y_max:
                self._y_scale.max = frame.y_max
                self._y_axis.tick_values = np.asarray(frame.y_ticks, dtype=np.float64)
            if self._y_axis.label != frame.unit:
                self._y_axis.label = frame.unit

    def _show_lines(self, frame: CurveFrame) -> None:
        if _draws_lines(frame):
            # A point with no value at each end of the window: nothing is drawn there, but the x scale spans
            # it. Both go first: bqplot places each line's (hidden) label at its LAST point, and a point
            # without a value there makes the browser log "translate(x,undefined)" at every push.
            with self._curves.hold_sync():
                x_ms = np.empty(frame.x_ms.size + 2)
                x_ms[0], x_ms[1], x_ms[2:] = frame.x_min_ms, frame.x_max_ms, frame.x_ms
                y = np.full((frame.y.shape[0], frame.y.shape[1] + 2), np.nan, dtype=frame.y.dtype)
                y[:, 2:] = frame.y
                self._curves.x = _dates(x_ms)
                self._curves.y = y
                if frame.curves != self._last_curves or not self._curves.visible:
                    # Validating these lists costs as much as the arrays; they change only with the curves.
                    self._last_curves = frame.curves
                    self._curves.colors = [c.color for c in frame.curves]
                    self._curves.opacities = [c.opacity for c in frame.curves]
                    self._curves.labels = [c.label for c in frame.curves]
                    self._curves.visible = True
        elif self._curves.visible:
            self._curves.visible = False
        if frame.capacity:
            if frame.capacity != self._last_capacity or not self._capacity.visible:
                # Across the whole plot on its own 0..1 scale: it never moves with the window.
                self._last_capacity = frame.capacity
                with self._capacity.hold_sync():
                    self._capacity.y = np.array([[c, c] for c in frame.capacity], dtype=np.float32)
                    self._capacity.visible = True
        elif self._capacity.visible:
            self._capacity.visible = False

    def _show_marks(self, frame: CurveFrame) -> None:
        marks_key = (frame.mark_x_ms.tobytes(), frame.mark_labels, frame.mark_tops, frame.mark_label_right, frame.y_max)
        if marks_key == self._last_marks_key:
            return
        self._last_marks_key = marks_key
        count = len(frame.mark_labels)
        # Emptied, not only hidden, when there are none: the x scale fits itself to every mark's dates.
        with self._cell_lines.hold_sync():
            self._cell_lines.x = _dates(np.repeat(frame.mark_x_ms[:, None], 2, axis=1))
            tops = np.asarray(frame.mark_tops if len(frame.mark_tops) == count else [1.0] * count, dtype=np.float32)
            y = np.zeros((count, 2), dtype=np.float32)
            y[:, 1] = tops * frame.y_max
            self._cell_lines.y = y
            self._cell_lines.visible = count > 0
        right = frame.mark_label_right if len(frame.mark_label_right) == count else (False,) * count
        for mark, side in ((self._cell_labels, False), (self._cell_labels_right, True)):
            texts = [text if on_right == side else "" for text, on_right in zip(frame.mark_labels, right, strict=True)]
            # Emptied too when it draws nothing (the x scale fits every mark's dates), once: then no message.
            drawn = count if any(texts) or not side else 0
            if drawn == 0 and len(mark.x) == 0:
                continue
            with mark.hold_sync():
                mark.x = _dates(frame.mark_x_ms[:drawn])
                mark.y = np.full(drawn, frame.y_max, dtype=np.float32)
                mark.text = np.array(texts[:drawn], dtype=str)
                mark.visible = drawn > 0

    def close_parts(self) -> None:
        """Close every widget inside the panel (layouts, styles, scales, marks...), not the panel itself."""
        for widget in list(_walk_widgets(self))[1:]:
            with contextlib.suppress(Exception):
                widget.close()


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
                stack.extend(v for v in _trait_values(getattr(widget, name)) if id(v) not in seen)


def _trait_values(value: Any) -> list[Any]:
    if isinstance(value, dict):
        values = list(value.values())
    elif isinstance(value, (list, tuple)):
        values = list(value)
    else:
        values = [value]
    return [v for v in values if isinstance(v, widgets.Widget)]


def _draws_lines(frame: CurveFrame) -> bool:
    """One point is no line (and bqplot squeezes it away)."""
    return bool(frame.curves) and frame.points_per_line > 1


def _dates(values_ms: np.ndarray) -> np.ndarray:
    return np.asarray(values_ms, dtype=np.float64).astype("datetime64[ms]")


def _date(value_ms: float) -> dt.datetime:
    # Naive local time on purpose: bqplot sends it as text the browser reads as its local time.
    return dt.datetime.fromtimestamp(value_ms / 1000.0)  # noqa: DTZ006
