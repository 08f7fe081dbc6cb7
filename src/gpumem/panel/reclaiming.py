"""The panel's side of the holders view: its worker threads, its buttons' handlers, its writer-thread updates.

Clicks arrive on gpumem's subshell (also while a cell runs) and only start a worker or queue a command;
the walk and the actions run on short-lived worker threads (one walk and one action at a time); the
widgets are set on the panel's writer thread through the commands' handlers below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpumem.core.reclaim import UNBIND, Outcome, ShellReferences, perform
from gpumem.panel.commands import AskConfirm, Command, HoldersDone, Notify, ReclaimDone, ReclaimStarted
from gpumem.panel.freeing import FreeWorker
from gpumem.panel.holders_view import HoldersPane, compute_holders, unbind_question

__all__ = ["HoldersControl"]


class HoldersControl:
    """The holders pane of one panel and the threads that feed it."""

    def __init__(self, shell: Any, source: Callable[[], Any], post: Callable[[Command], None]) -> None:
        self.pane = HoldersPane()
        self.shell = shell
        self.held = ShellReferences(shell) if shell is not None else None
        self._source = source  # the monitor's source, read when used
        self._post = post
        self._walker = FreeWorker()
        self._actions = FreeWorker()
        self._cells_seen: object = None  # the execution count last walked after (None: walk once the cell ends)
        pane = self.pane
        pane.refresh_button.on_click(lambda _b: self.refresh())
        pane.more.observe(lambda _change: self._post(HoldersDone(pane.model)), names="value")
        for index, button in enumerate(pane.buttons):
            button.on_click(lambda _b, i=index: self.reclaim(pane.actions_for[i], wait=False))
        pane.unbind.on_click(lambda _b: self.ask_unbind(pane.names.value))
        pane.confirm.on_click(lambda _b: self.reclaim(f"{UNBIND}:{pane.names.value}", wait=False))
        pane.cancel.on_click(lambda _b: self._post(AskConfirm("")))

    def refresh(self, *, wait: bool = False, timeout_s: float = 60.0) -> None:
        """Walk the session again (holders, and what each action would return) on a worker thread."""
        thread, _ = self._walker.start(lambda _: self._walk(), False, announce=lambda: None)
        if wait:
            thread.join(timeout_s)

    def reclaim(self, action: str, *, wait: bool = True, timeout_s: float = 120.0) -> Outcome | None:
        """Run one reclaim action on a worker thread (as its button does); with ``wait``, its outcome."""
        if not action or self.held is None:
            return None
        thread, started = self._actions.start(
            lambda _: self._act(action), False, announce=lambda: self._post(ReclaimStarted(action))
        )
        if not started:
            self._post(Notify("An action is already running.", None))
        if not wait:
            return None
        thread.join(timeout_s)
        return self._actions.last  # type: ignore[return-value]

    def ask_unbind(self, name: Any) -> None:
        """Price unbinding ``name`` on a worker thread, then ask: the confirmation says what else holds it."""
        held = self.held
        if isinstance(name, str) and held is not None:
            self._walker.start(
                lambda _: self._post(AskConfirm(unbind_question(name, held, self._source()))), False, lambda: None
            )

    def after_cells(self, visible: bool) -> bool:
        """After a cell ended (the execution count moved, none runs), walk again if the panel is shown;
        True when it did."""
        count = getattr(self.shell, "execution_count", None)
        if count == self._cells_seen or self.held is None or self.held.cell_running() or not visible:
            return False
        self._cells_seen = count
        self.refresh()
        return True

    def join(self, timeout_s: float) -> None:
        self._actions.join(timeout_s)
        self._walker.join(timeout_s)

    # Worker threads ---------------------------------------------------------------------------------
    def _walk(self) -> None:
        self._post(HoldersDone(compute_holders(self.held, self.shell, self._source())))

    def _act(self, action: str) -> None:
        assert self.held is not None
        outcome = perform(action, self.held, self._source())
        self._actions.last = outcome  # type: ignore[assignment]
        self._post(ReclaimDone(outcome))
        self._walk()  # what holds memory now, and the actions' new figures

    # The writer thread (the panel's command handlers) ------------------------------------------------
    def on_command(self, command: Command) -> None:
        pane = self.pane
        if isinstance(command, HoldersDone):
            pane.show_model(command.model)
        elif isinstance(command, AskConfirm):
            pane.show_confirmation(command.text or None)
        elif isinstance(command, ReclaimStarted):
            pane.show_confirmation(None)
            pane.show_running(command.label)
        elif isinstance(command, ReclaimDone):
            pane.show_outcome(command.outcome)
