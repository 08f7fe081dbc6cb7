"""The live memory panel: the shared monitor's figures in ipywidgets + bqplot, pushed by one writer thread.

Threads, and who may touch widget state:

* the sampler thread (shared through :func:`gpumem.core.monitoring.monitor.default_monitor`) records samples into
  the monitor's timeline, the one store the curves are read from; a panel's listener keeps the newest
  snapshot and the peaks since open, nothing else;
* the front end's messages (button clicks, option changes, view counts) are handled on a kernel
  subshell gpumem owns (:mod:`gpumem.panel.routing`; ipykernel 7), whose thread runs *while a cell is
  executing*. Their handlers only queue a typed command (:mod:`gpumem.panel.commands`) and wake the
  writer;
* Free runs on its own short-lived worker thread (:mod:`gpumem.panel.freeing`);
* one writer thread, shared by every open panel (:mod:`gpumem.panel.writer`), is the only one that
  sets widget traits after a panel is built. It sends nothing while no view of a panel is shown (views
  are counted per page, :class:`ViewCount`: a page that went away stops counting), and pushes curves
  no faster than its refresh cap, the scroll speed and the byte budget allow.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, cast

from gpumem.core.monitoring.monitor import Monitor, default_monitor
from gpumem.core.readers.sources import Snapshot
from gpumem.panel.cell_list import CellsPane, cell_records, last_oom
from gpumem.panel.commands import (
    AskConfirm,
    Command,
    FreeDone,
    FreeStarted,
    HoldersDone,
    Notify,
    ReadControls,
    ReclaimDone,
    ReclaimStarted,
    Refresh,
    ResetPeak,
    ShowCell,
    TogglePause,
    ViewsChanged,
)
from gpumem.panel.curves import (
    CurveFrame,
    build_curve_frame,
    curve_interval_s,
    header_interval_s,
    layout_marks,
    sample_rate_hz,
    with_span_mark,
)
from gpumem.panel.freeing import FreeOutcome, FreeWorker, free_message, run_free
from gpumem.panel.frontend import pages_gone
from gpumem.panel.header import build_header, render_header
from gpumem.panel.holders_view import HoldersControl
from gpumem.panel.monitor_feed import PeaksSinceOpen, Readings, SampleBeat, SamplerClaim, device_indices
from gpumem.panel.options import COMPACT_PLOT_HEIGHT_PX, COMPACT_PLOT_WIDTH_PX, PanelOptions, make_options
from gpumem.panel.routing import route_widget_tree
from gpumem.panel.view import PanelView
from gpumem.panel.writer import IDLE_WAIT_S, PushSchedule, close_all, register, shared_writer, unregister
from gpumem.panel.writer import open_panels as _open_panels

__all__ = [
    "UNREPORTED_VIEW_GRACE_S",
    "Panel",
    "PanelStats",
    "ViewCount",
    "close_all",
    "open_panels",
    "sending_page",
    "sidebar_panel",
]


# A view that was just displayed but has not reported itself yet (older front ends report only
# once the running cell ends) is treated as shown for this long.
UNREPORTED_VIEW_GRACE_S = 15.0


class ViewCount:
    """Whether a view of a panel is shown, counted per page so that a page that went away stops counting;
    changed on the thread that handles the front end's messages, read on the writer thread.

    ipywidgets' ``_view_count`` is one number that every page moves by one (a view shown: +1, removed:
    -1; the kernel echoes each change to the other pages). A page that goes away (reloaded, tab closed,
    browser gone) never takes its views back, and a reloaded page starts from the stale total: after one
    reload of a page that showed the panel once the kernel read 2 with one view shown (JupyterLab 4.6),
    and clearing that view left 1, so the panel kept sending with no view anywhere.

    So each change is put down to the page that sent it (the session id of the kernel connection, in the
    message header), and the pages the gpumem front-end extension no longer hears from (their status comm
    closed or fell silent, :func:`gpumem.panel.frontend.pages_gone`) are not counted. Without the
    extension no page is ever known gone and the count is ipywidgets' own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_page: dict[str, int] = {}
        self.displayed_at: float | None = None
        self.reported = False

    def changed(self, page: str, old: int, new: int) -> None:
        """``page`` moved ``_view_count`` from ``old`` to ``new`` (``page`` "" when not known)."""
        with self._lock:
            self.reported = True
            self._by_page[page] = self._by_page.get(page, 0) + new - old

    def shown(self) -> int:
        """Views shown by the pages still there."""
        with self._lock:
            counts = list(self._by_page.items())
        gone = pages_gone(page for page, _ in counts)
        return sum(max(0, count) for page, count in counts if page not in gone)

    def visible(self, now: float, shown: int | None = None) -> bool:
        """Whether a view is shown; ``shown`` is :meth:`shown` when the caller has just asked it."""
        if (self.shown() if shown is None else shown) > 0:
            return True
        shown_at = self.displayed_at
        return not self.reported and shown_at is not None and now - shown_at < UNREPORTED_VIEW_GRACE_S


def sending_page(comm: Any) -> str:
    """The session id of the front-end connection whose message is being handled, "" when unknown.

    Called from a comm message handler: ipykernel has set that message as the current parent."""
    kernel = getattr(comm, "kernel", None)
    if kernel is None:
        return ""
    try:
        header = kernel.get_parent().get("header") or {}
    except Exception:
        return ""
    session = header.get("session")
    return session if isinstance(session, str) else ""


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


# How long the readers' status is reused while CUDA's use and the devices seen stay the same.
STATUS_MAX_AGE_S = 5.0


def open_panels() -> list[Panel]:
    """The panels not closed yet, oldest first."""
    return cast("list[Panel]", _open_panels())


_sidebar_lock = threading.Lock()
_sidebar: weakref.ref[Panel] | None = None  # weakly: an open panel is held by the list of open panels


def sidebar_panel(**options: Any) -> Panel:
    """The panel docked in the sidebar: the open one, or a new one with ``options``."""
    global _sidebar
    with _sidebar_lock:
        docked = _sidebar() if _sidebar is not None else None
        if docked is not None and not docked.closed and not options:
            return docked
        panel = Panel(compact=True, **options)
        _sidebar = weakref.ref(panel)
    if docked is not None and not docked.closed:
        docked.close()
    return panel


class Panel(PanelView):
    """Live GPU memory: curves per device, a header of current figures, and a Free button.

    ``Panel()`` in a notebook cell (or ``%gpumem monitor``) shows it. Every panel reads the shared
    monitor, so several panels cost one sampler; ``close()`` releases what the panel holds. The keyword
    arguments ``window``, ``device``, ``threshold``, ``refresh_hz``, ``host``, ``full_scale`` and
    ``points_per_line`` are :func:`gpumem.panel.options.make_options`' (what ``%gpumem monitor`` takes);
    ``compact`` suits a narrow sidebar; ``autostart=False`` leaves the sampler to the caller (tests sample by hand).
    """

    def __init__(
        self,
        monitor: Monitor | None = None,
        *,
        autostart: bool = True,
        compact: bool = False,
        shell: Any = None,
        **settings: Any,
    ) -> None:
        if monitor is not None and not isinstance(monitor, Monitor):
            raise TypeError(f"Panel(monitor=...) takes a gpumem.Monitor, not {type(monitor).__name__}")
        options = make_options(**settings)
        if compact:
            options = options._replace(plot_width_px=COMPACT_PLOT_WIDTH_PX, plot_height_px=COMPACT_PLOT_HEIGHT_PX)
        super().__init__(options, compact)
        self._options = options
        self._monitor = monitor if monitor is not None else default_monitor()
        self._shell = shell if shell is not None else _current_shell()
        self._closed = False
        self._service_lock = threading.RLock()
        self._commands: deque[Command] = deque()
        self._refreshed: list[threading.Event] = []
        self._readings = Readings(self._monitor)
        self._peaks = PeaksSinceOpen()
        self._claim = SamplerClaim(
            self._monitor, ("panel", id(self)), enabled=autostart, rate_hz=sample_rate_hz(options)
        )
        self._views = ViewCount()
        self._schedule = PushSchedule()
        self._paused = False
        self._free = FreeWorker()
        self._stats = PanelStats(0, 0, 0, 0, 0, 0.0, 0, False)
        self._last_frame: CurveFrame | None = None
        self._last_header_key: tuple[Any, ...] | None = None
        self._status_cache: tuple[tuple[bool, int], float, dict[str, str]] | None = None  # key, when, status
        self._error: str | None = None
        # Who holds the memory and the actions that free it, walked on demand and after a cell ends while shown.
        self._control = HoldersControl(self._shell, lambda: self._monitor.source, self._post)
        self._holders = self._control.pane
        self._cells = CellsPane()  # the compact history of measured cells: pick one to read its report
        self.children = (*self.children, self._holders, self._cells)  # type: ignore[has-type]
        self._connect()
        # Clicks and view reports are handled on gpumem's own subshell, also while a cell runs.
        self._route = route_widget_tree(self)
        register(self)
        self._beat = SampleBeat(shared_writer.wake)  # pushes go with the sampler's samples
        self._monitor.sampler.add_listener(self._on_sample)
        # The figures at opening: the baseline of "peak since open" and a header before the first tick.
        with contextlib.suppress(Exception):
            self._on_sample(self._monitor.snapshot())
        shared_writer.add(self._service)

    def _connect(self) -> None:
        """Handlers run on a subshell thread (possibly while a cell runs): they only queue work."""
        self._free_button.on_click(lambda _b: self.free(deep=bool(self._deep.value), wait=False))
        self._pause_button.on_click(lambda _b: self._post(TogglePause()))
        self._reset_button.on_click(lambda _b: self._post(ResetPeak()))
        for control in self.control_widgets():
            control.observe(lambda _change: self._post(ReadControls()), names="value")
        self.observe(self._on_views, names="_view_count")
        self._cells.choice.observe(lambda change: self._post(ShowCell(change.get("new"))), names="value")

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
        return self._views.visible(time.monotonic())

    def stats(self) -> PanelStats:
        return self._stats

    def refresh(self, timeout_s: float = 10.0) -> bool:
        """Have the writer push current figures now, shown or not; True once it has."""
        if self._closed:
            return False
        if threading.current_thread() is shared_writer.thread:
            self._service(force=True)
            return True
        done = threading.Event()
        self._post(Refresh(done))
        return done.wait(timeout_s)

    def free(self, deep: bool = False, *, wait: bool = True, timeout_s: float = 120.0) -> FreeOutcome | None:
        """Run Free on a worker thread (as the button does); with ``wait``, return its outcome."""
        thread, started = self._free.start(
            self._free_worker, deep, announce=lambda: self._post(FreeStarted(deep))
        )
        if not wait:
            if not started:
                self._post(Notify("Free is already running.", None))
            return None
        thread.join(timeout_s)
        return self._free.last

    def refresh_holders(self, *, wait: bool = False, timeout_s: float = 60.0) -> None:
        """Walk the session again (holders, and what each action would return) on a worker thread."""
        self._control.refresh(wait=wait, timeout_s=timeout_s)

    def reclaim(self, action: str, *, wait: bool = True, timeout_s: float = 120.0) -> Any:
        """Run one reclaim action (:mod:`gpumem.core.reclaim`) as its button does; with ``wait``, its outcome."""
        return self._control.reclaim(action, wait=wait, timeout_s=timeout_s)

    def close(self) -> None:
        """Remove the panel: its widgets, its share of the sampler, and the writer when it was the last."""
        if getattr(self, "_closed", True):
            if getattr(self, "comm", None) is not None:
                super().close()
            return
        self._closed = True
        unregister(self)
        with self._service_lock:
            pass  # wait for an update in flight
        shared_writer.remove(self._service)
        self._monitor.sampler.remove_listener(self._on_sample)
        self._claim.give_back()
        self._free.join(10.0)
        self._control.join(10.0)
        self.close_parts()
        super().close()
        route = getattr(self, "_route", None)
        if route is not None:
            route.release()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        if not self._closed:
            self._views.displayed_at = time.monotonic()
            self._acquire()
            shared_writer.wake()
        return super()._repr_mimebundle_(**kwargs)

    @property
    def _last_free(self) -> FreeOutcome | None:
        return self._free.last

    # Threads other than the writer: only queue and wake --------------------------------------------
    def _post(self, command: Command) -> None:
        self._commands.append(command)
        shared_writer.wake()

    def _on_views(self, change: dict[str, Any]) -> None:
        self._views.changed(sending_page(self.comm), int(change.get("old") or 0), int(change.get("new") or 0))
        if (change.get("new") or 0) > 0:
            self._acquire()
        self._post(ViewsChanged())

    def _on_sample(self, snapshot: Snapshot) -> None:
        """Sampler thread: keep the newest snapshot and the peaks since open up to date; wake the writer
        when a push is waiting for this sample."""
        self._readings.note(snapshot)
        self._peaks.note(snapshot)
        self._beat.sampled()

    def _free_worker(self, deep: bool) -> None:
        outcome = run_free(deep, self._shell, self._monitor.source)
        self._free.last = outcome
        self._post(FreeDone(outcome))

    def _acquire(self) -> None:
        if not self._closed:
            self._claim.take()

    # The writer thread --------------------------------------------------------------------------
    def _service(self, force: bool = False) -> float:
        """Apply queued commands, then push what is due; returns when to come back (monotonic s)."""
        if self.comm is None and not self._closed:
            # The front end or ipywidgets closed our comm: release everything.
            threading.Thread(target=self.close, name="gpumem-panel-close", daemon=True).start()
            return math.inf
        with self._service_lock:
            if self._closed:
                return math.inf
            try:
                return self._service_locked(force)
            except Exception as error:
                self._show_failure(error)
                return time.monotonic() + IDLE_WAIT_S
            finally:
                refreshed, self._refreshed = self._refreshed, []
                for event in refreshed:
                    event.set()

    def _show_failure(self, error: Exception) -> None:
        text = f"Panel update failed: {type(error).__name__}: {error}"
        if text != self._error:
            self._error = text
            with contextlib.suppress(Exception):
                self.show_message(text, False)

    def _service_locked(self, force: bool) -> float:
        while self._commands:
            command = self._commands.popleft()
            self._HANDLERS[type(command)](self, command)
        if self._control.after_cells(self._views.visible(time.monotonic())):
            self._cells.show_records(cell_records())
            self._cells.show_oom(last_oom())
        force = force or bool(self._refreshed)
        if force:
            self._status_cache = None  # asked for now: everything read afresh
        now = time.monotonic()
        shown = self._views.shown()
        visible = self._views.visible(now, shown)
        if (shown, visible) != (self._stats.views, self._stats.visible):
            self._stats = self._stats._replace(views=shown, visible=visible)
        if not force and (self._paused or not visible):
            return now + IDLE_WAIT_S
        schedule = self._schedule
        header_interval = header_interval_s(self._options)
        # When the curves come at least every other header interval, the header goes with them: one
        # wake-up of this thread instead of two (each costs a GIL hand-off from a busy main thread).
        rides = self._stats.last_interval_s <= 2 * header_interval and schedule.next_header != 0.0
        # A push due within half a sample period goes with the sample just taken (see SampleBeat).
        lead = self._beat.lead_s(self._monitor.sampler)
        curves_due = force or schedule.curves_due(now + lead)
        if force or (schedule.header_due(now + lead) and (curves_due or not rides)):
            self._push_header()
            schedule.pushed_header(now, header_interval)
        if curves_due:
            schedule.pushed_curves(now, self._push_curves(now))
        due = schedule.next_curves if rides and schedule.next_header != 0.0 else schedule.next_due
        return self._beat.arm(due, lead)

    # One handler per command (writer thread) -------------------------------------------------------
    def _on_refresh(self, command: Refresh) -> None:
        self._refreshed.append(command.done)

    def _on_free_started(self, command: FreeStarted) -> None:
        self.show_free_running(command.deep)

    def _on_free_done(self, command: FreeDone) -> None:
        self.show_free_done(*free_message(command.outcome))
        self._schedule.invalidate()

    def _on_holders(self, command: Command) -> None:
        self._control.on_command(command)
        if isinstance(command, HoldersDone) and command.model is not None:
            self._cells.show_conditions(command.model.conditions)
        if isinstance(command, ReclaimDone):
            self._schedule.invalidate()

    def _on_show_cell(self, command: ShowCell) -> None:
        self._cells.show_report(command.serial)

    def _on_notify(self, command: Notify) -> None:
        self.show_message(command.text, command.ok)

    def _on_toggle_pause(self, _command: TogglePause) -> None:
        self._paused = not self._paused
        self.show_paused(self._paused)
        if not self._paused:
            self._schedule.invalidate()

    def _on_reset_peak(self, _command: ResetPeak) -> None:
        self._peaks.restart(self._readings.latest())
        self._schedule.next_header = 0.0

    def _on_read_controls(self, _command: ReadControls) -> None:
        values = self.control_values()
        self._options = self._options._replace(
            window_s=values.window_s, device=values.device, show_host=values.show_host, full_scale=values.full_scale
        )
        self._claim.ask_rate(sample_rate_hz(self._options))
        self._schedule.invalidate()

    def _on_views_changed(self, _command: ViewsChanged) -> None:
        self._schedule.invalidate()

    _HANDLERS: ClassVar[dict[type[Any], Callable[[Panel, Any], None]]] = {
        Refresh: _on_refresh,
        FreeStarted: _on_free_started,
        FreeDone: _on_free_done,
        Notify: _on_notify,
        HoldersDone: _on_holders,
        AskConfirm: _on_holders,
        ReclaimStarted: _on_holders,
        ReclaimDone: _on_holders,
        ShowCell: _on_show_cell,
        TogglePause: _on_toggle_pause,
        ResetPeak: _on_reset_peak,
        ReadControls: _on_read_controls,
        ViewsChanged: _on_views_changed,
    }

    # Pushing (writer thread) ------------------------------------------------------------------------
    def _push_header(self) -> None:
        snapshot = self._readings.latest()
        infos = self._readings.infos()
        device_peaks, host_peak = self._peaks.frozen()
        self.show_devices(device_indices(snapshot) if snapshot is not None else (), infos)
        status = self._reader_status(snapshot)
        model = build_header(
            snapshot, infos, device_peaks, host_peak, status, self._options.device, peak_span=self._peaks.span()[1]
        )
        key = (model, self._options.threshold)
        if key == self._last_header_key:
            return  # the same figures: the same HTML, already shown (rendering it is most of a header push)
        self._last_header_key = key
        text, _alert = render_header(model, self._options.threshold)
        if self.show_header(text):
            self._stats = self._stats._replace(header_pushes=self._stats.header_pushes + 1)

    def _reader_status(self, snapshot: Snapshot | None) -> dict[str, str]:
        """The readers' status, asked again only when CUDA's use or the devices seen change, or every few
        seconds: next to a busy main thread the call cost this thread hundreds of microseconds a push."""
        key = (snapshot is not None and bool(snapshot.allocator), len(snapshot.devices) if snapshot else 0)
        now = time.monotonic()
        cached = self._status_cache
        if cached is not None and cached[0] == key and now - cached[1] < STATUS_MAX_AGE_S:
            return cached[2]
        try:
            status = self._monitor.status()
        except Exception as error:
            status = {"torch": f"unavailable: {error}"}
        self._status_cache = (key, now, status)
        return status

    def _push_curves(self, now: float) -> float:
        """Draw the window from the monitor's timeline; returns the seconds until the next push."""
        wall_offset = time.time() - time.monotonic()
        snapshot = self._readings.latest()
        host_total = snapshot.host.total_bytes if snapshot is not None and snapshot.host is not None else None
        frame = build_curve_frame(
            self._monitor.timeline, self._options, now, wall_offset, self._readings.capacities(), host_total
        )
        frame = with_span_mark(frame, *self._peaks.span(), wall_offset)
        frame = layout_marks(frame, self._options.plot_width_px, self._options.plot_height_px)
        self.show_frame(frame)
        self._last_frame = frame
        payload_bytes = frame.payload_bytes
        interval = curve_interval_s(self._options, payload_bytes)
        self._stats = self._stats._replace(
            curve_pushes=self._stats.curve_pushes + 1,
            points_per_line=frame.points_per_line,
            curves=len(frame.curves),
            last_payload_bytes=payload_bytes,
            last_interval_s=interval,
        )
        return interval


def _current_shell() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()
