"""What every magic and hook shares: IPython's magic markers and ``magic_arguments``, typed; option
values checked into one-line ``UsageError``s, one parser per kind of value (a size, an amount such as a
threshold, devices, a path), each naming what it accepts; the note, once per kernel, for an old spelling;
the display helper; the one-line complaint.

IPython's decorators are untyped (or typed loosely); wrapping them here keeps ``mypy --strict``
meaningful everywhere else. Nothing here imports more than IPython's magic machinery.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar, cast

from IPython.core import magic as _magic
from IPython.core import magic_arguments as _magic_arguments
from IPython.core.error import UsageError

from gpumem.core import units
from gpumem.core.readers.devices import DEVICE_GRAMMAR, DeviceSelection, describe_devices, parse_devices
from gpumem.core.readers.sources import MemorySource
from gpumem.core.units import AMOUNT_GRAMMAR, Amount

__all__ = [
    "DEVICE_HELP",
    "THRESHOLD_HELP",
    "UsageError",
    "argument",
    "check_devices_exist",
    "complain",
    "deprecated",
    "did_you_mean",
    "display",
    "line_cell_magic",
    "magic_arguments",
    "magics_class",
    "parse_amount",
    "parse_argstring",
    "parse_cuda_devices",
    "parse_device_option",
    "parse_path",
    "parse_size",
    "split_arguments",
]

DEVICE_HELP = DEVICE_GRAMMAR  # every --device reads the same
THRESHOLD_HELP = AMOUNT_GRAMMAR.replace("%", "%%")  # every --threshold reads the same (argparse's help writes % as %%)

_F = TypeVar("_F", bound=Callable[..., Any])
_C = TypeVar("_C", bound=type)
_untyped_arguments: Any = _magic_arguments


# IPython's decorators ---------------------------------------------------------------------------


def magics_class(cls: _C) -> _C:
    """IPython's ``@magics_class``: records the marked methods of a Magics subclass."""
    return _magic.magics_class(cls)


def line_cell_magic(func: _F) -> _F:
    """IPython's ``@line_cell_magic`` method marker (``%name`` and ``%%name``), typed."""
    return cast("_F", _magic.line_cell_magic(func))


def magic_arguments(name: str) -> Callable[[_F], _F]:
    """IPython's ``@magic_arguments``: the options below it become ``func.parser`` and its help."""
    decorator: Callable[[_F], _F] = _untyped_arguments.magic_arguments(name)
    return decorator


def argument(*args: Any, **kwargs: Any) -> Callable[[_F], _F]:
    """IPython's ``@argument`` (``argparse.add_argument``'s parameters)."""
    decorator: Callable[[_F], _F] = _untyped_arguments.argument(*args, **kwargs)
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
    if len(token) > 1 and token[0] == token[-1] and token[0] in "'\"":
        return token[1:-1]
    return token


def parse_argstring(magic: Callable[..., Any], line: str) -> Any:
    """Parse ``line`` with the parser ``@magic_arguments`` built on ``magic`` (bad input: UsageError,
    with "did you mean --last?" when an unknown option is close to one of the magic's)."""
    parser = magic.parser  # type: ignore[attr-defined]
    tokens = split_arguments(_SPLIT_SIZE.sub(r"\1\2", line))
    try:
        return parser.parse_args(tokens)
    except UsageError as error:
        known = _OPTION.findall(parser.format_usage())
        hints = [did_you_mean(token.split("=", 1)[0], known) for token in tokens if token.startswith("-")]
        hint = next((hint for hint in hints if hint), "")
        if not hint or "unrecognized arguments" not in str(error):
            raise
        raise UsageError(f"{error}; {hint}") from None


_OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
# A size written as two words after an option that takes one ("--threshold 64 MiB") is one size.
_SPLIT_SIZE = re.compile(r"(--(?:threshold|capacity)(?:=|\s+)[0-9.eE]+)\s+([kKmMgGtT]i?[bB]?|[bB])(?=\s|$)")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"did you mean history?"`` when ``word`` is a likely typo of one of ``choices`` (else ``""``)."""
    choices = list(dict.fromkeys(choices))
    if word in choices:
        return ""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else ""


# Option values ----------------------------------------------------------------------------------


def parse_size(text: str, option: str = "") -> int:
    """A memory size such as ``64MiB`` (see :func:`gpumem.core.units.parse_size`); bad input is a UsageError."""
    try:
        return units.parse_size(text)
    except ValueError as error:
        raise UsageError(f"{option}: {error}" if option else str(error)) from None


def parse_amount(text: str, option: str = "--threshold") -> Amount:
    """A size or a share of capacity (``512MiB``, ``80%``: :func:`gpumem.core.units.parse_amount`); else UsageError."""
    try:
        return units.parse_amount(text)
    except ValueError as error:
        raise UsageError(f"{option}: {error}") from None


_told: set[str] = set()


def deprecated(old: str, new: str) -> None:
    """One line, once per kernel, under the cell that uses an old spelling: what it is now written as."""
    if old in _told:
        return
    _told.add(old)
    print(f"gpumem: {old} still works but is an old spelling; write {new} (said once)", file=sys.stderr)


def parse_path(option: str, text: str | None) -> Path | None:
    """The file path given to ``option`` (None: not given), ``~`` expanded; a path no file can have is a UsageError.

    Checked here because the file system's own refusals are not ``OSError``s: a NUL character is a
    ValueError, an unknown ``~user`` a RuntimeError, a lone surrogate a UnicodeEncodeError.
    """
    if text is None:
        return None
    if not text.strip():
        raise UsageError(f"{option} expects a file path, not {text!r}")
    if "\0" in text:
        raise UsageError(f"{option} {text!r}: a path cannot contain a NUL character")
    try:
        path = Path(text).expanduser()
    except RuntimeError:  # "~user" naming no user, or "~" without a home directory
        home = text.split("/", 1)[0]
        raise UsageError(f"{option} {text!r}: cannot find the home directory of {home!r}") from None
    try:
        os.fsencode(path)
    except UnicodeError:
        raise UsageError(f"{option} {text!r}: the file system cannot store this name") from None
    return path


def parse_device_option(text: str | None, default: str = "cuda") -> DeviceSelection:
    """Any command's ``--device`` (:func:`gpumem.core.readers.devices.parse_devices`); a bad name is a UsageError."""
    try:
        return parse_devices(text, default=default)
    except ValueError as error:
        raise UsageError(f"--device: {error}") from None


def parse_cuda_devices(text: str | None, source: MemorySource) -> tuple[int, ...] | None:
    """``--device`` of a command that reports CUDA devices: their indices, checked against ``source`` (None:
    every device in use); ``cpu`` and a bad name are UsageErrors."""
    try:
        devices = parse_device_option(text).cuda_indices()
    except ValueError as error:
        raise UsageError(f"--device: {error}") from None
    if devices:
        check_devices_exist(devices, source)
    return devices


def check_devices_exist(devices: tuple[int, ...], source: MemorySource) -> None:
    """Refuse indices past the devices this process has: known from ``source`` once CUDA is initialized,
    before that from its ``device_count()`` (torch's or NVML's count, which creates no CUDA context)."""
    try:
        visible = tuple(source.cuda_devices())
        count_of = getattr(source, "device_count", None)
        count = count_of() if not visible and callable(count_of) else None
    except Exception:
        return
    if not visible and isinstance(count, int) and not isinstance(count, bool):
        visible = tuple(range(count))
        if not visible:
            listed = ", ".join(f"cuda:{device}" for device in devices)
            raise UsageError(f"--device {listed}: no CUDA device here ({_why_no_device(source)})")
    missing = [device for device in devices if device not in visible]
    if visible and missing:
        listed = ", ".join(f"cuda:{device}" for device in missing)
        raise UsageError(f"--device {listed}: no such device; this process sees {describe_devices(visible)}")


def _why_no_device(source: MemorySource) -> str:
    """The readers' own reasons (torch's case, NVML's), e.g. 'this torch (2.13.0+cpu) is a CPU-only build'."""
    try:
        status = source.status()
    except Exception:
        status = {}
    reasons = [status[key].removeprefix("unavailable: ") for key in ("torch", "nvml") if status.get(key, "ok") != "ok"]
    return "; ".join(reasons) or "none is visible to this process"


# Showing ----------------------------------------------------------------------------------------


def display(obj: object = None, *, text: str | None = None, html: str | None = None) -> None:
    """Show ``obj`` with IPython's display (its rich repr: HTML in notebooks, text in terminals), or,
    given ``text`` (and ``html``), exactly those as they are."""
    from IPython.display import display as ipython_display

    if text is None:
        ipython_display(obj)  # type: ignore[no-untyped-call]
        return
    bundle = {"text/plain": text} if html is None else {"text/plain": text, "text/html": html}
    ipython_display(bundle, raw=True)  # type: ignore[no-untyped-call]


def complain(what: str, error: BaseException) -> None:
    """One line on stderr for a failure in gpumem's own work, never a traceback over the user's cell."""
    detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    print(f"gpumem: {what}: {detail}", file=sys.stderr)
