"""Kernel side of the gpumem front-end extension (``js/``): the right sidebar and the status-bar item.

Nothing heavy is imported here at module import: ipywidgets and IPython are imported when used.
The status bar's figures come from the shared monitor, whose sampler is the one reader of torch, NVML
and psutil; CUDA is never initialized. While the status bar is shown, a :class:`StatusReader` listens to
the default monitor's sampler: when the sampler runs (a panel is shown, cells are measured) the payload is
the newest sample, read by the sampler and by no one else. When it does not run, one snapshot is read
through the monitor (:meth:`gpumem.core.monitoring.monitor.Monitor.snapshot`), so the status bar never starts
the sampler itself.

Protocol (the TypeScript side is ``js/src/protocol.ts``)
--------------------------------------------------------
Sidebar: :func:`show_sidebar` displays ONE output whose bundle holds

* ``application/vnd.gpumem.sidebar+json``: ``{"model_id": <panel model id>}``. The extension renders
  this type in preference to the widget view: a one-line note in the cell, and the panel itself is
  rendered in the right sidebar through the notebook's own ipywidgets manager.
* ``application/vnd.jupyter.widget-view+json``: a small ``VBox`` holding a one-line explanation and
  the panel. Front ends without the extension (VS Code, Colab, classic Notebook, JupyterLab without
  gpumem's labextension) render this, so the panel is shown inline *and* says why.
* ``text/plain``: the same explanation, for front ends that render no widgets at all.

Status bar: comm target ``gpumem.status`` (:data:`STATUS_TARGET`), opened by either side.

* kernel -> front end: a status payload (:func:`status_payload` gives the shape)::

      {"devices": [{"index": 0, "name": "NVIDIA H200", "allocated_bytes": 1, "reserved_bytes": 2,
                    "total_bytes": 3}],
       "host": {"rss_bytes": 4}, "cuda_in_use": true, "docked_model_id": "<id, while the docked panel is open>"}

  at most once a second while a comm is open, when the figures changed, and ``{"sidebar_model_id": "<id>"}`` or
  ``{"sidebar_error": "<message>"}`` in answer to a sidebar request.
* front end -> kernel: ``{"request": "snapshot"}`` (answered at once with one payload),
  ``{"request": "sidebar"}`` (answered by creating a panel with the factory registered through
  :func:`set_sidebar_factory`), ``{"request": "keepalive"}`` (no answer) and ``{"request": "bye"}``
  (the page goes away, on the beacon it adopted; no answer).

:func:`register_status_target` (at extension load) registers the target and opens one comm towards
the front ends, the *beacon*: a front end with the extension adopts it at once, and one connecting
later (page reload, second tab) finds it with a ``comm_info_request`` and opens its own comm. A
front end also opens a comm after running code that mentions gpumem. A comm is only published to
once a front end has sent a message on it, so front ends without the extension cost nothing; front
ends send ``{"request": "keepalive"}`` every 30 s and close their comms when the page goes away, and
comms silent for much longer than the liveliest one are dropped (the beacon just stops being
published to). :func:`pages_gone` says which pages (front-end sessions) are no longer heard, so that
panels stop counting their views. Messages on these comms are handled on gpumem's own subshell
(:mod:`gpumem.panel.routing`): a sidebar asked for while a cell runs is answered at once.

Payloads go out from :func:`publish_status` (thread-safe; callable from any thread). While no one else
publishes, a light daemon thread here publishes the shared monitor's figures
(:func:`default_status_payload`) once a second, and only while a confirmed comm is open: the newest
sample when the monitor's sampler runs, else one snapshot read through the monitor.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import html
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpumem.core.monitoring.monitor import default_monitor
from gpumem.core.readers.sources import DeviceInfo, Snapshot
from gpumem.panel.monitor_feed import Readings, SampleBeat, capacities_of, describe_device
from gpumem.panel.routing import Route, route_comm
from gpumem.panel.writer import docked_model_id, note_docked

__all__ = [
    "FRESH_S",
    "INLINE_NOTE",
    "SIDEBAR_MIME",
    "STATUS_TARGET",
    "WIDGET_VIEW_MIME",
    "StatusPayload",
    "StatusReader",
    "default_status_payload",
    "open_status_comms",
    "pages_gone",
    "publish_status",
    "register_status_target",
    "set_sidebar_factory",
    "show_sidebar",
    "sidebar_bundle",
    "status_payload",
    "unregister_status_target",
]


# The status bar's figures: the payload's shape is the front end's ``IStatusPayload`` (``js/src/protocol.ts``).
StatusPayload = dict[str, Any]
# A sample younger than this answers a request; the sampler takes one every second by default.
FRESH_S = 2.5


def status_payload(snapshot: Snapshot, infos: Mapping[int, DeviceInfo | None]) -> StatusPayload:
    """PyTorch's figures per initialized device (none before the user's code initialized CUDA) and host RSS."""
    capacities = capacities_of(snapshot, infos)
    devices: list[dict[str, Any]] = []
    for reading in snapshot.allocator:
        info = infos.get(reading.device)
        devices.append(
            {
                "index": reading.device,
                "name": info.name if info is not None else f"cuda:{reading.device}",
                "allocated_bytes": reading.allocated_bytes,
                "reserved_bytes": reading.reserved_bytes,
                "total_bytes": capacities.get(reading.device),
            }
        )
    rss = snapshot.host.rss_bytes if snapshot.host is not None else None
    return {"devices": devices, "host": {"rss_bytes": rss}, "cuda_in_use": bool(snapshot.allocator)}


class StatusReader:
    """The default monitor's newest snapshot, for the status bar; follows ``set_default_monitor``.

    It listens to the sampler from the first ``start`` until as many ``stop`` calls (a publisher thread
    that is ending and its successor may overlap); neither starts or stops sampling.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._readings: Readings | None = None
        self._listener: Callable[[Snapshot], None] | None = None
        self._users = 0
        self._woken = threading.Event()
        self._beat = SampleBeat(self._woken.set)

    def wait_until_due(self, due: float, stop: threading.Event) -> bool:
        """Sleep until ``due``; while the sampler runs, until its first sample from half a period before
        ``due`` on instead (at most a sample period late), so that what is published is that fresh sample
        and this thread wakes with the sampler rather than on a clock of its own. False once ``stop`` is set.
        """
        lead = self._beat.lead_s(default_monitor().sampler)
        self._woken.clear()
        if stop.is_set():
            return False
        self._woken.wait(max(0.0, self._beat.arm(due, lead) - time.monotonic()))
        self._beat.disarm()
        return not stop.is_set()

    def interrupt(self) -> None:
        """End a wait_until_due now (the publisher is being stopped)."""
        self._woken.set()

    def start(self) -> None:
        with self._lock:
            self._users += 1
            self._follow_locked()

    def stop(self) -> None:
        with self._lock:
            self._users = max(0, self._users - 1)
            if not self._users:
                self._detach_locked()

    def sampled(self) -> StatusPayload | None:
        """From the sampler's newest snapshot; None while it has taken no recent one."""
        with self._lock:
            readings = self._follow_locked()
        if readings is None:
            return None
        snapshot = readings.latest(max_age_s=FRESH_S)
        return None if snapshot is None else status_payload(snapshot, readings.infos())

    def now(self) -> StatusPayload:
        """From a recent sample, else from one snapshot read now through the monitor (on this thread)."""
        payload = self.sampled()
        if payload is not None:
            return payload
        monitor = default_monitor()
        try:
            snapshot = monitor.snapshot()
        except Exception:
            return {"devices": [], "host": {"rss_bytes": None}, "cuda_in_use": False}  # nothing readable now
        infos = {reading.device: describe_device(monitor, reading.device) for reading in snapshot.allocator}
        return status_payload(snapshot, infos)

    def _follow_locked(self) -> Readings | None:
        """While started: listen to the current default monitor (again, if it was replaced)."""
        if not self._users:
            return None
        monitor = default_monitor()
        if self._readings is not None and self._readings.monitor is monitor:
            return self._readings
        self._detach_locked()
        readings = self._readings = Readings(monitor)

        def on_sample(snapshot: Snapshot) -> None:
            readings.note(snapshot)
            self._beat.sampled()

        self._listener = on_sample
        monitor.sampler.add_listener(on_sample)
        return readings

    def _detach_locked(self) -> None:
        readings, self._readings = self._readings, None
        listener, self._listener = self._listener, None
        if readings is not None and listener is not None:
            readings.monitor.sampler.remove_listener(listener)


SIDEBAR_MIME = "application/vnd.gpumem.sidebar+json"
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
STATUS_TARGET = "gpumem.status"

INLINE_NOTE = (
    "The GPU memory panel is shown inline because the gpumem front-end extension is not present here "
    "(it docks the panel in the right sidebar of JupyterLab 4 and Notebook 7 when gpumem is installed "
    "in the Jupyter server's environment; VS Code, Colab and the classic Notebook do not load it)."
)

PUBLISH_INTERVAL_S = 1.0
# Front ends send a keepalive every 30 s. A comm silent this much longer than the liveliest one is
# taken for a page that went away without closing it, and closed. (Relative, so that a kernel that
# processes no comm message while a cell runs drops nothing.)
STALE_COMM_S = 120.0
# The publisher thread stays quiet while someone else called publish_status this recently.
_EXTERNAL_QUIET_S = 2.5
# Staleness is relative to the liveliest comm, so it needs two to compare.
_AT_LEAST_TO_COMPARE = 2


# Sidebar output -------------------------------------------------------------------------------

# Panel model id -> the inline wrapper last displayed for it (closed when replaced).
_inline_wrappers: dict[str, Any] = {}

def sidebar_bundle(panel_model_id: str, inline_model_id: str | None = None) -> dict[str, Any]:
    """The mime bundle of a ``%gpumem sidebar`` output (``inline_model_id`` defaults to the panel's)."""
    return {
        SIDEBAR_MIME: {"model_id": panel_model_id},
        WIDGET_VIEW_MIME: {
            "model_id": inline_model_id or panel_model_id,
            "version_major": 2,
            "version_minor": 0,
        },
        "text/plain": INLINE_NOTE,
    }


def _inline_wrapper(panel_widget: Any, note: str) -> Any:
    """A VBox with a one-line explanation above the panel, for front ends without the extension."""
    import ipywidgets

    label = ipywidgets.HTML(
        value=f'<span style="font-size: var(--jp-ui-font-size0, 11px); opacity: 0.75">{html.escape(note)}</span>'
    )
    return ipywidgets.VBox([label, panel_widget])


def show_sidebar(panel_widget: Any, *, note: str | None = None) -> None:
    """Display ``panel_widget`` (an ipywidgets ``DOMWidget``) for the right sidebar.

    With the gpumem front-end extension the output is a one-line note in the cell and the panel is
    docked in the sidebar. Without it the panel is shown inline below ``note`` (default
    :data:`INLINE_NOTE`), which says why.
    """
    from IPython.display import display

    model_id = getattr(panel_widget, "model_id", None)
    if not isinstance(model_id, str) or not model_id:
        raise TypeError(f"show_sidebar() needs a live ipywidgets widget, got {type(panel_widget).__name__}")
    wrapper = _inline_wrapper(panel_widget, note or INLINE_NOTE)
    previous = _inline_wrappers.pop(model_id, None)
    if previous is not None:
        # Keeps one inline copy of the panel; the panel itself stays open.
        previous.children = ()
        previous.close()
    _inline_wrappers[model_id] = wrapper
    note_docked(panel_widget)
    display(sidebar_bundle(model_id, wrapper.model_id), raw=True)  # type: ignore[no-untyped-call]


# Status comm ----------------------------------------------------------------------------------


class _StatusComm:
    """One open ``gpumem.status`` comm. ``confirmed`` once a front end has spoken on it (only then
    is it published to); ``last_seen``: when it last did (``time.monotonic()``); ``beacon``: the comm
    the kernel opened itself, kept open until unload so that a front end connecting later finds the
    target in a ``comm_info_request``."""

    __slots__ = ("beacon", "comm", "confirmed", "context", "last_seen", "page", "route", "sent")

    def __init__(self, comm: Any, confirmed: bool, beacon: bool = False) -> None:
        self.comm = comm
        self.confirmed = confirmed
        self.beacon = beacon
        self.last_seen = time.monotonic()
        self.page: str | None = None  # the session id of the front end's connection: its page
        self.route: Route | None = None  # its messages go to gpumem's subshell
        self.sent: dict[str, Any] | None = None  # the last message sent on it (the front end keeps the payload)
        # The context of the last kernel message handled for this comm, in which every send runs:
        # ipykernel (7.x) takes the parent of a message sent from a background thread from the last
        # request handled on ANY subshell; this gives the messages this comm's own parent.
        self.context = contextvars.copy_context()


_lock = threading.RLock()
_comms: dict[int, _StatusComm] = {}
# Pages (front-end sessions) that have spoken on a status comm, oldest first; bounded.
_pages_heard: dict[str, None] = {}
_MAX_PAGES_HEARD = 1024
_registered_manager: Any = None
_sidebar_factory: Callable[[], Any] | None = None
_last_external_publish = 0.0
_publisher: threading.Thread | None = None
_publisher_stop = threading.Event()


def set_sidebar_factory(factory: Callable[[], Any] | None) -> None:
    """Register the callable that makes a panel widget when the front end asks for one.

    Called (in the kernel's comm-handling thread) when the user clicks the status-bar item or runs
    "GPU memory: show sidebar" and no live panel of this kernel is docked. It must return an
    ipywidgets widget; its model id is sent back and the front end docks it.
    """
    global _sidebar_factory
    _sidebar_factory = factory


def _comm_manager(shell: Any) -> Any:
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return None
    manager = getattr(kernel, "comm_manager", None)
    if manager is None:
        try:
            import comm

            manager = comm.get_comm_manager()
        except Exception:
            return None
    if not hasattr(manager, "register_target"):
        return None
    return manager


def register_status_target(shell: Any = None) -> bool:
    """Register the ``gpumem.status`` comm target with the kernel of ``shell`` (default: the running one).

    Returns False, doing nothing, where there is no kernel (terminal IPython, plain Python). Also
    opens one comm towards the front end so that the status bar appears without waiting.
    """
    global _registered_manager
    if shell is None:
        try:
            from IPython import get_ipython

            shell = get_ipython()
        except ImportError:
            return False
    manager = _comm_manager(shell)
    if manager is None:
        return False
    with _lock:
        if _registered_manager is not None and _registered_manager is not manager:
            _unregister_locked()
        manager.register_target(STATUS_TARGET, _on_comm_open)
        _registered_manager = manager
        _publisher_stop.clear()
    _announce()
    return True


def unregister_status_target() -> None:
    """Close every status comm (the front end hides its item), unregister the target, stop the thread."""
    with _lock:
        comms = _unregister_locked()
    for entry in comms:
        _close(entry)
    thread = _publisher
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=2 * PUBLISH_INTERVAL_S)


def _unregister_locked() -> list[_StatusComm]:
    global _registered_manager
    manager = _registered_manager
    _registered_manager = None
    _publisher_stop.set()
    _reader.interrupt()
    if manager is not None:
        with contextlib.suppress(Exception):
            manager.unregister_target(STATUS_TARGET, _on_comm_open)
    comms = list(_comms.values())
    _comms.clear()
    _pages_heard.clear()
    return comms


def _announce() -> None:
    """Open a comm from the kernel; a front end with the extension accepts it and confirms."""
    try:
        from comm import create_comm

        comm = create_comm(target_name=STATUS_TARGET, data=_build_payload())
    except Exception:
        return
    _track(comm, confirmed=False, beacon=True)


def _on_comm_open(comm: Any, msg: dict[str, Any]) -> None:
    """Comm target handler: a front end opened a status comm; answer with a snapshot at once."""
    entry = _track(comm, confirmed=True)
    if entry is not None:
        _heard_from(entry, msg)
        _send(entry, _build_payload())
        data = (msg.get("content") or {}).get("data") or {}
        if isinstance(data, dict) and data.get("request") == "sidebar":
            _answer_sidebar(entry)


def _track(comm: Any, *, confirmed: bool, beacon: bool = False) -> _StatusComm | None:
    entry = _StatusComm(comm, confirmed, beacon)
    with _lock:
        accepted = _registered_manager is not None
        if accepted:
            _comms[id(comm)] = entry
    if not accepted:
        with contextlib.suppress(Exception):
            comm.close()
        return None

    def on_msg(msg: dict[str, Any]) -> None:
        _on_comm_msg(entry, msg)

    def on_close(_msg: dict[str, Any]) -> None:
        _drop(entry)

    comm.on_msg(on_msg)
    comm.on_close(on_close)
    entry.route = route_comm(comm)
    if confirmed:
        _ensure_publisher()
    return entry


def _drop(entry: _StatusComm) -> None:
    with _lock:
        if _comms.get(id(entry.comm)) is entry:
            del _comms[id(entry.comm)]
    _release(entry)


def _close(entry: _StatusComm) -> None:
    with contextlib.suppress(Exception):
        entry.comm.close()
    _release(entry)


def _release(entry: _StatusComm) -> None:
    route, entry.route = entry.route, None
    if route is not None:
        route.release()


def _on_comm_msg(entry: _StatusComm, msg: dict[str, Any]) -> None:
    data = (msg.get("content") or {}).get("data") or {}
    request = data.get("request") if isinstance(data, dict) else None
    entry.last_seen = time.monotonic()
    entry.context = contextvars.copy_context()
    _heard_from(entry, msg)
    if not entry.confirmed:
        entry.confirmed = True
        _ensure_publisher()
    if request == "snapshot":
        _send(entry, _build_payload())
    elif request == "sidebar":
        _answer_sidebar(entry)
    elif request == "bye":
        _said_bye(entry)


def _said_bye(entry: _StatusComm) -> None:
    """The page stops listening (it goes away): the beacon stays open, unpublished; a comm of its own closes."""
    with _lock:
        entry.confirmed = False
        closing = not entry.beacon and _comms.pop(id(entry.comm), None) is entry
    if closing:
        _close(entry)


def _heard_from(entry: _StatusComm, msg: dict[str, Any]) -> None:
    page = (msg.get("header") or {}).get("session")
    if not isinstance(page, str) or not page:
        return
    with _lock:
        entry.page = page
        _pages_heard.pop(page, None)
        _pages_heard[page] = None
        if len(_pages_heard) > _MAX_PAGES_HEARD:
            del _pages_heard[next(iter(_pages_heard))]


def pages_gone(pages: Iterable[str]) -> frozenset[str]:
    """Of ``pages`` (front-end session ids), those that spoke on a status comm and have none left
    that is listened to: closed, or silent far longer than the liveliest (a reloaded or closed page).
    A page never heard on a status comm (a front end without the extension) is never gone."""
    with _lock:
        live = {e.page for e in _comms.values() if e.confirmed}
        return frozenset(p for p in pages if p in _pages_heard and p not in live)


def _answer_sidebar(entry: _StatusComm) -> None:
    factory = _sidebar_factory
    if factory is None:
        _send(
            entry,
            {
                "sidebar_error": "This kernel has no GPU memory panel to show; "
                "run %gpumem sidebar in the notebook to create one."
            },
        )
        return
    try:
        widget = factory()
        model_id = widget.model_id
    except Exception as exc:
        _send(entry, {"sidebar_error": f"Could not create the GPU memory panel: {exc!r}"})
        return
    note_docked(widget)
    _send(entry, {"sidebar_model_id": str(model_id)})


def _send(entry: _StatusComm, data: dict[str, Any]) -> bool:
    try:
        entry.context.copy().run(entry.comm.send, data)
    except Exception:
        _drop(entry)
        return False
    entry.sent = copy.deepcopy(data)  # a copy: a status provider may change its dict in place afterwards
    return True


def open_status_comms() -> int:
    """How many status comms a front end listens on (0: publishing is pointless)."""
    with _lock:
        return sum(1 for e in _comms.values() if e.confirmed)


def publish_status(payload: StatusPayload) -> int:
    """Send ``payload`` to every confirmed status comm; returns how many it reached.

    Thread-safe and cheap when no comm is open (one lock, no serialization). Closed comms are dropped.
    """
    global _last_external_publish
    _last_external_publish = time.monotonic()
    return _publish(payload)


def _publish(payload: StatusPayload, *, only_changed: bool = False) -> int:
    """Send ``payload`` to every confirmed comm (with ``only_changed``, to those whose last payload was
    another: the front end shows the last one it got, so the same again would only cost serializing)."""
    closing: list[_StatusComm] = []
    with _lock:
        targets = [e for e in _comms.values() if e.confirmed]
        for entry in _stale_locked(targets):
            targets.remove(entry)
            if entry.beacon:
                entry.confirmed = False  # stays open as the beacon, no longer published to
            else:
                del _comms[id(entry.comm)]
                closing.append(entry)
    for entry in closing:
        _close(entry)
    return sum(1 for entry in targets if (not only_changed or entry.sent != payload) and _send(entry, payload))


def _stale_locked(entries: list[_StatusComm]) -> list[_StatusComm]:
    if len(entries) < _AT_LEAST_TO_COMPARE:
        return []
    newest = max(e.last_seen for e in entries)
    return [e for e in entries if e.last_seen < newest - STALE_COMM_S]


# Default payload and publisher thread ---------------------------------------------------------

_reader = StatusReader()


def default_status_payload() -> StatusPayload:
    """Host RSS and, when the user's code has already initialized CUDA through PyTorch, the caching
    allocator's figures per device, from the shared monitor's newest sample (or one snapshot read
    through it when no recent sample is at hand). Never imports torch, never initializes CUDA."""
    return _reader.now()


def _build_payload() -> StatusPayload:
    """The shared monitor's figures, with the docked panel's model id while it is open."""
    payload = default_status_payload()
    docked = docked_model_id()
    return {**payload, "docked_model_id": docked} if docked is not None else payload


def _ensure_publisher() -> None:
    global _publisher
    with _lock:
        if _registered_manager is None:
            return
        if _publisher is not None and _publisher.is_alive():
            return
        _publisher_stop.clear()
        _publisher = threading.Thread(target=_publish_loop, name="gpumem-status", daemon=True)
        _publisher.start()


def _publish_loop() -> None:
    """Publishes the shared monitor's figures, listening to its sampler meanwhile (which it never starts)."""
    global _publisher
    _reader.start()
    try:
        while _reader.wait_until_due(time.monotonic() + PUBLISH_INTERVAL_S, _publisher_stop):
            with _lock:
                if not any(e.confirmed for e in _comms.values()):
                    if _publisher is threading.current_thread():
                        _publisher = None
                    return
            if time.monotonic() - _last_external_publish < _EXTERNAL_QUIET_S:
                continue
            _publish(_build_payload(), only_changed=True)
    finally:
        _reader.stop()


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """For ``jupyter labextension develop``: where the built extension lives in the package."""
    return [{"src": "labextension", "dest": "gpumem"}]
