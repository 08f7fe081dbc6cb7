"""Human-readable byte counts, binary units, with an explicit sign for deltas."""

from __future__ import annotations

__all__ = ["format_bytes", "format_delta"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(nbytes: float, precision: int = 1) -> str:
    """``1536 -> '1.5 KiB'``; exact for small counts (``'512 B'``)."""
    value = float(nbytes)
    if value != value:
        return "n/a"
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.{precision}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_delta(nbytes: float, precision: int = 1) -> str:
    """Like :func:`format_bytes` but always signed: ``'+1.0 GiB'``, ``'-2 B'``, ``'±0 B'``."""
    if nbytes == 0:
        return "±0 B"
    text = format_bytes(nbytes, precision)
    return text if text.startswith("-") else "+" + text
