"""``%gpumem who`` and ``%gpumem free``: parse, call the core, display."""

from __future__ import annotations

from typing import Any

from gpumem.core.cleanup import free
from gpumem.core.devices import parse_device
from gpumem.core.holders import DEFAULT_MAX_DEPTH, find_holders, render_html, render_text

__all__ = ["magic_free", "magic_who"]


def magic_who(shell: Any, line: str) -> None:
    """%gpumem who [-d/--device cuda|cuda:N|cpu|all] [--all] [--depth N] [--cycles]

    List the names that keep tensor memory alive, largest first, storages counted once, with the
    references IPython itself keeps (output cache, last exception) and the command that frees them.
    --all lists every holder instead of the top 20; --cycles also runs one garbage collection to find
    (and free) tensors that only reference cycles keep alive.
    """
    from IPython.core.error import UsageError

    options = _parse_who(line)
    try:
        report = find_holders(
            shell.user_ns, device=options.device, shell=shell, max_depth=options.depth, cycles=options.cycles
        )
    except ValueError as error:
        raise UsageError(f"%gpumem who: {error}") from None
    limit = 10**9 if options.show_all else 20
    _display(render_text(report, limit=limit), render_html(report, limit=limit))


def _parse_who(line: str) -> Any:
    """Options of ``%gpumem who``, parsed by IPython's magic_arguments (bad input raises UsageError)."""
    import importlib

    from IPython.core.error import UsageError

    magic_args: Any = importlib.import_module("IPython.core.magic_arguments")
    argument = magic_args.argument

    def who(line: str) -> None:
        """%gpumem who"""

    parser_owner: Any = who
    for decorator in (
        argument("--cycles", action="store_true", help="also find (and free) tensors kept only by reference cycles"),
        argument("--depth", type=int, default=DEFAULT_MAX_DEPTH, help="how deep to look inside containers/objects"),
        argument("--all", dest="show_all", action="store_true", help="list every holder, not only the top 20"),
        argument("-d", "--device", default="cuda", help="cuda (every CUDA device), cuda:N or N, cpu or all"),
        magic_args.magic_arguments(),
    ):
        parser_owner = decorator(parser_owner)
    from gpumem.ipython.magics import parse_argstring

    try:
        options = parse_argstring(parser_owner, line)
    except UsageError as error:
        raise UsageError(f"%gpumem who: {error}") from None
    if options.depth < 1:
        raise UsageError(f"%gpumem who: --depth takes a whole number >= 1, got {options.depth}")
    try:
        kind, index = parse_device(options.device)
    except ValueError as error:
        raise UsageError(f"%gpumem who: {error}") from None
    if kind == "cuda" and index is not None:
        from gpumem.ipython.magics import check_devices_exist

        try:
            check_devices_exist((index,))
        except UsageError as error:
            raise UsageError(f"%gpumem who: {error}") from None
    return options


def _display(text: str, html: str) -> None:
    import importlib

    display: Any = importlib.import_module("IPython.display").display
    display({"text/plain": text, "text/html": html}, raw=True)


def magic_free(shell: Any, line: str) -> None:
    """%gpumem free [--deep]

    Run gc.collect() and return PyTorch's cached, unused blocks to the driver (empty_cache), and print
    what each device got back (allocated and reserved). --deep first drops the references IPython keeps
    to tensors: output-cache entries (Out[N], _N, _, __, ___) whose value holds tensors, and the last
    exception's frames (sys.last_traceback, the traceback handler's copy). Your own names are never touched.
    """
    import importlib

    from IPython.core.error import UsageError

    magic_args: Any = importlib.import_module("IPython.core.magic_arguments")

    def free_options(line: str) -> None:
        """%gpumem free"""

    parser_owner: Any = free_options
    for decorator in (
        magic_args.argument("--deep", action="store_true", help="also drop IPython's references to tensors"),
        magic_args.magic_arguments(),
    ):
        parser_owner = decorator(parser_owner)
    from gpumem.ipython.magics import parse_argstring

    try:
        options = parse_argstring(parser_owner, line)
    except UsageError as error:
        raise UsageError(f"%gpumem free: {error}") from None
    result = free(deep=options.deep, shell=shell)
    display: Any = importlib.import_module("IPython.display").display
    display({"text/plain": result.describe()}, raw=True)
