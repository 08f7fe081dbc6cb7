"""``%gpumem monitor`` and ``%gpumem sidebar``: parse the panel options, make the panel, show it."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from gpumem.core.monitoring.monitor import default_monitor
from gpumem.ipython.arguments import (
    DEVICE_HELP,
    THRESHOLD_HELP,
    UsageError,
    argument,
    check_devices_exist,
    deprecated,
    magic_arguments,
    parse_argstring,
)
from gpumem.panel.options import DEFAULT_REFRESH_HZ, DEFAULT_THRESHOLD, is_bare_number, make_options
from gpumem.panel.writer import close_all, open_panels

if TYPE_CHECKING:
    from argparse import Namespace

    from IPython.display import DisplayHandle

    from gpumem.panel.widget import Panel

__all__ = ["CLOSED_NOTE", "forget_shown", "magic_monitor", "magic_sidebar"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _panel_arguments(func: _F) -> _F:
    """The panel's options as ``--`` options; unset ones take :func:`~gpumem.panel.options.make_options`' defaults."""
    for decorator in reversed(
        (
            argument(
                "-w",
                "--window",
                help="time window: 1min, 10min, 1h, all, or any duration such as 30s or 2h (default 10min)",
            ),
            argument(
                "-d", "--device", metavar="DEVICE", help=f"the device to show: {DEVICE_HELP}; one, or all (default)"
            ),
            argument(
                "-t",
                "--threshold",
                metavar="AMOUNT",
                help=f"where the header turns red: {THRESHOLD_HELP} (default {DEFAULT_THRESHOLD}%)",
            ),
            argument(
                "-r",
                "--refresh",
                metavar="HZ",
                help=(
                    f"most updates per second sent to the browser, 0.2 to 10 (default {DEFAULT_REFRESH_HZ:g}); "
                    "never more than the window's samples: 1 a second for 10 min, 10 for 1 min"
                ),
            ),
            argument("--rate", metavar="HZ", help="the old spelling of --refresh"),
            argument("--host", action="store_true", help="also plot this process's host RSS"),
            argument("--full-scale", action="store_true", help="y axis up to the device capacity"),
        )
    ):
        func = decorator(func)
    return func


def _panel_options(args: Namespace) -> dict[str, Any]:
    """The options given (checked; the others keep their defaults); a bad value is a one-line UsageError."""
    if args.rate is not None and args.refresh is not None:
        raise UsageError("--rate is the old spelling of --refresh: give one of them")
    given = {
        "window": args.window,
        "device": args.device,
        "threshold": args.threshold,
        "refresh_hz": args.refresh if args.rate is None else args.rate,
        "host": args.host or None,
        "full_scale": args.full_scale or None,
    }
    given = {name: value for name, value in given.items() if value is not None}
    try:
        options = make_options(**given)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if options.device is not None:  # a device CUDA does not have is a usage error, as for %%gpumem
        check_devices_exist((options.device,), default_monitor().source)  # the source the panel reads
    if "threshold" in given and is_bare_number(given["threshold"]):  # said once the line is accepted
        deprecated(f"--threshold {given['threshold']}", f"--threshold {options.threshold}")
    if args.rate is not None:
        deprecated("--rate", "--refresh")
    return given


def _has_kernel(shell: Any) -> bool:
    return getattr(shell, "kernel", None) is not None


_NO_KERNEL = (
    "The live panel is a Jupyter widget and needs a notebook front end (JupyterLab, Notebook 7, VS Code).\n"
    "This IPython has no kernel: %gpumem status prints the figures now (allocated, reserved, device used, host RSS)."
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
        _note_closed()
        print(f"Closed {count} panel{'s' if count != 1 else ''}.")
        return
    options = _panel_options(args)
    if not _has_kernel(shell):
        print(_NO_KERNEL)
        return
    from gpumem.panel.widget import Panel

    _show(Panel(shell=shell, **options))


@magic_arguments(name="gpumem sidebar")
@_panel_arguments
def magic_sidebar(shell: Any, line: str) -> None:
    """Dock the live memory panel in the right sidebar (JupyterLab 4, Notebook 7).

    Needs gpumem's front-end extension in the Jupyter server's environment; elsewhere the panel is
    shown inline with a note saying why.
    """
    args = parse_argstring(magic_sidebar, line)
    options = _panel_options(args)
    if not _has_kernel(shell):
        print(_NO_KERNEL)
        return
    from gpumem.panel.widget import sidebar_panel

    panel = sidebar_panel(shell=shell, **options) if options else sidebar_panel()
    try:
        from gpumem.panel.frontend import show_sidebar
    except ImportError as error:
        _show_inline(panel, f"The sidebar is unavailable ({error}); showing the panel inline instead.")
        return
    try:
        show_sidebar(panel)
    except Exception as error:
        _show_inline(
            panel, f"The sidebar could not be used ({type(error).__name__}: {error}); showing the panel inline."
        )


def _show_inline(panel: Panel, note: str) -> None:
    print(note)
    _show(panel)


CLOSED_NOTE = "gpumem panel closed (%gpumem monitor to open it again)"

# The outputs showing a panel: where the panel was, a closed panel leaves the note instead
# of an empty gap (the front end removes a closed widget's view).
# Weak references: a panel closed any other way is not kept alive by this list.
_shown: list[tuple[weakref.ref[Panel], DisplayHandle]] = []


def _show(panel: Panel) -> None:
    from IPython.display import display as ipython_display

    handle = ipython_display(panel, display_id=True)  # type: ignore[no-untyped-call]
    if handle is not None:
        _shown.append((weakref.ref(panel), handle))


def forget_shown() -> None:
    """At unload: the outputs of the panels shown are no longer ours to update."""
    _shown.clear()


def _note_closed() -> None:
    """Replace the output of each closed panel shown by these magics with the note saying how to reopen it."""
    for entry in list(_shown):
        panel = entry[0]()
        if panel is None or panel.closed:
            _shown.remove(entry)
            entry[1].update({"text/plain": CLOSED_NOTE}, raw=True)  # type: ignore[no-untyped-call]
