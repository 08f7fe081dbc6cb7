"""Whether a view of a panel is shown, counted per page so that a page that went away stops counting.

ipywidgets' ``_view_count`` is one number that every page moves by one (a view shown: +1, removed:
-1; the kernel echoes each change to the other pages). A page that goes away (reloaded, tab closed,
browser gone) never takes its views back, and a reloaded page starts from the stale total: after one
reload of a page that showed the panel once the kernel read 2 with one view shown (JupyterLab 4.6),
and clearing that view left 1, so the panel kept sending with no view anywhere.

So each change is put down to the page that sent it (the session id of the kernel connection, in the
message header), and the pages the gpumem front-end extension no longer hears from (their status comm
closed or fell silent, :func:`gpumem.panel.frontend.pages_gone`) are not counted. Without the
extension no page is ever known gone and the count is ipywidgets' own.
"""

from __future__ import annotations

import threading
from typing import Any

from gpumem.panel.frontend import pages_gone

__all__ = ["UNREPORTED_VIEW_GRACE_S", "ViewCount", "sending_page"]

# A view that was just displayed but has not reported itself yet (older front ends report only
# once the running cell ends) is treated as shown for this long.
UNREPORTED_VIEW_GRACE_S = 15.0


class ViewCount:
    """The views of one panel, per page; changed on the thread that handles the front end's messages,
    read on the writer thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_page: dict[str, int] = {}
        self.displayed_at: float | None = None
        self.reported = False

    def changed(self, page: str, old: int, new: int) -> None:
        """``page`` moved ``_view_count`` from ``old`` to ``new`` (``page`` "" when not known)."""
        with self._lock:
            self.reported = True
            self._by_page[page] = self._by_page.get(page, 0) + new - old

    def shown(self) -> int:
        """Views shown by the pages still there."""
        with self._lock:
            counts = list(self._by_page.items())
        gone = pages_gone(page for page, _ in counts)
        return sum(max(0, count) for page, count in counts if page not in gone)

    def visible(self, now: float, shown: int | None = None) -> bool:
        """Whether a view is shown; ``shown`` is :meth:`shown` when the caller has just asked it."""
        if (self.shown() if shown is None else shown) > 0:
            return True
        shown_at = self.displayed_at
        return not self.reported and shown_at is not None and now - shown_at < UNREPORTED_VIEW_GRACE_S


def sending_page(comm: Any) -> str:
    """The session id of the front-end connection whose message is being handled, "" when unknown.

    Called from a comm message handler: ipykernel has set that message as the current parent."""
    kernel = getattr(comm, "kernel", None)
    if kernel is None:
        return ""
    try:
        header = kernel.get_parent().get("header") or {}
    except Exception:
        return ""
    session = header.get("session")
    return session if isinstance(session, str) else ""
