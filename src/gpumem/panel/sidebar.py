"""The panels that are open, closing them all, and the one panel docked in the sidebar.

Importing this module is cheap; ipywidgets and bqplot are loaded when the first panel is made.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, cast

from gpumem.panel import writer as registry

if TYPE_CHECKING:
    from gpumem.panel.widget import Panel

__all__ = ["close_all", "open_panels", "sidebar_panel"]

_sidebar_lock = threading.Lock()
_sidebar: Panel | None = None


def open_panels() -> list[Panel]:
    """The panels not closed yet, oldest first."""
    return cast("list[Panel]", registry.open_panels())


def close_all() -> None:
    """Close every panel: their widgets, the writer thread, and the sampler if a panel started it."""
    global _sidebar
    registry.close_all()
    with _sidebar_lock:
        _sidebar = None


def sidebar_panel(**options: Any) -> Panel:
    """The panel docked in the sidebar: the open one, or a new one with ``options``."""
    global _sidebar
    from gpumem.panel.widget import Panel

    with _sidebar_lock:
        if _sidebar is not None and not _sidebar.closed and not options:
            return _sidebar
        previous, _sidebar = _sidebar, Panel(compact=True, **options)
        panel = _sidebar
    if previous is not None and not previous.closed:
        previous.close()
    return panel
