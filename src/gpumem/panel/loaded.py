"""A recorded session in the panel's own widgets, read-only: what ``%gpumem load`` shows in a notebook.

The curves come from the export's timeline store rebuilt (:meth:`SessionData.restore_timeline`) through
the live panel's frame builder (:func:`~gpumem.panel.curves.build_curve_frame`), and the header from its
model (:func:`~gpumem.panel.header.build_header`) over the figures read at export; the same
:class:`~gpumem.panel.view.PanelView` draws them. So a session recorded on a GPU looks, on a laptop without
one, as its panel did. Nothing samples and no thread runs: the window, host and full-scale controls
redraw from the loaded timeline when they change; Free, Pause and Reset peak are hidden.
"""

from __future__ import annotations

import math
import weakref

from gpumem.core.monitoring.peaks import RunningPeak
from gpumem.core.readers.sources import DeviceInfo
from gpumem.core.sampling.sampler import channel_device
from gpumem.core.sampling.timeline import Timeline
from gpumem.core.sessions.session_file import SessionData
from gpumem.panel.curves import build_curve_frame, layout_marks
from gpumem.panel.header import RECORDING_SPAN, build_header, render_header
from gpumem.panel.monitor_feed import capacities_of
from gpumem.panel.options import COMPACT_PLOT_WIDTH_PX, PanelOptions, make_options
from gpumem.panel.view import PanelView

__all__ = ["LoadedPanel", "close_loaded"]

_shown: weakref.WeakSet[LoadedPanel] = weakref.WeakSet()


def close_loaded() -> None:
    """Close every loaded panel still open (the extension's unload)."""
    for panel in list(_shown):
        panel.close()


class LoadedPanel(PanelView):
    """The panel of an exported session: curves per device with its cell marks, and the figures at export.

    ``window`` is one of the panel's windows (``"all"``, the default, shows the whole recording), counted
    back from the recording's end.
    """

    def __init__(
        self, data: SessionData, source: str, *, window: str | float | None = None, compact: bool = False
    ) -> None:
        options = make_options(window=window)
        if compact:
            options = options._replace(plot_width_px=COMPACT_PLOT_WIDTH_PX)
        super().__init__(options, compact)
        self._options = options
        self._data = data
        self._timeline = data.restore_timeline() or _timeline_of(data)
        self._infos: dict[int, DeviceInfo | None] = {info.device: info for info in data.devices}
        self._end_s = max([*data.timeline.times[-1:], *(mark.time_s for mark in data.marks[-1:])], default=0.0)
        self._actions.layout.display = "none"
        self.show_message(_message(data, source), None)
        self.add_class("gpumem-loaded")
        self._draw_header()
        self._draw_curves()
        for control in self.control_widgets():
            control.observe(lambda _change: self._on_controls(), names="value")
        _shown.add(self)

    @property
    def options(self) -> PanelOptions:
        return self._options

    def _on_controls(self) -> None:
        values = self.control_values()
        self._options = self._options._replace(
            window_s=values.window_s, device=values.device, show_host=values.show_host, full_scale=values.full_scale
        )
        self._draw_header()
        self._draw_curves()

    def _draw_header(self) -> None:
        snapshot = self._data.snapshot
        devices = _devices(self._timeline)
        self.show_devices(devices, self._infos)
        if snapshot is None:
            self.show_header(
                '<div class="gm-header"><div class="gm-note">This export is older than the figures at export: '
                "the curves are what it recorded.</div></div>"
            )
            return
        peaks = {device: self._peak(device) for device in devices}
        host_peak = _tracker([_highest(self._data, "host/rss")])
        status = {} if devices else {"torch": "unavailable: the recorded session used none"}
        model = build_header(
            snapshot, self._infos, peaks, host_peak, status, self._options.device, peak_span=RECORDING_SPAN
        )
        self.show_header(render_header(model, self._options.threshold)[0])

    def _peak(self, device: int) -> RunningPeak:
        """The highest allocated of the recording that is known: the curve's, and each measured cell's exact
        peak (a lower bound: between cells the allocator's peak was not read)."""
        cells = [
            change.peak_allocated_bytes
            for record in self._data.cells
            for change in record.devices
            if change.device == device and change.peak_exact
        ]
        return _tracker([_highest(self._data, f"cuda:{device}/allocated"), *cells])

    def _draw_curves(self) -> None:
        snapshot = self._data.snapshot
        capacities = capacities_of(snapshot, self._infos) if snapshot is not None else {}
        capacities.update({d: info.total_bytes for d, info in self._infos.items() if info and d not in capacities})
        host_total = snapshot.host.total_bytes if snapshot is not None and snapshot.host is not None else None
        frame = build_curve_frame(
            self._timeline, self._options, self._end_s, self._data.wall_offset_s or 0.0, capacities, host_total
        )
        self.show_frame(layout_marks(frame, self._options.plot_width_px, self._options.plot_height_px))

    def close(self) -> None:
        _shown.discard(self)
        self.close_parts()
        super().close()


def _message(data: SessionData, source: str) -> str:
    times = data.timeline.times
    span = f", {times[-1] - times[0]:.0f} s" if len(times) > 1 else ""
    return f"Recorded session {source}{span}, read-only: {len(data.cells)} cells, {len(data.marks)} marks."


def _timeline_of(data: SessionData) -> Timeline:
    """An older export without its store: the exported points, appended in order."""
    timeline = Timeline()
    series = data.timeline
    for index, time_s in enumerate(series.times):
        timeline.append(time_s, {name: column[index] for name, column in series.values.items()})
    for mark in data.marks:
        timeline.add_mark(mark.time_s, mark.label)
    return timeline


def _devices(timeline: Timeline) -> tuple[int, ...]:
    return tuple(sorted({d for d in map(channel_device, timeline.channels) if d is not None}))


def _highest(data: SessionData, channel: str) -> float | None:
    """The channel's highest sampled value in the export (every sample kept, and each older stretch's
    maximum); None: never measured."""
    return max((v for v in data.timeline.values.get(channel, ()) if not math.isnan(v)), default=None)


def _tracker(values: list[float | None]) -> RunningPeak:
    """A peak that is a lower bound: the highest of ``values`` (never exact, as '≥' shows)."""
    tracker = RunningPeak()
    for value in values:
        if value is not None:
            tracker.update(value, None)
    return tracker
