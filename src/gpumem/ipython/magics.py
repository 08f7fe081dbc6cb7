"""``%gpumem`` and ``%%gpumem``: one Magics object, built at load with the state and hooks it acts on.

``%gpumem <subcommand>`` runs one function ``magic_<name>(subject, line)``: auto, history and status
(:mod:`gpumem.ipython.session_magics`), summary, export and load
(:mod:`gpumem.ipython.session_file_magics`) act on the loaded
:class:`~gpumem.ipython.state.ExtensionState`; who and free (:mod:`gpumem.ipython.memory_magics`)
and monitor and sidebar (:mod:`gpumem.ipython.panel_magics`, imported when first used: the panel
needs numpy and the widgets) act on the shell. Each parses its options, calls the core and shows
the answer; its docstring is its help. How a ``%%gpumem`` cell runs is in
:mod:`gpumem.ipython.cell_magic`.
"""

from __future__ import annotations

import inspect
import itertools
import sys
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from IPython.core.magic import Magics

from gpumem.ipython import predict_cell
from gpumem.ipython.arguments import UsageError, did_you_mean, line_cell_magic, magics_class
from gpumem.ipython.cell_magic import HeaderTransformer, cell_usage, run_body
from gpumem.ipython.hooks import CellHooks
from gpumem.ipython.memory_magics import magic_free, magic_who
from gpumem.ipython.session_file_magics import magic_export, magic_load, magic_summary
from gpumem.ipython.session_magics import magic_auto, magic_history, magic_status
from gpumem.ipython.state import ExtensionState

__all__ = ["SUBCOMMANDS", "GpuMemMagics", "full_help", "subcommand_help"]

_F = TypeVar("_F", bound=Callable[..., Any])

SUBCOMMANDS = ("monitor", "sidebar", "auto", "history", "status", "summary", "export", "load", "who", "free")

# These act on the loaded extension's state; the others on the shell.
_STATE_SUBCOMMANDS: dict[str, Callable[[ExtensionState, str], None]] = {
    "auto": magic_auto,
    "history": magic_history,
    "status": magic_status,
    "summary": magic_summary,
    "export": magic_export,
    "load": magic_load,
}

_HELP_FLAGS = frozenset({"-h", "--help"})
_HELP = _HELP_FLAGS | {"help"}


def _help_from(gather: Callable[[], str]) -> Callable[[_F], _F]:
    """``%name?`` shows ``obj.getdoc()`` when there is one (IPython's oinspect): gather the help when asked."""

    def mark(func: _F) -> _F:
        func.getdoc = gather  # type: ignore[attr-defined]
        return func

    return mark


def _shell_subcommand(name: str) -> Callable[[Any, str], None]:
    """who and free; monitor and sidebar, imported only now (the panel code needs numpy and the widgets)."""
    if name == "who":
        return magic_who
    if name == "free":
        return magic_free
    feature = {"monitor": "the live memory panel", "sidebar": "the panel in the right sidebar"}[name]
    try:
        from gpumem.ipython import panel_magics
    except ImportError as error:
        raise UsageError(
            f"{feature} is unavailable: gpumem.ipython.panel_magics could not be imported ({error})"
        ) from None
    return panel_magics.magic_monitor if name == "monitor" else panel_magics.magic_sidebar


def _documented(name: str) -> Callable[..., Any]:
    return _STATE_SUBCOMMANDS[name] if name in _STATE_SUBCOMMANDS else _shell_subcommand(name)


# Help -------------------------------------------------------------------------------------------

_INTRO = """\
GPU memory tools for PyTorch: where did my GPU memory go?

%gpumem [SUBCOMMAND] [options]     (no subcommand: the live panel, like %gpumem monitor)
%%gpumem [options]                 measure the cell below it (see the options further down)

Subcommands: {names}.
Each is described below (%gpumem SUBCOMMAND -h shows one); bad options give a one-line error.
"""


def subcommand_help(name: str) -> str:
    """One subcommand's help: what it does and its options."""
    try:
        text = _documented(name).__doc__ or "(no description)"
    except UsageError as error:
        text = str(error)
    return f"%gpumem {name}\n" + "-" * (8 + len(name)) + "\n" + _plain(text)


def _plain(docstring: str) -> str:
    """A magic's docstring without the reStructuredText ``::`` that IPython's magic_arguments puts
    above the usage line (it is shown as text, not rendered)."""
    lines = inspect.cleandoc(docstring).splitlines()
    if lines and lines[0].strip() == "::":
        lines = lines[2:] if len(lines) > 1 and not lines[1].strip() else lines[1:]
    return inspect.cleandoc("\n".join(_aligned_usage(lines)))


_HELP_WIDTH = 100  # the width of the descriptions under each usage line


def _aligned_usage(lines: list[str]) -> list[str]:
    """argparse wraps the usage line narrow and indents it under ``usage: %gpumem NAME``; IPython drops
    ``usage: ``. Refill it to the width of the text below, continuation lines under the first option."""
    usage = lines[0].strip() if lines else ""
    if not usage.startswith("%"):
        return lines
    name = " ".join(itertools.takewhile(lambda word: not word.startswith(("[", "-")), usage.split(" ")))
    pieces = [usage]
    rest = 1
    while rest < len(lines) and lines[rest].startswith(" ") and lines[rest].strip():
        pieces.append(lines[rest].strip())
        rest += 1
    filled = [pieces[0]]
    for piece in pieces[1:]:
        if len(filled[-1]) + 1 + len(piece) <= _HELP_WIDTH:
            filled[-1] += " " + piece
        else:
            filled.append(" " * (len(name) + 1) + piece)
    return filled + lines[rest:]


def full_help() -> str:
    """Every subcommand's help and every ``%%gpumem`` option (``%gpumem?``, ``%gpumem help``)."""
    parts = [_INTRO.format(names=", ".join(SUBCOMMANDS))]
    parts.extend(subcommand_help(name) for name in SUBCOMMANDS)
    parts.append("%%gpumem\n--------\n" + _plain(cell_usage.__doc__ or ""))
    return "\n\n".join(part.strip("\n") for part in parts) + "\n"


@magics_class
class GpuMemMagics(Magics):
    """The ``%gpumem`` line magic and the ``%%gpumem`` cell magic of one loaded extension."""

    def __init__(self, shell: Any, state: ExtensionState, hooks: CellHooks, header: HeaderTransformer) -> None:
        super().__init__(shell)
        self.state = state
        self.hooks = hooks
        self.header = header

    @line_cell_magic
    @_help_from(full_help)
    def gpumem(self, line: str, cell: str | None = None) -> Any:
        """GPU memory tools for PyTorch (``%gpumem?`` lists every subcommand and option)."""
        if cell is not None:
            try:
                return self._measure_cell(line, cell)
            except UsageError as error:
                raise _named(error, "%%gpumem") from None
        name, rest = [*line.split(None, 1), "", ""][:2]
        if name == "_cell":  # a %%gpumem header line, rewritten by HeaderTransformer
            self.header.show_header_in_tracebacks(sys._getframe(1))  # noqa: SLF001 - the cell is up the stack
            self.hooks.cell_header_reached(self.header.parse(rest))
            return None
        if name in _HELP:
            print(full_help())
            return None
        name = name or "monitor"
        if name not in SUBCOMMANDS:
            hint = did_you_mean(name, SUBCOMMANDS)
            raise UsageError(
                f"%gpumem: unknown subcommand {name!r}{f' ({hint})' if hint else ''}; "
                f"use one of: {', '.join(sorted(SUBCOMMANDS))} (%gpumem?)"
            )
        if _HELP_FLAGS.intersection(rest.split()):
            print(subcommand_help(name))
            return None
        try:
            self._subcommand(name)(rest.strip())
        except UsageError as error:
            raise _named(error, f"%gpumem {name}") from None
        return None

    def _measure_cell(self, line: str, body: str) -> Any:
        """``%%gpumem`` called as a function (under ``%%time``, or ``run_cell_magic``): run the body, measured."""
        request = self.header.parse(line)
        if request.predict is not None:
            predict_cell.show(self.shell, request.predict, body)
            return None
        return self.hooks.measure_body(request, body, partial(run_body, self.shell, body))

    def _subcommand(self, name: str) -> Callable[[str], None]:
        """``%gpumem NAME``'s function, given what it acts on."""
        if name == "export":  # also the reports shown under cells, which the hooks keep
            return partial(magic_export, self.state, reports=tuple(self.hooks.reports))
        if name in _STATE_SUBCOMMANDS:
            return partial(_STATE_SUBCOMMANDS[name], self.state)
        return partial(_shell_subcommand(name), self.shell)


def _named(error: UsageError, command: str) -> UsageError:
    """The same message, starting with the command it is about (other modules may have named it already)."""
    message = str(error)
    if message.startswith(("%gpumem", "%%gpumem")):
        return error
    return UsageError(f"{command}: {message}")
