"""What one panel shows and how often it may send: :class:`PanelOptions`, its defaults and its parsers.

The options are spelled once, here: :func:`make_options`' keyword arguments are ``Panel(...)``'s and
``%gpumem monitor``'s (each option there is its ``--`` form). The parsers raise ``ValueError`` with one line
that says what is accepted; the device and the threshold use the grammar of every command
(:func:`gpumem.core.readers.devices.parse_devices`, :func:`gpumem.core.units.parse_amount`).
"""

from __future__ import annotations

import math
import re
import warnings
from typing import NamedTuple

from gpumem.core.readers.devices import parse_devices
from gpumem.core.units import Amount, parse_amount

__all__ = [
    "COMPACT_FIGURE_HEIGHT_PX",
    "COMPACT_FIGURE_MIN_WIDTH_PX",
    "COMPACT_PLOT_HEIGHT_PX",
    "COMPACT_PLOT_WIDTH_PX",
    "DEFAULT_BUDGET_BYTES_PER_S",
    "DEFAULT_POINTS_PER_LINE",
    "DEFAULT_REFRESH_HZ",
    "DEFAULT_THRESHOLD",
    "DEFAULT_WINDOW_S",
    "INLINE_FIGURE_HEIGHT_PX",
    "INLINE_FIGURE_MIN_WIDTH_PX",
    "INLINE_PLOT_HEIGHT_PX",
    "INLINE_PLOT_WIDTH_PX",
    "MAX_POINTS_PER_LINE",
    "MAX_REFRESH_HZ",
    "MIN_POINTS_PER_LINE",
    "MIN_REFRESH_HZ",
    "PLOT_MARGIN_BOTTOM_PX",
    "PLOT_MARGIN_LEFT_PX",
    "PLOT_MARGIN_RIGHT_PX",
    "PLOT_MARGIN_TOP_PX",
    "WINDOW_PRESETS",
    "PanelOptions",
    "is_bare_number",
    "make_options",
    "parse_refresh",
    "parse_threshold",
    "parse_window",
    "window_label",
]

# The panel's four time windows; None means everything the timeline still holds.
WINDOW_PRESETS: tuple[tuple[str, float | None], ...] = (
    ("1 min", 60.0),
    ("10 min", 600.0),
    ("1 h", 3600.0),
    ("all", None),
)
DEFAULT_WINDOW_S = 600.0
MIN_WINDOW_S = 5.0
DEFAULT_THRESHOLD = Amount(fraction=0.9)
# Curves and header are pushed at most this often, and never faster than the panel's samples come (once a
# second for the default 10 minutes, twice for 1 minute); bqplot re-sends and redraws whole lines each time.
DEFAULT_REFRESH_HZ = 2.0
MIN_REFRESH_HZ = 0.2
MAX_REFRESH_HZ = 10.0
OLD_REFRESH_NAME = "gpumem: Panel(rate_hz=...) still works but is an old spelling; write Panel(refresh_hz=...)"
# A line is drawn across ~1000 px: min/max pairs at one per pixel keep every peak visible. The default
# 10-minute window is at most 1202 points, sent as read with no decimation to do: 601 samples at 1 Hz, 1201
# at 2 Hz, or, sampled faster, 601 one-second buckets of two points each (the first straddles the window's start).
DEFAULT_POINTS_PER_LINE = 1250
MIN_POINTS_PER_LINE = 4
MAX_POINTS_PER_LINE = 2000
# Curve data budget; with the header (sent only when its text changes) the panel stays under 50 KB/s.
DEFAULT_BUDGET_BYTES_PER_S = 36_000
# The figure's CSS min-width (inline: a narrow notebook; compact: a 250 px sidebar) less its left and
# right margins: the plot is never drawn narrower. Cell-marker labels are spaced for that width, so
# they cannot overlap on the wider plot the page really draws.
PLOT_MARGIN_LEFT_PX = 56
PLOT_MARGIN_RIGHT_PX = 30
INLINE_FIGURE_MIN_WIDTH_PX = 480
COMPACT_FIGURE_MIN_WIDTH_PX = 200
INLINE_PLOT_WIDTH_PX = INLINE_FIGURE_MIN_WIDTH_PX - PLOT_MARGIN_LEFT_PX - PLOT_MARGIN_RIGHT_PX
COMPACT_PLOT_WIDTH_PX = COMPACT_FIGURE_MIN_WIDTH_PX - PLOT_MARGIN_LEFT_PX - PLOT_MARGIN_RIGHT_PX
# The figure's height, and the plot's inside it (less the top and bottom margins): the band the marker
# labels take at the top of the plot is a fraction of it.
PLOT_MARGIN_TOP_PX = 10
PLOT_MARGIN_BOTTOM_PX = 26
INLINE_FIGURE_HEIGHT_PX = 250
COMPACT_FIGURE_HEIGHT_PX = 200
INLINE_PLOT_HEIGHT_PX = INLINE_FIGURE_HEIGHT_PX - PLOT_MARGIN_TOP_PX - PLOT_MARGIN_BOTTOM_PX
COMPACT_PLOT_HEIGHT_PX = COMPACT_FIGURE_HEIGHT_PX - PLOT_MARGIN_TOP_PX - PLOT_MARGIN_BOTTOM_PX


class PanelOptions(NamedTuple):
    """What one panel shows and how often it may send."""

    window_s: float | None = DEFAULT_WINDOW_S  # None: all history the timeline holds
    device: int | None = None  # None: every device
    threshold: Amount = DEFAULT_THRESHOLD  # the use (a size, or a share of capacity) at which the header turns red
    refresh_hz: float = DEFAULT_REFRESH_HZ  # the most updates a second sent to the browser
    show_host: bool = False
    full_scale: bool = False  # y axis up to the device capacity (the host's RAM when only the host is plotted)
    points_per_line: int = DEFAULT_POINTS_PER_LINE
    budget_bytes_per_s: int = DEFAULT_BUDGET_BYTES_PER_S
    plot_width_px: int = INLINE_PLOT_WIDTH_PX  # the narrowest width the plot is drawn at
    plot_height_px: int = INLINE_PLOT_HEIGHT_PX


def make_options(
    *,
    window: str | float | None = DEFAULT_WINDOW_S,
    device: str | int | None = None,
    threshold: str | float | Amount = DEFAULT_THRESHOLD,
    refresh_hz: str | float | None = None,
    host: bool = False,
    full_scale: bool = False,
    points_per_line: int = DEFAULT_POINTS_PER_LINE,
    rate_hz: str | float | None = None,
) -> PanelOptions:
    """``Panel(...)``'s keyword arguments, checked and parsed: ``window`` (``'10min'``, seconds, ``'all'``),
    ``device`` (``'cuda:1'``, ``1``, ``'all'``), ``threshold`` (``'80%'``, ``'70GiB'``, or a fraction such as 0.8),
    ``refresh_hz`` (the most updates a second sent to the browser, default 2), ``host`` (also plot host RSS),
    ``full_scale`` (y axis up to the capacity). ``rate_hz`` is ``refresh_hz``'s old name (a rate is the sampler's)."""
    if isinstance(points_per_line, bool) or not isinstance(points_per_line, int):
        raise TypeError(f"points_per_line must be a whole number between 4 and 2000, not {points_per_line!r}")
    if rate_hz is not None:
        if refresh_hz is not None:
            raise TypeError("rate_hz is the old name of refresh_hz: give one of them")
        warnings.warn(OLD_REFRESH_NAME, FutureWarning, stacklevel=3)  # Panel(...)'s caller
        refresh_hz = rate_hz
    options = PanelOptions(
        window_s=parse_window(window),
        device=parse_devices(device, default="all").one_cuda(),
        threshold=parse_threshold(threshold),
        refresh_hz=DEFAULT_REFRESH_HZ if refresh_hz is None else parse_refresh(refresh_hz),
        show_host=bool(host),
        full_scale=bool(full_scale),
        points_per_line=points_per_line,
    )
    if not MIN_POINTS_PER_LINE <= options.points_per_line <= MAX_POINTS_PER_LINE:
        raise ValueError(f"points_per_line must be between 4 and 2000, not {points_per_line!r}")
    return options


_DURATION = re.compile(
    r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|secs|second|seconds|m|min|mins|minute|minutes|h|hr|hour|hours)?\s*$"
)
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_window(value: str | float | None) -> float | None:
    """``'10min'``, ``'1 h'``, ``'90s'``, ``600`` (seconds) or ``'all'`` (None) -> seconds."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        if text in ("all", "everything"):
            return None
        match = _DURATION.match(text)
        if match is None:
            raise ValueError(f"window must be a duration such as 1min, 10min, 1h or all, not {value!r}")
        unit = (match.group(2) or "s")[0]
        seconds = float(match.group(1)) * _UNIT_S["h" if unit == "h" else unit]
    if not (math.isfinite(seconds) and seconds >= MIN_WINDOW_S):
        raise ValueError(f"window must be at least 5 seconds, not {value!r}")
    return seconds


def window_label(window_s: float | None) -> str:
    """The preset's name, or a short duration (``'5 min'``, ``'90 s'``, ``'2 h'``)."""
    for label, seconds in WINDOW_PRESETS:
        if seconds == window_s:
            return label
    assert window_s is not None
    if window_s % 3600 == 0:
        return f"{window_s / 3600:g} h"
    if window_s % 60 == 0:
        return f"{window_s / 60:g} min"
    return f"{window_s:g} s"


def parse_threshold(value: str | float | Amount) -> Amount:
    """``'80%'`` or ``'70GiB'`` (:func:`~gpumem.core.units.parse_amount`), or a fraction such as ``0.8`` -> the use
    at which the header turns red. Text that is a bare number keeps its old meaning: ``'0.9'`` and ``'90'`` are 90%."""
    if isinstance(value, Amount):
        amount = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        amount = Amount(fraction=float(value))
    elif is_bare_number(str(value)):
        number = float(value)
        amount = Amount(fraction=number / 100 if number > 1 else number)
    else:
        try:
            amount = parse_amount(str(value))
        except ValueError as error:
            raise ValueError(f"threshold: {error}") from None
    if amount.fraction is not None and not (math.isfinite(amount.fraction) and 0 < amount.fraction <= 1):
        raise ValueError(f"threshold must be between 0 and 100%, not {value!r}")
    if amount.nbytes is not None and amount.nbytes <= 0:
        raise ValueError(f"threshold must be a positive size such as 70GiB, not {value!r}")
    return amount


_BARE_NUMBER = re.compile(r"\s*[0-9]*\.?[0-9]+\s*", re.ASCII)


def is_bare_number(text: str) -> bool:
    """A number with neither unit nor ``%``: the panel's threshold as it was once written (``0.9``, ``90``)."""
    return _BARE_NUMBER.fullmatch(text) is not None


def parse_refresh(value: str | float) -> float:
    """The most updates a second sent to the browser, between 0.2 and 10."""
    try:
        refresh = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"refresh must be a number of updates per second, not {value!r}") from None
    if not (math.isfinite(refresh) and MIN_REFRESH_HZ <= refresh <= MAX_REFRESH_HZ):
        raise ValueError(
            f"refresh must be between {MIN_REFRESH_HZ:g} and {MAX_REFRESH_HZ:g} updates per second, not {value!r}"
        )
    return refresh
