"""What other threads ask a panel's writer to do: one small typed message per command.

Button clicks, option changes and view counts arrive on the kernel's comm thread (which runs while a
cell executes), Free's outcome on its worker thread. Those threads only queue one of these and wake
the writer, which applies each with its own handler; no other thread touches widget state.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from gpumem.panel.freeing import FreeOutcome

__all__ = [
    "Command",
    "FreeDone",
    "FreeStarted",
    "Notify",
    "ReadControls",
    "Refresh",
    "ResetPeak",
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
class Notify:
    """A line under the controls: ``ok`` True is green, False red, None plain."""

    text: str
    ok: bool | None


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


Command = Refresh | FreeStarted | FreeDone | Notify | TogglePause | ResetPeak | ReadControls | ViewsChanged
