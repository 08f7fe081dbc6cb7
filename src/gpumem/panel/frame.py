"""Former home of the panel's models, kept so that older imports keep working.

The models now live by concept: :mod:`gpumem.panel.options`, :mod:`gpumem.panel.header`,
:mod:`gpumem.panel.curves` and :mod:`gpumem.panel.readings`. Import from those.
"""

from __future__ import annotations

from gpumem.core.devices import parse_cuda_device as parse_device
from gpumem.panel.curves import (
    CAPACITY_COLOR,
    MARK_COLOR,
    Curve,
    CurveFrame,
    build_curve_frame,
    choose_curves,
    curve_interval_s,
    nice_axis,
    render_legend,
)
from gpumem.panel.header import DeviceFigures, HeaderModel, HostFigures, build_header, render_header
from gpumem.panel.options import (
    DEFAULT_BUDGET_BYTES_PER_S,
    DEFAULT_POINTS_PER_LINE,
    DEFAULT_RATE_HZ,
    DEFAULT_THRESHOLD,
    DEFAULT_WINDOW_S,
    MAX_POINTS_PER_LINE,
    WINDOW_PRESETS,
    PanelOptions,
    parse_rate,
    parse_threshold,
    parse_window,
    window_label,
)
from gpumem.panel.readings import PeakTracker

__all__ = [
    "CAPACITY_COLOR",
    "DEFAULT_BUDGET_BYTES_PER_S",
    "DEFAULT_POINTS_PER_LINE",
    "DEFAULT_RATE_HZ",
    "DEFAULT_THRESHOLD",
    "DEFAULT_WINDOW_S",
    "MARK_COLOR",
    "MAX_POINTS_PER_LINE",
    "WINDOW_PRESETS",
    "Curve",
    "CurveFrame",
    "DeviceFigures",
    "HeaderModel",
    "HostFigures",
    "PanelOptions",
    "PeakTracker",
    "build_curve_frame",
    "build_header",
    "choose_curves",
    "curve_interval_s",
    "nice_axis",
    "parse_device",
    "parse_rate",
    "parse_threshold",
    "parse_window",
    "render_header",
    "render_legend",
    "window_label",
]
