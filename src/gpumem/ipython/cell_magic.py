"""The ``%%gpumem`` header: its options, the input transformer that runs the body as the cell, and
running the body when the magic is called as a function.

A ``%%gpumem`` cell is not run by the magic: :class:`HeaderTransformer` drops the ``%%gpumem``
line, so IPython runs the body as the cell itself (display, ``_``, ``Out``, exceptions, magics and
top-level ``await`` behave exactly as without it), and the extension's pre/post-run hooks measure
it. The magic only runs the body itself when it is called some other way
(``get_ipython().run_cell_magic``, or under another cell magic such as ``%%time``), with
:func:`run_body`, like ``%%time`` does.
"""

from __future__ import annotations

import ast
import linecache
import re
import sys
from types import FrameType
from typing import Any, NamedTuple, cast

from gpumem.core.cells import CellOptions
from gpumem.core.readers.sources import MemorySource
from gpumem.core.trace import DEFAULT_MAX_ENTRIES
from gpumem.ipython.arguments import (
    DEVICE_HELP,
    UsageError,
    argument,
    deprecated,
    magic_arguments,
    parse_argstring,
    parse_cuda_devices,
)
from gpumem.ipython.cell_recorders import TraceRequest
from gpumem.ipython.predict_cell import PredictRequest, parse_predict
from gpumem.ipython.state import VARS_HELP, VARS_MODES, vars_attribute

__all__ = ["CellRequest", "HeaderTransformer", "cell_usage", "parse_cell_options", "run_body", "split_cell_header"]

_HEADER = re.compile(r"%%gpumem(?:[ \t]+(.*?))?[ \t]*\r?\n?\Z")


class CellRequest(NamedTuple):
    """A parsed ``%%gpumem`` line: how to measure, and how much to show."""

    options: CellOptions
    top: int | None  # None: the configured default
    trace: TraceRequest | None = None  # --trace: where the cell's memory came from
    profile: bool = False  # --profile: PyTorch's operator recorder, the operators that allocated most
    predict: PredictRequest | None = None  # --predict / --batch: a dry run instead of running the cell


@magic_arguments("%gpumem")
@argument(
    "-d",
    "--device",
    metavar="DEVICES",
    help=f"the CUDA devices to report and reset: {DEVICE_HELP} (default: every device in use; host memory is always "
    "reported)",
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
@argument("--vars", choices=VARS_MODES, metavar="MODE", help=f"{VARS_HELP} (default always)")
@argument("--no-vars", action="store_true", help="the old spelling of --vars never")
@argument(
    "--trace",
    action="store_true",
    help="record PyTorch's allocation history while the cell runs (starts CUDA if not yet started) and show "
    "the allocation sites of what was alive at the peak, what the cell left behind and what was temporary",
)
@argument(
    "--trace-entries",
    type=int,
    metavar="N",
    help=f"keep at most N allocator events (default {DEFAULT_MAX_ENTRIES:,}, a few hundred MB of host memory "
    "at most); implies --trace",
)
@argument(
    "--trace-save",
    metavar="PATH",
    help="also write the raw snapshot (a pickle, as torch.cuda.memory._dump_snapshot writes) to PATH; implies --trace",
)
@argument(
    "--profile",
    action="store_true",
    help="record PyTorch's operator calls (with memory and input shapes; CPU, and CUDA when available) "
    "while the cell runs and show the operators that allocated most, and what profiling cost",
)
@argument(
    "--predict",
    action="store_true",
    help="do not run the cell: dry-run it on fake copies of its tensors, modules and optimizers (nothing of "
    "yours changes, no GPU memory is taken) and show the predicted peak and end-of-cell memory per device, by "
    "kind and by module, and whether it fits in the memory free now (or --capacity)",
)
@argument(
    "--capacity",
    metavar="SIZE",
    help="with --predict or --batch: the device memory to fit in, e.g. 24GiB (default: what is free now)",
)
@argument(
    "--batch",
    metavar="NAME=LOW..HIGH",
    help="dry-run the cell for values of the integer NAME (set before the cell) between LOW and HIGH and show "
    "the largest that fits (free memory now, or --capacity), its peak and the memory per extra unit; implies "
    "--predict and never runs the cell",
)
def cell_usage(line: str, cell: str | None = None) -> None:
    """Measure one cell: wall time; per CUDA device in use, PyTorch allocated and reserved memory before ->
    after, the exact peak above the starting point and the whole-device used memory (NVML); host RSS
    change and peak; the variables that now hold more GPU memory; warnings (leak on re-run, autograd
    graph kept alive, device nearly full, fragmentation).

    The body runs exactly as a normal cell. Peaks: by default PyTorch's peak counters are reset when
    the cell starts, which makes the peak exact but also resets what torch.cuda.max_memory_allocated()
    returns; --keep-peaks leaves them alone.
    """


def parse_cell_options(line: str, source: MemorySource) -> CellRequest:
    """Parse the arguments of a ``%%gpumem`` line (raises UsageError with a one-line message).

    ``source`` is the memory source measured, which says which CUDA devices exist.
    """
    args = parse_argstring(cell_usage, line)
    if args.top is not None and args.top < 0:
        raise UsageError(f"--top must be 0 or more, not {args.top}")
    if args.trace_entries is not None and args.trace_entries < 1:
        raise UsageError(f"--trace-entries must be 1 or more, not {args.trace_entries}")
    trace = None
    if args.trace or args.trace_entries is not None or args.trace_save:
        trace = TraceRequest(args.trace_entries or DEFAULT_MAX_ENTRIES, args.trace_save or None)
    devices = parse_cuda_devices(args.device, source)
    if args.no_vars and args.vars not in (None, "never"):
        raise UsageError(f"--no-vars is --vars never: it cannot go with --vars {args.vars}")
    options = CellOptions(
        devices=devices,
        keep_peaks=bool(args.keep_peaks),
        attribute=vars_attribute("never" if args.no_vars else args.vars or "always"),
        mode="magic",
        quiet=bool(args.quiet),
    )
    predict = parse_predict(args.predict, args.capacity, args.batch)
    if predict is not None and (trace is not None or args.profile):
        raise UsageError("--predict and --batch do not run the cell: they cannot be combined with --trace or --profile")
    if args.no_vars:  # said once the line is accepted
        deprecated("--no-vars", "--vars never")
    return CellRequest(options, args.top, trace, profile=bool(args.profile), predict=predict)


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


class HeaderTransformer:
    """Input transformer: run a ``%%gpumem`` cell's body as the cell itself.

    The header line becomes ``get_ipython().run_line_magic('gpumem', '_cell ARGS')``, on the same
    line so that traceback line numbers match the cell. For a top-level cell the pre-run hook has
    already started measuring and that call does nothing; when another magic runs the body
    (``%%time`` above ``%%gpumem``), it starts the measurement. When the next line is another cell
    magic the header is only dropped (a cell magic must come first). A header with invalid
    arguments is left in place: IPython then calls the magic, which reports the error without
    running the body, as any cell magic would. So is a ``--predict`` or ``--batch`` header: the magic
    then gets the body as text and dry-runs it (:mod:`gpumem.ipython.predict_cell`); the body never runs.

    IPython caches the transformed cell for its tracebacks (``linecache``, under the cell's name),
    so they would show that call as line 1; when the call runs, :meth:`show_header_in_tracebacks`
    puts the user's own header line back in that cache.
    """

    # The terminal's "is this cell complete?" check must still see the %%gpumem line (a cell magic is
    # complete at a blank line), so IPython runs this transformer only when the cell is executed.
    has_side_effects = True

    def __init__(self, source: MemorySource) -> None:
        self.source = source
        self._headers: dict[str, str] = {}  # the call line -> the user's header line it replaced
        self._parsed: tuple[str, CellRequest | UsageError] | None = None  # this cell's header, parsed

    def parse(self, arguments: str) -> CellRequest:
        """The cell's ``%%gpumem`` arguments parsed (a UsageError when they are bad), once per cell: this
        transformer, the pre-run hook and the header's call all ask, and the devices are checked once.
        :meth:`forget` (when the cell ends) makes the next cell parse (and check the devices) again."""
        parsed = self._parsed
        if parsed is None or parsed[0] != arguments:
            try:
                parsed = (arguments, parse_cell_options(arguments, self.source))
            except UsageError as error:
                parsed = (arguments, error)
            self._parsed = parsed
        if isinstance(parsed[1], UsageError):
            raise UsageError(str(parsed[1]))
        return parsed[1]

    def forget(self) -> None:
        """The cell ended: its header is not the next one's (devices may appear once CUDA starts)."""
        self._parsed = None

    def __call__(self, lines: list[str]) -> list[str]:
        if not lines or not lines[0].startswith("%%gpumem"):
            return lines
        match = _HEADER.match(lines[0])
        if match is None:
            return lines
        arguments = (match.group(1) or "").strip()
        try:
            request = self.parse(arguments)
        except UsageError:
            return lines
        if request.predict is not None:
            return lines  # IPython calls the %%gpumem cell magic with the body as text: the body is not run
        if len(lines) > 1 and lines[1].startswith("%%"):
            return lines[1:]
        call = f"get_ipython().run_line_magic('gpumem', {('_cell ' + arguments).strip()!r})"
        self._headers.pop(call, None)
        self._headers[call] = lines[0].rstrip("\r\n") + "\n"
        while len(self._headers) > _HEADERS_KEPT:
            del self._headers[next(iter(self._headers))]
        return [call + "\n", *lines[1:]]

    def show_header_in_tracebacks(self, frame: FrameType | None) -> None:
        """Called from the header's call: in the cached source of the cell running it, show the header again.

        ``frame`` is the caller's; the cell is the first frame up the stack executing one of our
        calls in a cached cell (a body run by ``%%time`` has no cached source: nothing to do).
        """
        for _ in range(_FRAMES_SEARCHED):
            if frame is None:
                return
            entry = linecache.cache.get(frame.f_code.co_filename)
            line = frame.f_lineno
            if entry is not None and len(entry) == _CACHE_ENTRY_FIELDS:  # not a lazy (1-tuple) entry
                size, mtime, source, name = cast("tuple[int, float | None, list[str], str]", entry)
                header = self._headers.get(source[line - 1].rstrip("\n")) if 0 < line <= len(source) else None
                if header is not None:
                    lines = [*source[: line - 1], header, *source[line:]]
                    linecache.cache[frame.f_code.co_filename] = (size, mtime, lines, name)
                    return
            frame = frame.f_back


_HEADERS_KEPT = 64
_FRAMES_SEARCHED = 16  # from the magic up to the cell: IPython's run_line_magic and the magic's wrappers
_CACHE_ENTRY_FIELDS = 4  # linecache's (size, mtime, lines, full name)


def _calling_cell_number(shell: Any) -> int:
    """The number of the cell whose code called the magic, so the body's lines are named after that cell.

    IPython counts the running cell before it runs, so ``execution_count`` is already the next
    cell's number; the calling cell's compiled filename says which cell it is.
    """
    numbers = getattr(shell.compile, "_filename_map", None)
    frame: FrameType | None = sys._getframe(1)  # noqa: SLF001 - the caller's frame, without inspect's cost
    for _ in range(_FRAMES_SEARCHED):
        if frame is None:
            break
        number = numbers.get(frame.f_code.co_filename) if isinstance(numbers, dict) else None
        if isinstance(number, int):
            return number
        frame = frame.f_back
    return int(shell.execution_count)


def run_body(shell: Any, body: str) -> Any:
    """Run ``body`` in the user namespace like ``%%time`` does; returns the last expression's value."""
    code = shell.transform_cell(body)
    filename = shell.compile.cache(code, _calling_cell_number(shell), raw_code=body)
    tree = shell.compile.ast_parse(code, filename=filename)
    tree = shell.transform_ast(tree)
    last: ast.Expression | None = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec"), shell.user_global_ns, shell.user_ns)  # noqa: S102 - the user's own cell
    if last is None:
        return None
    value = eval(compile(last, filename, "eval"), shell.user_global_ns, shell.user_ns)  # noqa: S307 - as above
    quiet = getattr(shell.displayhook, "semicolon_at_end_of_expression", None)
    if quiet is not None and quiet(body):
        return None
    return value
