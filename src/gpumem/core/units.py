"""Byte counts: the unit constants, the one formatter (binary units, signed deltas), the size parser and the
parser of amounts (a size, or a share of a device's capacity such as ``80%``: every ``--threshold``)."""

from __future__ import annotations

import math
import re
from typing import NamedTuple

__all__ = [
    "AMOUNT_GRAMMAR",
    "GIB",
    "KIB",
    "MAX_SIZE_BYTES",
    "MIB",
    "SIZE_GRAMMAR",
    "Amount",
    "format_bytes",
    "format_delta",
    "format_duration",
    "parse_amount",
    "parse_size",
]

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
MAX_SIZE_BYTES = 1 << 60  # sizes past 1 EiB are typos (and past float range, overflow)
SIZE_GRAMMAR = "a size such as 64MiB, 1GiB or 500MB"
AMOUNT_GRAMMAR = "a size such as 512MiB or a share of the device's capacity such as 80%"
_PERCENT = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*%\s*", re.ASCII)
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kKmMgGtT]?)(i?)([bB]?)\s*", re.ASCII)

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(nbytes: float, precision: int = 1) -> str:
    """``1536 -> '1.5 KiB'``; exact for small counts (``'512 B'``)."""
    value = float(nbytes)
    if math.isnan(value):
        return "n/a"
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in _UNITS:
        if value < KIB or unit == _UNITS[-1]:
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.{precision}f} {unit}"
        value /= KIB
    raise AssertionError("unreachable")


def format_delta(nbytes: float, precision: int = 1) -> str:
    """Like :func:`format_bytes` but always signed: ``'+1.0 GiB'``, ``'-2 B'``, ``'±0 B'``."""
    if nbytes == 0:
        return "±0 B"
    text = format_bytes(nbytes, precision)
    return text if text.startswith("-") else "+" + text


def parse_size(text: str) -> int:
    """``'64MiB'``, ``'1 GiB'``, ``'500MB'``, ``'1e9'`` -> bytes. K/M/G/T and KiB... are binary, KB... decimal."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"expected {SIZE_GRAMMAR}, not {text!r}")
    number, prefix, binary, unit = match.groups()
    power = " KMGT".index(prefix.upper()) if prefix else 0
    decimal = bool(prefix) and not binary and bool(unit)
    size = float(number) * (1000 if decimal else 1024) ** power
    if not size < MAX_SIZE_BYTES:
        raise ValueError(f"{text.strip()!r} is too large for a memory size (at most 1 EiB)")
    return int(size)


class Amount(NamedTuple):
    """An amount of memory: ``nbytes``, or ``fraction`` of a device's capacity (exactly one is set)."""

    nbytes: int | None = None
    fraction: float | None = None

    def of(self, capacity_bytes: float | None) -> float | None:
        """In bytes, on a device of ``capacity_bytes`` (None: a share of an unknown capacity)."""
        if self.fraction is None:
            return self.nbytes
        return None if capacity_bytes is None else self.fraction * capacity_bytes

    def share_of(self, capacity_bytes: float | None) -> float | None:
        """As a fraction of ``capacity_bytes`` (None: a size on a device of unknown capacity)."""
        if self.fraction is not None:
            return self.fraction
        return None if not capacity_bytes or self.nbytes is None else self.nbytes / capacity_bytes

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{100 * self.fraction:g}%"
        return format_bytes(self.nbytes or 0)


def parse_amount(text: str) -> Amount:
    """``'512MiB'`` -> that many bytes (:func:`parse_size`), ``'80%'`` -> 0.8 of the capacity (0% to 100%)."""
    match = _PERCENT.fullmatch(text)
    if match is not None:
        percent = float(match.group(1))
        if not percent <= 100:  # noqa: PLR2004 - a percentage
            raise ValueError(f"a share of capacity is between 0 and 100%, not {text.strip()!r}")
        return Amount(fraction=percent / 100)
    try:
        return Amount(nbytes=parse_size(text))
    except ValueError:
        if _SIZE.fullmatch(text) is not None:  # a size, too large
            raise
        raise ValueError(f"expected {AMOUNT_GRAMMAR}, not {text!r}") from None


_TENTHS_BELOW_S = 0.1  # shorter durations keep a tenth of a millisecond
_PER_UNIT = 60  # seconds in a minute, minutes in an hour


def format_duration(seconds: float) -> str:
    """``0.0004 -> '0.4 ms'``, ``1.234 -> '1.23 s'``, ``125 -> '2 min 5 s'``."""
    if seconds < 1:
        return f"{seconds * 1000:.1f} ms" if seconds < _TENTHS_BELOW_S else f"{seconds * 1000:.0f} ms"
    if seconds < _PER_UNIT:
        return f"{seconds:.2f} s"
    minutes, rest = divmod(round(seconds), _PER_UNIT)
    if minutes < _PER_UNIT:
        return f"{minutes} min {rest} s"
    hours, minutes = divmod(minutes, _PER_UNIT)
    return f"{hours} h {minutes} min"
