"""``%gpumem who`` and ``%gpumem free``: parse, call the core, display."""

from __future__ import annotations

from typing import Any

from gpumem.core.cleanup import free
from gpumem.core.holders import DEFAULT_MAX_DEPTH, find_holders, render_html, render_text
from gpumem.core.monitoring.monitor import default_monitor
from gpumem.ipython.arguments import (
    DEVICE_HELP,
    UsageError,
    argument,
    check_devices_exist,
    display,
    magic_arguments,
    parse_argstring,
    parse_device_option,
)

__all__ = ["magic_free", "magic_who"]

_TOP_HOLDERS = 20


def magic_who(shell: Any, line: str) -> None:
    """%gpumem who [-d/--device DEVICE] [--all] [--depth N] [--cycles]

    List the names that keep tensor memory alive, largest first, storages counted once, with the
    references IPython itself keeps (output cache, last exception) and the command that frees them.
    DEVICE is whose tensors count: cuda (every CUDA device, the default), cuda:N or N, cpu or all.
    --all lists every holder instead of the top 20; --depth N is how deep to look inside containers and
    objects (default 5); --cycles also runs one garbage collection to find (and free) tensors that only
    reference cycles keep alive.
    """
    try:
        options = _who_options(line)
        report = find_holders(
            shell.user_ns, device=options.device, shell=shell, max_depth=options.depth, cycles=options.cycles
        )
    except (UsageError, ValueError) as error:
        raise UsageError(f"%gpumem who: {error}") from None
    limit = 10**9 if options.show_all else _TOP_HOLDERS
    display(text=render_text(report, limit=limit), html=render_html(report, limit=limit))


# The options live on their own function so that the help above stays the hand-written summary.
@magic_arguments("who")
@argument(
    "-d", "--device", default="cuda", metavar="DEVICE", help=f"{DEVICE_HELP}; one device or a kind (default cuda)"
)
@argument("--all", dest="show_all", action="store_true", help="list every holder, not only the top 20")
@argument("--depth", type=int, default=DEFAULT_MAX_DEPTH, help="how deep to look inside containers/objects")
@argument("--cycles", action="store_true", help="also find (and free) tensors kept only by reference cycles")
def _who_arguments(line: str) -> None:
    """%gpumem who"""


def _who_options(line: str) -> Any:
    """Options of ``%gpumem who``, checked (bad input raises UsageError; a bad device name ValueError)."""
    options = parse_argstring(_who_arguments, line)
    if options.depth < 1:
        raise UsageError(f"--depth takes a whole number >= 1, got {options.depth}")
    try:
        kind, index = parse_device_option(options.device).spec()
    except ValueError as error:
        raise UsageError(f"--device: {error}") from None
    if kind == "cuda" and index is not None:
        check_devices_exist((index,), default_monitor().source)  # the source find_holders reads
    return options


def magic_free(shell: Any, line: str) -> None:
    """%gpumem free [--deep] [--workspaces]

    Run gc.collect() and return PyTorch's cached, unused blocks to the driver (empty_cache), and print
    what each device got back (allocated and reserved). --deep first drops the references IPython keeps
    to tensors: output-cache entries (Out[N], _N, _, __, ___) whose value holds tensors, and the last
    exception's frames (sys.last_traceback, the traceback handler's copy). Your own names are never touched.
    --workspaces also releases the cuBLAS workspaces PyTorch keeps for matmuls (the next matmul
    allocates its workspace again).
    """
    try:
        options = parse_argstring(_free_arguments, line)
    except UsageError as error:
        raise UsageError(f"%gpumem free: {error}") from None
    display(text=free(deep=options.deep, shell=shell, workspaces=options.workspaces).describe())


@magic_arguments("free")
@argument("--deep", action="store_true", help="also drop IPython's references to tensors")
@argument(
    "--workspaces",
    action="store_true",
    help="also release PyTorch's cuBLAS workspaces (the next matmul allocates them again)",
)
def _free_arguments(line: str) -> None:
    """%gpumem free"""
