"""``%gpumem`` and ``%%gpumem``.

A ``%%gpumem`` cell is not run by the magic: an input transformer drops the ``%%gpumem`` line, so
IPython runs the body as the cell itself (display, ``_``, ``Out``, exceptions, magics and top-level
``await`` behave exactly as without it), and the extension's pre/post-run hooks measure it. The
magic function only runs when it is called some other way (``get_ipython().run_cell_magic``, or
under another cell magic such as ``%%time``); then it runs the body itself, like ``%%time`` does.

``%gpumem <subcommand>`` dispatches to functions ``magic_<name>(shell, line)``; those of other
features live in their own modules and are imported when used.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from IPython.core import magic_arguments as _magic_arguments_module
from IPython.core.error import UsageError

from gpumem.core import units
from gpumem.core.cells import CellOptions
from gpumem.core.devices import describe_devices, parse_cuda_indices
from gpumem.core.units import format_bytes

if TYPE_CHECKING:
    from gpumem.ipython.extension import ExtensionState

_args: Any = _magic_arguments_module
_F = TypeVar("_F", bound=Callable[..., Any])


def magic_arguments(name: str) -> Callable[[_F], _F]:
    """IPython's ``magic_arguments`` decorator, typed."""
    decorator: Callable[[_F], _F] = _args.magic_arguments(name)
    return decorator


def argument(*args: Any, **kwargs: Any) -> Callable[[_F], _F]:
    """IPython's ``argument`` decorator, typed."""
    decorator: Callable[[_F], _F] = _args.argument(*args, **kwargs)
    return decorator


def split_arguments(line: str) -> list[str]:
    """Split an option line like IPython does, without the quotes around a quoted argument.

    IPython's own splitting keeps them on POSIX, so ``--csv "my file.csv"`` would name a file whose
    name starts with a quote; unbalanced quotes are a UsageError rather than a traceback.
    """
    from IPython.utils.process import arg_split  # type: ignore[attr-defined]

    try:
        tokens: list[str] = arg_split(line, strict=True)
    except ValueError as error:
        raise UsageError(f"cannot split the options {line.strip()!r}: {error}") from None
    return [_unquote(token) for token in tokens]


def _unquote(token: str) -> str:
    if len(token) >= 2 and token[0] == token[-1] and token[0] in "'\"":
        return token[1:-1]
    return token


def parse_argstring(magic: Callable[..., Any], line: str) -> Any:
    """Parse ``line`` with the parser the decorators built (bad input raises UsageError)."""
    return magic.parser.parse_args(split_arguments(line))  # type: ignore[attr-defined]


def display(obj: object) -> None:
    """IPython's display: HTML in notebooks, text in terminals."""
    from IPython import display as ipython_display

    shown: Any = ipython_display
    shown.display(obj)


__all__ = [
    "CellRequest",
    "GpuMemMagic",
    "magic_auto",
    "magic_history",
    "magic_status",
    "parse_cell_options",
    "parse_size",
    "rewrite_cell_header",
    "split_cell_header",
]

DEFAULT_TOP = 5
_HEADER = re.compile(r"%%gpumem(?:[ \t]+(.*?))?[ \t]*\r?\n?\Z")


class CellRequest(NamedTuple):
    """A parsed ``%%gpumem`` line: how to measure, and how much to show."""

    options: CellOptions
    top: int | None  # None: the configured default


# %%gpumem -----------------------------------------------------------------------------------------


@magic_arguments("%gpumem")
@argument(
    "-d",
    "--device",
    metavar="DEVICES",
    help="CUDA devices to report and reset, e.g. '0' or '0,1' or 'cuda:1' (default: every device in use)",
)
@argument("-q", "--quiet", action="store_true", help="record the cell in the history but show nothing")
@argument(
    "-k",
    "--keep-peaks",
    action="store_true",
    help="do not reset PyTorch's peak counters (torch.cuda.max_memory_allocated keeps its value); the peak "
    "shown is then exact only if the counter rose during the cell, otherwise a sampled lower bound",
)
@argument("--top", type=int, metavar="N", help="show at most N variables (default: c.GpuMem.top_variables, 5)")
@argument("--no-vars", action="store_true", help="do not look for the variables that hold GPU memory")
def _cell_usage(line: str, cell: str | None = None) -> None:
    """Measure one cell: wall time; per CUDA device in use, PyTorch allocated and reserved memory before ->
    after, the exact peak above the starting point and the whole-device used memory (NVML); host RSS
    change and peak; the variables that now hold more GPU memory; warnings (leak on re-run, autograd
    graph kept alive, device nearly full, fragmentation).

    The body runs exactly as a normal cell. Peaks: by default PyTorch's peak counters are reset when
    the cell starts, which makes the peak exact but also resets what torch.cuda.max_memory_allocated()
    returns; --keep-peaks leaves them alone.
    """


def parse_devices(text: str) -> tuple[int, ...]:
    """``'0,1'``, ``'cuda:1'`` -> device indices (a bad name is a UsageError)."""
    try:
        return parse_cuda_indices(text)
    except ValueError:
        raise UsageError(f"--device expects CUDA device indices such as 0 or 0,1 or cuda:1, not {text!r}") from None


def parse_cell_options(line: str) -> CellRequest:
    """Parse the arguments of a ``%%gpumem`` line (raises UsageError with a one-line message)."""
    args = parse_argstring(_cell_usage, line)
    if args.top is not None and args.top < 0:
        raise UsageError(f"--top must be 0 or more, not {args.top}")
    devices = parse_devices(args.device) if args.device else None
    if devices:
        check_devices_exist(devices)
    options = CellOptions(
        devices=devices,
        keep_peaks=bool(args.keep_peaks),
        attribute=not args.no_vars,
        mode="magic",
        quiet=bool(args.quiet),
    )
    return CellRequest(options, args.top)


def check_devices_exist(devices: tuple[int, ...], source: Any = None) -> None:
    """Reject indices past the devices CUDA reports (only knowable once CUDA is initialized).

    ``source`` defaults to the loaded extension's (else the shared monitor's) memory source.
    """
    if source is None:
        from gpumem.core.monitor import default_monitor
        from gpumem.ipython import extension as _extension

        state = _extension.get_state()
        source = state.monitor.source if state is not None else default_monitor().source
    try:
        visible = tuple(source.cuda_devices())
    except Exception:
        return
    missing = [device for device in devices if device not in visible]
    if visible and missing:
        listed = ", ".join(f"cuda:{device}" for device in missing)
        raise UsageError(f"--device {listed}: no such device; this process sees {describe_devices(visible)}")


def split_cell_header(raw_cell: str) -> tuple[str, str] | None:
    """``(arguments, body)`` when the cell starts with a ``%%gpumem`` line, else None."""
    stripped = raw_cell.lstrip(" \t\r\n")
    if not stripped.startswith("%%gpumem"):
        return None
    newline = stripped.find("\n")
    first, body = (stripped, "") if newline < 0 else (stripped[: newline + 1], stripped[newline + 1 :])
    match = _HEADER.match(first)
    if match is None:
        return None
    return (match.group(1) or "").strip(), body


def rewrite_cell_header(lines: list[str]) -> list[str]:
    """Input transformer: run a ``%%gpumem`` cell's body as the cell itself.

    The header line becomes ``get_ipython().run_line_magic('gpumem', '_cell ARGS')``, on the same
    line so that traceback line numbers match the cell. For a top-level cell the pre-run hook has
    already started measuring and that call does nothing; when another magic runs the body
    (``%%time`` above ``%%gpumem``), it starts the measurement. When the next line is another cell
    magic the header is only dropped (a cell magic must come first). A header with invalid
    arguments is left in place: IPython then calls the magic, which reports the error without
    running the body, as any cell magic would.
    """
    if not lines or not lines[0].startswith("%%gpumem"):
        return lines
    match = _HEADER.match(lines[0])
    if match is None:
        return lines
    arguments = (match.group(1) or "").strip()
    try:
        parse_cell_options(arguments)
    except UsageError:
        return lines
    if len(lines) > 1 and lines[1].startswith("%%"):
        return lines[1:]
    call = f"get_ipython().run_line_magic('gpumem', {('_cell ' + arguments).strip()!r})\n"
    return [call, *lines[1:]]


# The terminal's "is this cell complete?" check must still see the %%gpumem line (a cell magic is
# complete at a blank line), so this transformer only runs when the cell is executed.
rewrite_cell_header.has_side_effects = True  # type: ignore[attr-defined]


def _run_body(shell: Any, body: str) -> Any:
    """Run ``body`` in the user namespace like ``%%time`` does; returns the last expression's value."""
    code = shell.transform_cell(body)
    filename = shell.compile.cache(code, shell.execution_count, raw_code=body)
    tree = shell.compile.ast_parse(code, filename=filename)
    tree = shell.transform_ast(tree)
    last: ast.Expression | None = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec"), shell.user_global_ns, shell.user_ns)
    if last is None:
        return None
    value = eval(compile(last, filename, "eval"), shell.user_global_ns, shell.user_ns)
    quiet = getattr(shell.displayhook, "semicolon_at_end_of_expression", None)
    if quiet is not None and quiet(body):
        return None
    return value


def _cell_magic(shell: Any, line: str, body: str) -> Any:
    """``%%gpumem`` called as a function: measure the body (or join the measurement already running)."""
    from gpumem.ipython import extension as _extension
    request = parse_cell_options(line)
    state = _extension.get_state()
    if state is None:
        raise UsageError("gpumem is not loaded: run %load_ext gpumem")
    if state.adopt_cell_request(request):
        return _run_body(shell, body)
    try:
        cell = state.tracker.begin(
            body, options=request.options, execution_count=state.running_cell_number(), namespace=shell.user_ns
        )
    except (Exception, KeyboardInterrupt) as failure:
        _extension._complain("could not start measuring this cell", failure)
        return _run_body(shell, body)  # the user's code runs all the same
    error: BaseException | None = None
    try:
        return _run_body(shell, body)
    except BaseException as caught:
        error = caught
        raise
    finally:
        state.finish(cell, error, request)


def _cell_header_reached(line: str) -> None:
    """The body of a ``%%gpumem`` cell starts running (see :func:`rewrite_cell_header`)."""
    from gpumem.ipython import extension as _extension
    state = _extension.get_state()
    if state is not None:
        state.cell_header_reached(parse_cell_options(line))


# %gpumem subcommands ------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """A memory size such as ``64MiB`` (see :func:`gpumem.core.units.parse_size`); bad input is a UsageError."""
    try:
        return units.parse_size(text)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _state(shell: Any) -> ExtensionState:
    from gpumem.ipython import extension as _extension
    state = _extension.get_state()
    if state is None or state.shell is not shell:
        raise UsageError("gpumem is not loaded in this shell: run %load_ext gpumem")
    return state


@magic_arguments("gpumem auto")
@argument(
    "switch",
    nargs="?",
    type=str.lower,
    choices=("on", "off"),
    help="turn automatic mode on or off (omit to see its settings)",
)
@argument(
    "--threshold",
    metavar="SIZE",
    help="show a summary line under a cell whose memory changed by at least SIZE (e.g. 64MiB; default 64MiB)",
)
@argument(
    "--vars",
    choices=("changed", "always", "never"),
    help="when to look for the variables holding GPU memory: only after cells that changed CUDA allocated "
    "memory by at least GpuMem.attribute_threshold_bytes (default), after every cell, or never",
)
@argument("--keep-peaks", action="store_true", help="leave PyTorch's peak counters alone (sampled peaks)")
@argument("--reset-peaks", action="store_true", help="reset the peak counters at each cell start (exact peaks)")
def magic_auto(shell: Any, line: str) -> None:
    """Measure every cell (quietly): each is recorded in the history; a one-line summary appears under
    a cell only when it changed memory by at least the threshold or has a warning. The default comes
    from the IPython config option c.GpuMem.auto.
    """
    args = parse_argstring(magic_auto, _SPLIT_SIZE.sub(r"\1\2", line))
    state = _state(shell)
    config = state.config
    if args.keep_peaks and args.reset_peaks:
        raise UsageError("choose one of --keep-peaks and --reset-peaks")
    if args.threshold is not None:
        config.threshold_bytes = parse_size(args.threshold)
    if args.vars is not None:
        config.attribute = args.vars
    if args.keep_peaks or args.reset_peaks:
        config.keep_peaks = bool(args.keep_peaks)
    if args.switch is not None:
        config.auto = args.switch == "on"
    print(auto_mode_text(state))


# "--threshold 64 MiB" (number and unit as two words) means "--threshold 64MiB".
_SPLIT_SIZE = re.compile(r"(--threshold(?:=|\s+)[0-9.eE]+)\s+([kKmMgGtT]i?[bB]?|[bB])(?=\s|$)")


def auto_mode_text(state: ExtensionState) -> str:
    config = state.config
    if not config.auto:
        return "gpumem automatic mode is off (%gpumem auto on, or %%gpumem on one cell)."
    peaks = (
        "peak counters are left alone (--keep-peaks): peaks are sampled lower bounds unless the counter rose"
        if config.keep_peaks
        else "PyTorch's peak counters are reset when each cell starts, so peaks are exact but "
        "torch.cuda.max_memory_allocated() only covers the current cell (--keep-peaks avoids this)"
    )
    variables = {
        "changed": "after cells that changed CUDA allocated memory by at least "
        f"{format_bytes(config.attribute_threshold_bytes)}",
        "always": "after every cell",
        "never": "never",
    }[config.attribute]
    return (
        "gpumem automatic mode is on: every cell is measured and recorded (%gpumem history); a summary line "
        f"appears under cells that change memory by at least {format_bytes(config.threshold_bytes)} or have a "
        f"warning. Variables are inspected {variables}; {peaks}."
    )


@magic_arguments("gpumem history")
@argument("--last", type=int, default=30, metavar="N", help="show the last N cells (default 30)")
@argument("--all", action="store_true", help="show every recorded cell")
@argument("--csv", metavar="PATH", help="write the history to a CSV file (one row per cell)")
@argument("--json", metavar="PATH", help="write the history to a JSON file (one object per cell)")
@argument("--clear", action="store_true", help="forget the recorded cells")
def magic_history(shell: Any, line: str) -> None:
    """Show the measured cells (number, start, duration, status, per-device allocated change and peak,
    host change, warnings, first line), or export them. In Python, gpumem.history() returns a DataFrame.
    """
    from gpumem.core.cells.report import HistoryTable, write_csv, write_json

    args = parse_argstring(magic_history, line)
    state = _state(shell)
    records = state.tracker.history
    if args.last < 0:
        raise UsageError(f"--last must be 0 or more, not {args.last}")
    exported = False
    for path, writer, kind in ((args.csv, write_csv, "CSV"), (args.json, write_json, "JSON")):
        if path is None:
            continue
        target = Path(path).expanduser()
        try:
            writer(records, target)
        except OSError as error:
            raise UsageError(f"cannot write {kind} to {str(target)!r}: {error.strerror or error}") from None
        print(f"wrote {len(records)} cells to {target}")
        exported = True
    if args.clear:
        state.tracker.clear_history()
        print(f"forgot {len(records)} cells")
        return
    if exported:
        return
    shown = records if args.all else records[len(records) - args.last :] if args.last else ()
    display(HistoryTable(shown, total=len(records)))


@magic_arguments("gpumem status")
def magic_status(shell: Any, line: str) -> None:
    """Show what gpumem can read here (PyTorch allocator, NVML, host), the automatic mode and the sampler."""
    parse_argstring(magic_status, line)
    state = _state(shell)
    lines = ["gpumem status"]
    for reader, status in state.monitor.status().items():
        lines.append(f"  {reader:<8} {status}")
    sampler = state.monitor.sampler
    cost = sampler.cost()
    rate = f"{sampler.rate_hz:g} Hz"
    running = f"running at {rate}" if sampler.running else f"stopped ({rate} when running)"
    if cost.samples:
        each = f"{cost.mean_s * 1e3:.1f} ms" if cost.mean_s >= 1e-3 else f"{cost.mean_s * 1e6:.0f} us"
        taken = f"{_count(cost.samples, 'sample')} taken, {each} each on average"
    else:
        taken = "no samples taken yet"
    lines.append(f"  sampler  {running}; {taken}")
    if sampler.last_error:
        lines.append(f"           the last read failed: {sampler.last_error}")
    lines.append("  auto     " + auto_mode_text(state).removeprefix("gpumem automatic mode is "))
    cells = _count(len(state.tracker.history), "cell")
    lines.append(f"  history  {cells} recorded (keeps up to {state.tracker.history_size:,})")
    print("\n".join(lines))


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


# %gpumem dispatch ---------------------------------------------------------------------------------


class _Subcommand(NamedTuple):
    module: str
    function: str
    feature: str


_SUBCOMMANDS: dict[str, _Subcommand] = {
    "monitor": _Subcommand("gpumem.ipython.panel_magics", "magic_monitor", "the live memory panel"),
    "sidebar": _Subcommand("gpumem.ipython.panel_magics", "magic_sidebar", "the panel in the right sidebar"),
    "auto": _Subcommand("gpumem.ipython.magics", "magic_auto", "automatic mode"),
    "history": _Subcommand("gpumem.ipython.magics", "magic_history", "the cell history"),
    "status": _Subcommand("gpumem.ipython.magics", "magic_status", "the status report"),
    "who": _Subcommand("gpumem.ipython.memory_magics", "magic_who", "finding what holds GPU memory"),
    "free": _Subcommand("gpumem.ipython.memory_magics", "magic_free", "freeing memory"),
}

_INTRO = """\
GPU memory tools for PyTorch: where did my GPU memory go?

%gpumem [SUBCOMMAND] [options]     (no subcommand: the live panel, like %gpumem monitor)
%%gpumem [options]                 measure the cell below it (see the options further down)

Subcommands: {names}.
Each is described below (%gpumem SUBCOMMAND -h shows one); bad options give a one-line error.
"""


def _load_subcommand(name: str) -> Callable[[Any, str], None]:
    entry = _SUBCOMMANDS[name]
    try:
        module = sys.modules.get(entry.module) or importlib.import_module(entry.module)
    except ImportError as error:
        raise UsageError(f"{entry.feature} is unavailable: {entry.module} could not be imported ({error})") from None
    function = getattr(module, entry.function, None)
    if not callable(function):
        raise UsageError(f"{entry.feature} is unavailable: {entry.module} has no {entry.function}")
    return function  # type: ignore[no-any-return]


class GpuMemMagic:
    """The ``%gpumem`` line magic and the ``%%gpumem`` cell magic; ``getdoc`` feeds ``%gpumem?``."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.__name__ = "gpumem"

    def __call__(self, line: str, cell: str | None = None) -> Any:
        if cell is not None:
            try:
                return _cell_magic(self.shell, line, cell)
            except UsageError as error:
                raise _named(error, "%%gpumem") from None
        name, rest = [*line.split(None, 1), "", ""][:2]
        if name == "_cell":
            _cell_header_reached(rest)
            return None
        if name in _HELP:
            print(self.getdoc())
            return None
        name = name or "monitor"
        if name not in _SUBCOMMANDS:
            raise UsageError(
                f"%gpumem: unknown subcommand {name!r}; use one of: {', '.join(sorted(_SUBCOMMANDS))} (%gpumem?)"
            )
        if _HELP_FLAGS.intersection(rest.split()):
            print(self.subcommand_doc(name))
            return None
        try:
            return _load_subcommand(name)(self.shell, rest.strip())
        except UsageError as error:
            raise _named(error, f"%gpumem {name}") from None

    def subcommand_doc(self, name: str) -> str:
        """One subcommand's help: what it does and its options."""
        try:
            text = _load_subcommand(name).__doc__ or "(no description)"
        except UsageError as error:
            text = str(error)
        return f"%gpumem {name}\n" + "-" * (8 + len(name)) + "\n" + _dedent(text)

    def getdoc(self) -> str:
        """Every subcommand's help and every ``%%gpumem`` option, gathered when asked for."""
        parts = [_INTRO.format(names=", ".join(_SUBCOMMANDS))]
        parts.extend(self.subcommand_doc(name) for name in _SUBCOMMANDS)
        parts.append("%%gpumem\n--------\n" + _dedent(_cell_usage.__doc__ or ""))
        return "\n\n".join(part.strip("\n") for part in parts) + "\n"


_HELP_FLAGS = frozenset({"-h", "--help"})
_HELP = _HELP_FLAGS | {"help"}


def _named(error: UsageError, command: str) -> UsageError:
    """The same message, starting with the command it is about (other modules may have named it already)."""
    message = str(error)
    if message.startswith(("%gpumem", "%%gpumem")):
        return error
    return UsageError(f"{command}: {message}")


def _dedent(text: str) -> str:
    import inspect

    return inspect.cleandoc(text)


def register(shell: Any) -> GpuMemMagic:
    """Register ``%gpumem``/``%%gpumem`` and the header transformer (idempotent)."""
    magic = GpuMemMagic(shell)
    shell.magics_manager.register_function(magic, "line_cell", "gpumem")
    transformers = shell.input_transformers_cleanup
    if rewrite_cell_header not in transformers:
        transformers.append(rewrite_cell_header)
    return magic


def unregister(shell: Any, magic: GpuMemMagic | None) -> None:
    """Remove what :func:`register` added (only our own objects)."""
    manager = shell.magics_manager
    for kind in ("line", "cell"):
        table = manager.magics.get(kind, {})
        if isinstance(table.get("gpumem"), GpuMemMagic):
            del table["gpumem"]
    user_magics = getattr(manager, "user_magics", None)
    if user_magics is not None and isinstance(getattr(user_magics, "gpumem", None), GpuMemMagic):
        delattr(user_magics, "gpumem")
    transformers = shell.input_transformers_cleanup
    while rewrite_cell_header in transformers:
        transformers.remove(rewrite_cell_header)
    del magic
