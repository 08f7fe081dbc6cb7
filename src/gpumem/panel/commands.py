"""What other threads ask a panel's writer to do: one small typed message per command.

Button clicks, option changes and view counts arrive on the kernel's comm thread (which runs while a
cell executes), Free's outcome on its worker thread. Those threads only queue one of these and wake
the writer, which applies each with its own handler; no other thread touches widget state.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from gpumem.panel.freeing import FreeOutcome

__all__ = [
    "AskConfirm",
    "Command",
    "FreeDone",
    "FreeStarted",
    "HoldersDone",
    "Notify",
    "ReadControls",
    "ReclaimDone",
    "ReclaimStarted",
    "Refresh",
    "ResetPeak",
    "ShowCell",
    "TogglePause",
    "ViewsChanged",
]


@dataclass(frozen=True)
class Refresh:
    """Push current figures now, shown or not; ``done`` is set once they are pushed."""

    done: threading.Event


@dataclass(frozen=True)
class FreeStarted:
    """Free's worker is starting: the button says so until :class:`FreeDone`."""

    deep: bool


@dataclass(frozen=True)
class FreeDone:
    """Free's worker finished: show what it gave back."""

    outcome: FreeOutcome


@dataclass(frozen=True)
class HoldersDone:
    """The holders view's worker finished: show its model (a :class:`gpumem.panel.holders_view.HoldersModel`)."""

    model: Any


@dataclass(frozen=True)
class AskConfirm:
    """Show the unbind confirmation: what the name's deletion returns and what else holds its storage."""

    text: str


@dataclass(frozen=True)
class ReclaimStarted:
    """A reclaim action's worker is starting: its buttons wait until :class:`ReclaimDone`."""

    label: str


@dataclass(frozen=True)
class ReclaimDone:
    """A reclaim action finished: show its measured outcome (a :class:`gpumem.core.reclaim.Outcome`)."""

    outcome: Any


@dataclass(frozen=True)
class Notify:
    """A line under the controls: ``ok`` True is green, False red, None plain."""

    text: str
    ok: bool | None


@dataclass(frozen=True)
class ShowCell:
    """A measured cell was picked in the compact history: show its report."""

    serial: Any


@dataclass(frozen=True)
class TogglePause:
    """Freeze the panel (sampling goes on), or resume and catch up."""


@dataclass(frozen=True)
class ResetPeak:
    """Restart "peak since open" from the newest snapshot."""


@dataclass(frozen=True)
class ReadControls:
    """The window, device, host or full-scale control changed: read them into the options."""


@dataclass(frozen=True)
class ViewsChanged:
    """The front end reported a view more or fewer: push everything again."""


Command = (
    Refresh
    | FreeStarted
    | FreeDone
    | HoldersDone
    | AskConfirm
    | ReclaimStarted
    | ReclaimDone
    | Notify
    | TogglePause
    | ResetPeak
    | ShowCell
    | ReadControls
    | ViewsChanged
)
