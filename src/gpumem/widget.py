"""The live memory panel: ``Panel``, ``%gpumem monitor``, ``%gpumem sidebar`` and ``close_all``.

Importing this module is cheap; ipywidgets and bqplot are loaded when the first panel is made.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from IPython.core import magic_arguments as _magic_args
from IPython.core.error import UsageError

from ._panel_frame import DEFAULT_RATE_HZ, parse_device, parse_rate, parse_threshold, parse_window

if TYPE_CHECKING:
    from argparse import Namespace

    from ._panel import Panel, PanelStats

__all__ = [
    "Panel",
    "PanelStats",
    "close_all",
    "magic_monitor",
    "magic_sidebar",
    "open_panels",
    "register_sidebar_factory",
    "sidebar_panel",
]

_F = TypeVar("_F", bound=Callable[..., Any])


def argument(*args: Any, **kwargs: Any) -> Callable[[_F], _F]:
    """IPython's ``magic_arguments.argument``, typed."""
    return _magic_args.argument(*args, **kwargs)  # type: ignore[no-untyped-call]


def magic_arguments(name: str) -> Callable[[_F], _F]:
    """IPython's ``magic_arguments.magic_arguments``, typed."""
    return _magic_args.magic_arguments(name)  # type: ignore[no-untyped-call]


def parse_argstring(func: Callable[..., Any], line: str) -> Namespace:
    """Parse ``line`` with the options ``func`` declares; bad input raises IPython's UsageError."""
    from .magics import parse_argstring as parse

    namespace: Namespace = parse(func, line)
    return namespace


_sidebar_lock = threading.Lock()
_sidebar: Panel | None = None


def __getattr__(name: str) -> Any:
    if name in ("Panel", "PanelStats"):
        from . import _panel

        return getattr(_panel, name)
    raise AttributeError(f"module 'gpumem.widget' has no attribute {name!r}")


def open_panels() -> list[Panel]:
    """The panels not closed yet, oldest first."""
    module = sys.modules.get("gpumem._panel")
    panels: list[Panel] = module.open_panels() if module is not None else []
    return panels


def close_all() -> None:
    """Close every panel: their widgets, the writer thread, and the sampler if a panel started it."""
    global _sidebar
    module = sys.modules.get("gpumem._panel")
    if module is not None:
        module.close_all()
    with _sidebar_lock:
        _sidebar = None


def sidebar_panel(**options: Any) -> Panel:
    """The panel docked in the sidebar: the open one, or a new one with ``options``."""
    global _sidebar
    from ._panel import Panel

    with _sidebar_lock:
        if _sidebar is not None and not _sidebar.closed and not options:
            return _sidebar
        previous, _sidebar = _sidebar, Panel(compact=True, **options)
        panel = _sidebar
    if previous is not None and not previous.closed:
        previous.close()
    return panel


def register_sidebar_factory() -> bool:
    """Let the front end's "show sidebar" command create a panel in this kernel; False without ``_frontend``."""
    try:
        from ._frontend import set_sidebar_factory
    except ImportError:
        return False
    set_sidebar_factory(sidebar_panel)
    return True


def _panel_arguments(func: _F) -> _F:
    for decorator in reversed(
        (
            argument(
                "-w",
                "--window",
                default="10min",
                help="time window: 1min, 10min, 1h, all, or any duration such as 30s or 2h (default 10min)",
            ),
            argument("-d", "--device", default=None, help="CUDA device index such as 0 or cuda:1, or all (default)"),
            argument(
                "-t",
                "--threshold",
                default="90%",
                help="fraction of capacity at which the header turns red: 0.9 or 90%% (default 90%%)",
            ),
            argument(
                "-r",
                "--rate",
                default=str(DEFAULT_RATE_HZ),
                help=f"most updates per second sent to the browser, 0.2 to 10 (default {DEFAULT_RATE_HZ:g})",
            ),
            argument("--host", action="store_true", help="also plot this process's host RSS"),
            argument("--full-scale", action="store_true", help="y axis up to the device capacity"),
        )
    ):
        func = decorator(func)
    return func


def _panel_options(args: Namespace) -> dict[str, Any]:
    """Validated keyword arguments for Panel; a bad value is a one-line UsageError."""
    try:
        return {
            "window": parse_window(args.window),
            "device": parse_device(args.device),
            "threshold": parse_threshold(args.threshold),
            "rate_hz": parse_rate(args.rate),
            "host": bool(args.host),
            "full_scale": bool(args.full_scale),
        }
    except ValueError as error:
        raise UsageError(str(error)) from None


def _check_device(options: dict[str, Any]) -> None:
    """A device CUDA does not have is a usage error, as for %%gpumem (unknown until CUDA starts)."""
    if options["device"] is not None:
        from .magics import check_devices_exist
        from .monitor import default_monitor

        check_devices_exist((options["device"],), default_monitor().source)


def _has_kernel(shell: Any) -> bool:
    return getattr(shell, "kernel", None) is not None


_NO_KERNEL = (
    "The live panel is a Jupyter widget and needs a notebook front end (JupyterLab, Notebook 7, VS Code); "
    "this IPython has no kernel. %gpumem status prints the figures as text."
)


@magic_arguments(name="gpumem monitor")
@_panel_arguments
@argument("--close", action="store_true", help="close every open panel and stop what they started")
def magic_monitor(shell: Any, line: str) -> None:
    """Show the live memory panel below the cell (also bare %gpumem).

    Curves of PyTorch's allocated and reserved memory and whole-device use per GPU, kept moving by a
    background thread while cells run; Free (gc.collect + empty_cache), Pause, Reset peak, time window.
    """
    args = parse_argstring(magic_monitor, line)
    if args.close:
        count = len(open_panels())
        close_all()
        print(f"Closed {count} panel{'s' if count != 1 else ''}.")
        return
    options = _panel_options(args)
    _check_device(options)
    if not _has_kernel(shell):
        print(_NO_KERNEL)
        return
    from IPython.display import display

    from ._panel import Panel

    display(Panel(shell=shell, **options))  # type: ignore[no-untyped-call]


@magic_arguments(name="gpumem sidebar")
@_panel_arguments
def magic_sidebar(shell: Any, line: str) -> None:
    """Dock the live memory panel in the right sidebar (JupyterLab 4, Notebook 7).

    Needs gpumem's front-end extension in the Jupyter server's environment; elsewhere the panel is
    shown inline with a note saying why.
    """
    args = parse_argstring(magic_sidebar, line)
    options = _panel_options(args)
    _check_device(options)
    if not _has_kernel(shell):
        print(_NO_KERNEL)
        return
    explicit = {key: value for key, value in options.items() if value != _DEFAULTS.get(key)}
    panel = sidebar_panel(shell=shell, **explicit) if explicit else sidebar_panel()
    try:
        from ._frontend import show_sidebar
    except ImportError as error:
        _show_inline(panel, f"The sidebar is unavailable ({error}); showing the panel inline instead.")
        return
    try:
        show_sidebar(panel)
    except Exception as error:
        _show_inline(
            panel, f"The sidebar could not be used ({type(error).__name__}: {error}); showing the panel inline."
        )


_DEFAULTS: dict[str, Any] = {
    "window": parse_window("10min"),
    "device": None,
    "threshold": parse_threshold("90%"),
    "rate_hz": DEFAULT_RATE_HZ,
    "host": False,
    "full_scale": False,
}


def _show_inline(panel: Panel, note: str) -> None:
    from IPython.display import display

    print(note)
    display(panel)  # type: ignore[no-untyped-call]


register_sidebar_factory()
