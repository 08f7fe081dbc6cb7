"""gpumem's widgets and status comms hear the front end while a cell runs: their messages are handled
on a kernel subshell that gpumem owns.

Why: ipykernel (7.3 and later) does not take the subshell a front end addresses at its word for
``comm_msg`` and ``comm_close``. It routes them to the subshell of the parent of the last message the
kernel *sent* on that comm (``BaseComm._reply_subshell_for``). A widget built by a cell last sent its
``comm_open``, whose parent is that cell's ``execute_request`` on the main shell, so the front end's
first messages to it (the panel's Free button click) wait for whatever cell runs next to end. Measured
in JupyterLab 4.6 with ipykernel 7.4: a Free click 3 s into a 15 s cell was handled on the main thread
12 s later, although JupyterLab had addressed it to its ``jupyter.widget`` subshell. Routing to the
subshells a front end creates is no cure either: JupyterLab deletes a per-target subshell when the
last comm of its target closes (ipywidgets' control comm does at every page load), and a message
routed to a deleted subshell is lost.

So :func:`route_widget_tree` and :func:`route_comm` point the routing of gpumem's own comms at one
subshell created here, which lives while a panel or a status comm uses it, and whose thread handles
their messages at once. The handlers only queue work (see :mod:`gpumem.panel.widget`). Kernels
without subshells, or without that routing hook, are left alone: there the front end's own choice
stands. This uses ipykernel internals (the hook, the subshell manager, the shell channel thread);
each step checks that what it needs is there and does nothing otherwise.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["Route", "owned_subshell_id", "route_comm", "route_widget_tree", "widget_comms"]

_HOOK = "_reply_subshell_for"
_ROUTED = "_gpumem_routed"
Router = Callable[[Any, Any], Any]


class _Owned:
    """The subshell gpumem owns in this kernel: created for the first user, deleted after the last."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kernel: Any = None
        self.subshell_id: str | None = None
        self.creating = False
        self.users = 0


_owned = _Owned()


class Route:
    """One user of the owned subshell (a panel, a status comm); :meth:`release` once done with it."""

    __slots__ = ("_released",)

    def __init__(self) -> None:
        self._released = False

    def release(self) -> None:
        with _owned.lock:
            if self._released:
                return
            self._released = True
            _owned.users -= 1
            if _owned.users > 0:
                return
            kernel, subshell_id = _owned.kernel, _owned.subshell_id
            _owned.kernel, _owned.subshell_id = None, None
        if subshell_id is not None:
            _on_shell_channel(kernel, lambda manager: _delete(manager, subshell_id))


def owned_subshell_id() -> str | None:
    """The id of the subshell gpumem's comms are routed to; None before it exists or without one."""
    return _owned.subshell_id


def route_comm(comm: Any) -> Route | None:
    """Route the front end's messages on ``comm`` to the owned subshell; None where the kernel cannot."""
    return _route([comm])


def route_widget_tree(root: Any) -> Route | None:
    """Route the messages to ``root`` and to every widget it holds (children, marks, scales, layouts)."""
    return _route(widget_comms(root))


def widget_comms(root: Any) -> list[Any]:
    """The open comms of ``root`` and of the widgets reachable through its synced traits."""
    comms: list[Any] = []
    seen: set[int] = set()
    pending = [root]
    while pending:
        widget = pending.pop()
        if id(widget) in seen:
            continue
        seen.add(id(widget))
        comm = getattr(widget, "comm", None)
        if comm is not None:
            comms.append(comm)
        for name in getattr(widget, "keys", ()) or ():
            with contextlib.suppress(Exception):
                pending.extend(_widgets_in(getattr(widget, name)))
    return comms


def _widgets_in(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _widgets_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _widgets_in(item)
    elif hasattr(value, "comm") and hasattr(value, "keys") and hasattr(value, "model_id"):
        yield value


def _route(comms: Iterable[Any]) -> Route | None:
    routable = [comm for comm in comms if callable(getattr(comm, _HOOK, None))]
    kernel = _kernel(routable)
    if kernel is None:
        return None
    route = _add_user(kernel)
    for comm in routable:
        if not getattr(comm, _ROUTED, False):
            setattr(comm, _HOOK, _router(getattr(comm, _HOOK)))
            setattr(comm, _ROUTED, True)
    return route


def _router(original: Router) -> Router:
    """Called by ipykernel's shell channel thread for each comm_msg / comm_close on the comm."""

    def reply_subshell_for(data: Any, default: Any) -> Any:
        chosen = original(data, default)  # keeps ipykernel's own bookkeeping of request ids
        subshell_id = _owned.subshell_id
        kernel = _owned.kernel
        if subshell_id is None or kernel is None or not _subshell_exists(kernel, subshell_id):
            return chosen
        return subshell_id

    return reply_subshell_for


def _kernel(comms: list[Any]) -> Any:
    """The running ipykernel kernel when it has subshells (7.x), else None."""
    if not comms:
        return None
    kernel = next((c.kernel for c in comms if getattr(c, "kernel", None) is not None), None)
    if kernel is None:
        module = sys.modules.get("ipykernel.kernelbase")
        base = getattr(module, "Kernel", None)
        with contextlib.suppress(Exception):
            if base is not None and base.initialized():
                kernel = base.instance()
    thread = getattr(kernel, "shell_channel_thread", None)
    if thread is None or getattr(thread, "io_loop", None) is None:
        return None
    return kernel


def _add_user(kernel: Any) -> Route:
    with _owned.lock:
        if _owned.kernel is not kernel:
            _owned.kernel, _owned.subshell_id, _owned.creating = kernel, None, False
        _owned.users += 1
        create = _owned.subshell_id is None and not _owned.creating
        _owned.creating = _owned.creating or create
    if create:
        _on_shell_channel(kernel, lambda manager: _created(kernel, _create(manager)))
    return Route()


def _created(kernel: Any, subshell_id: str) -> None:
    """Shell channel thread: keep the new subshell, or delete it when its users left meanwhile."""
    with _owned.lock:
        wanted = _owned.kernel is kernel and _owned.users > 0 and _owned.subshell_id is None
        if wanted:
            _owned.subshell_id = subshell_id
            _owned.creating = False
    if not wanted:
        _delete(_manager(kernel), subshell_id)


def _on_shell_channel(kernel: Any, action: Callable[[Any], None]) -> None:
    """Run ``action(subshell manager)`` on the shell channel thread, the one that may create and delete
    subshells. Failures leave the front end's routing in place: nothing else depends on it."""

    def run() -> None:
        try:
            action(_manager(kernel))
        except Exception:
            with _owned.lock:
                if _owned.kernel is kernel:
                    _owned.creating = False

    with contextlib.suppress(Exception):
        kernel.shell_channel_thread.io_loop.add_callback(run)


def _manager(kernel: Any) -> Any:
    return kernel.shell_channel_thread.manager


# ipykernel creates and deletes subshells for front ends only (create_subshell_request on the control
# channel); these are the methods its shell channel thread runs for those requests.
def _create(manager: Any) -> str:
    return str(manager._create_subshell())  # noqa: SLF001 - no public way from inside the kernel


def _delete(manager: Any, subshell_id: str) -> None:
    manager._delete_subshell(subshell_id)  # noqa: SLF001 - no public way from inside the kernel


def _subshell_exists(kernel: Any, subshell_id: str) -> bool:
    try:
        return subshell_id in _manager(kernel).list_subshell()
    except Exception:
        return False
