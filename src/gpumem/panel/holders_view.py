"""The panel's holders view: who holds the memory, by kind and by name, and the reclaim actions.

The model (:class:`HoldersModel`) is computed without widgets, on a worker thread, from the holder walk
(:func:`gpumem.core.holders.find_holders`) and each applicable action's promise
(:mod:`gpumem.core.reclaim`); :func:`render_holders` turns it into HTML; :class:`HoldersPane` holds the
widgets, whose traits only the panel's writer thread sets; :class:`HoldersControl` runs the walk and the
actions on worker threads, handles the pane's buttons and applies their results through the panel's commands.
The walk runs on demand (the Refresh button) and after a cell ends while the panel is shown: never on the
sampler's thread.
"""

from __future__ import annotations

import html
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import ipywidgets as widgets

from gpumem.core.cells.attribution import held_variables
from gpumem.core.cells.conditions import StandingCondition, standing_by_cell
from gpumem.core.holders import find_holders
from gpumem.core.reclaim import (
    EXCEPTION,
    OUTPUTS,
    UNBIND,
    HeldReferences,
    Outcome,
    ShellReferences,
    available_actions,
    perform,
    promise,
)
from gpumem.core.units import format_bytes
from gpumem.panel.cell_source import cell_records
from gpumem.panel.commands import AskConfirm, Command, HoldersDone, Notify, ReclaimDone, ReclaimStarted
from gpumem.panel.freeing import FreeWorker

__all__ = [
    "ACTION_SLOTS",
    "ConditionLine",
    "HoldersControl",
    "HoldersModel",
    "HoldersPane",
    "build_holders",
    "compute_holders",
    "condition_lines",
    "render_holders",
    "unbind_question",
]


ACTION_SLOTS = 6  # buttons made up front (every widget is routed to gpumem's subshell when the panel is built)
TOP_ROWS = 4  # holders shown before "more"
_KIND_COLORS = ("#2563eb", "#f59e0b", "#10b981", "#8b5cf6", "#ef4444", "#0ea5e9", "#6b7280", "#a3a3a3", "#d946ef")


class HolderLine(NamedTuple):
    name: str
    type_name: str
    nbytes: int
    shared_bytes: int


class ActionLine(NamedTuple):
    """One action's button: its id, its label with the promised bytes, and the promise in words."""

    action: str
    text: str
    tooltip: str


class ConditionLine(NamedTuple):
    """A condition that stands now, the cell that caused it, and what fixes it (an action's button text
    when one click does)."""

    text: str
    cell: str
    fix: str


class HoldersModel(NamedTuple):
    kinds: tuple[tuple[str, int], ...]
    rows: tuple[HolderLine, ...]
    actions: tuple[ActionLine, ...]
    names: tuple[str, ...]  # the names a user may unbind (those holding memory)
    device: str
    note: str = ""
    conditions: tuple[ConditionLine, ...] = ()  # shown under the cells


def compute_holders(held: HeldReferences | None, shell: Any, source: Any) -> HoldersModel:
    """Walk the session and price every applicable action (on a worker thread: it may take a second);
    a failure is the model's note."""
    try:
        return _compute(held, shell, source)
    except Exception as error:
        return HoldersModel((), (), (), (), "", f"the holders could not be walked: {type(error).__name__}: {error}")


def _compute(held: HeldReferences | None, shell: Any, source: Any) -> HoldersModel:
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    device = "cuda" if cuda is not None and cuda.is_initialized() else "all"
    namespace = getattr(shell, "user_ns", None)
    if held is None or not isinstance(namespace, dict):
        return HoldersModel((), (), (), (), device, "no IPython shell: nothing to walk")
    report = find_holders(namespace, device=device, shell=shell, time_budget_s=2.0)
    promises = [found for action in available_actions(held) if (found := _promise(action, held, source))]
    model = build_holders(report, promises, device)
    try:
        readings = source.snapshot().devices
    except Exception:
        readings = ()  # the devices cannot be read now: what the walk found still stands
    standing = standing_by_cell(held_variables(report), readings, cell_records())
    return model._replace(conditions=condition_lines(standing, model.actions))


_FIXED_BY = {"output-cache": OUTPUTS, "exception": EXCEPTION}  # the conditions one button fixes


def condition_lines(standing: list[StandingCondition], actions: tuple[ActionLine, ...]) -> tuple[ConditionLine, ...]:
    """Each condition with the button that fixes it (its label, bytes included), or the advice in words."""
    buttons = {line.action: line.text for line in actions}
    return tuple(
        ConditionLine(condition.text, condition.cell, buttons.get(_FIXED_BY.get(condition.kind, ""), condition.advice))
        for condition in standing
    )


def unbind_question(name: str, held: HeldReferences, source: Any) -> str:
    """The confirmation before ``del name``: what it returns, and what else still holds its storage."""
    try:
        found = promise(f"{UNBIND}:{name}", held, source)
    except LookupError as error:
        return str(error)
    return f"del {name}: {found.describe()}. Unbind it?"


def _promise(action: str, held: HeldReferences, source: Any) -> Any:
    try:
        return promise(action, held, source)
    except LookupError:
        return None  # it stopped applying since it was listed (a cell changed the session)


def build_holders(report: Any, promises: list[Any], device: str) -> HoldersModel:
    """The model from a holder report and the actions' promises."""
    rows = [HolderLine(r.name, r.type_name, r.nbytes, r.shared_bytes) for r in (*report.holders, *report.hidden)]
    rows.sort(key=lambda row: (-row.nbytes, row.name))
    kinds = tuple((kind.kind, kind.nbytes) for kind in report.kinds if kind.nbytes > 0)
    # An action that would return nothing and that nothing else blocks is no choice worth a button.
    shown = [p for p in promises if p.allocated_bytes or p.reserved_bytes or p.host_bytes or p.kept_bytes]
    actions = tuple(ActionLine(p.action, p.button_text(), p.describe()) for p in shown)
    names = tuple(row.name for row in report.holders if row.nbytes or row.shared_bytes)
    note = "; ".join(report.truncation) if report.truncated else ""
    return HoldersModel(kinds, tuple(row for row in rows if row.nbytes or row.shared_bytes), actions, names,
                        device, note)  # fmt: skip


def render_holders(model: HoldersModel, expanded: bool) -> str:
    """The kinds as one bar with a key, then the top holders (all of them when ``expanded``)."""
    total = sum(nbytes for _, nbytes in model.kinds)
    parts = []
    if total > 0:
        spans = "".join(
            f'<span style="width:{100 * nbytes / total:.2f}%;background:{_KIND_COLORS[i % len(_KIND_COLORS)]}" '
            f'title="{html.escape(kind)}: {format_bytes(nbytes)}"></span>'
            for i, (kind, nbytes) in enumerate(model.kinds)
        )
        keys = "".join(
            f'<span class="gm-key"><i style="background:{_KIND_COLORS[i % len(_KIND_COLORS)]}"></i>'
            f"{html.escape(kind)} {format_bytes(nbytes)}</span>"
            for i, (kind, nbytes) in enumerate(model.kinds)
        )
        label = f"memory by kind: {', '.join(f'{k} {format_bytes(n)}' for k, n in model.kinds)}"
        parts.append(f'<div class="gm-bar" role="img" aria-label="{html.escape(label)}">{spans}</div>')
        parts.append(f'<div class="gm-legend gm-kinds">{keys}</div>')
    rows = model.rows if expanded else model.rows[:TOP_ROWS]
    if rows:
        body = "".join(
            f'<tr><td class="gm-hname" title="{html.escape(row.type_name)}">{html.escape(row.name)}</td>'
            f'<td class="gm-num">{format_bytes(row.nbytes)}</td></tr>'
            for row in rows
        )
        parts.append(
            f'<table class="gm-table gm-holders" aria-label="top holders by size"><tbody>{body}</tbody></table>'
        )
    elif not total:
        parts.append('<div class="gm-note">No tensor memory is held by a name or by IPython.</div>')
    if model.note:
        parts.append(f'<div class="gm-note">{html.escape(model.note)}</div>')
    return f'<div class="gm-holders-view">{"".join(parts)}</div>'


_STYLE_EXTRA = (
    ".gpumem-panel .gm-holders{table-layout:fixed}"
    ".gpumem-panel .gm-holders .gm-hname{overflow-wrap:anywhere;white-space:normal}"
    ".gpumem-panel .gm-holders .gm-num{text-align:right;width:7em}.gpumem-panel .gm-holders{max-width:36em}"
    ".gpumem-panel .gm-kinds{margin-left:0}.gpumem-panel .gm-result{font-size:12px;min-height:18px;padding:2px 0}"
    ".gpumem-panel .gm-reclaim .widget-button{width:auto;max-width:100%;height:auto;min-height:28px;"
    "white-space:normal;line-height:1.3;text-align:left}"
)


class HoldersPane(widgets.VBox):  # type: ignore[misc]
    """The holders view's widgets: the view, "more", the action buttons, unbind with its confirmation."""

    def __init__(self) -> None:
        auto = {"width": "auto", "max_width": "100%"}
        self.title = widgets.HTML(f'<style>{_STYLE_EXTRA}</style><div class="gm-title">Who holds it</div>')
        self.refresh_button = widgets.Button(
            description="Refresh", icon="refresh", tooltip="Walk the session again: holders and actions",
            layout=widgets.Layout(**auto),
        )  # fmt: skip
        self.view = widgets.HTML('<div class="gm-note">Not walked yet: Refresh, or run a cell.</div>')
        self.more = widgets.ToggleButton(value=False, description="more", tooltip="Show every holder",
                                         layout=widgets.Layout(width="auto", display="none"))  # fmt: skip
        self.buttons = [widgets.Button(layout=widgets.Layout(**auto, display="none")) for _ in range(ACTION_SLOTS)]
        self.names = widgets.Dropdown(
            options=[], description="name", tooltip="The name to unbind", style={"description_width": "initial"},
            layout=widgets.Layout(width="auto", max_width="70%"),
        )  # fmt: skip
        self.unbind = widgets.Button(description="Unbind…", tooltip="Delete the chosen name (asks first)",
                                     layout=widgets.Layout(**auto))  # fmt: skip
        self.confirm_text = widgets.HTML("")
        self.confirm = widgets.Button(description="Unbind", button_style="danger", layout=widgets.Layout(**auto))
        self.cancel = widgets.Button(description="Cancel", layout=widgets.Layout(**auto))
        self.confirm_row = widgets.VBox(
            [self.confirm_text, widgets.HBox([self.confirm, self.cancel])], layout=widgets.Layout(display="none")
        )
        self.result = widgets.HTML('<div class="gm-result" role="status" aria-live="polite"></div>')
        wrap = {"flex_flow": "row wrap", "align_items": "center", "width": "100%"}
        self.actions_box = widgets.HBox(self.buttons, layout=widgets.Layout(**wrap))
        self.actions_box.add_class("gm-reclaim")
        self.unbind_box = widgets.HBox([self.names, self.unbind], layout=widgets.Layout(**wrap, display="none"))
        self.actions_for: list[str] = [""] * ACTION_SLOTS
        self.model: HoldersModel | None = None
        super().__init__(
            [widgets.HBox([self.title, self.refresh_button], layout=widgets.Layout(**wrap)), self.view, self.more,
             self.actions_box, self.unbind_box, self.confirm_row, self.result],
            layout=widgets.Layout(width="100%"),
        )  # fmt: skip
        self.add_class("gm-holders-pane")

    # Writer thread only ---------------------------------------------------------------------------
    def show_model(self, model: HoldersModel | None) -> None:
        if model is None:
            return
        self.model = model
        self.view.value = render_holders(model, bool(self.more.value))
        self.more.layout.display = "flex" if len(model.rows) > TOP_ROWS else "none"
        self.more.description = "less" if self.more.value else f"more ({len(model.rows) - TOP_ROWS})"
        for index, button in enumerate(self.buttons):
            line = model.actions[index] if index < len(model.actions) else None
            self.actions_for[index] = line.action if line is not None else ""
            if line is None:
                button.layout.display = "none"
                continue
            with button.hold_sync():
                button.description, button.tooltip, button.disabled = line.text, line.tooltip, False
            button.layout.display = "flex"
        if tuple(self.names.options) != model.names:
            with self.names.hold_sync():
                self.names.options = list(model.names)
                self.names.value = model.names[0] if model.names else None
        self.unbind_box.layout.display = "flex" if model.names else "none"

    def show_running(self, label: str) -> None:
        for button in self.buttons:
            button.disabled = True
        self.result.value = f'<div class="gm-result" role="status" aria-live="polite">{html.escape(label)}…</div>'

    def show_outcome(self, outcome: Outcome) -> None:
        css = "gm-ok" if outcome.kept else "gm-err"
        text = html.escape(outcome.describe())
        self.result.value = f'<div class="gm-result {css}" role="status" aria-live="polite">{text}</div>'
        for button in self.buttons:
            button.disabled = False

    def show_confirmation(self, text: str | None) -> None:
        self.confirm_text.value = (
            "" if text is None else f'<div class="gm-result" role="alert">{html.escape(text)}</div>'
        )
        self.confirm_row.layout.display = "none" if text is None else "flex"


# The panel's side of the holders view: its worker threads, its buttons' handlers, its writer-thread updates.
#
# Clicks arrive on gpumem's subshell (also while a cell runs) and only start a worker or queue a command;
# the walk and the actions run on short-lived worker threads (one walk and one action at a time); the
# widgets are set on the panel's writer thread through the commands' handlers below.
class HoldersControl:
    """The holders pane of one panel and the threads that feed it."""

    def __init__(self, shell: Any, source: Callable[[], Any], post: Callable[[Command], None]) -> None:
        self.pane = HoldersPane()
        self.shell = shell
        self.held = ShellReferences(shell) if shell is not None else None
        self._source = source  # the monitor's source, read when used
        self._post = post
        self._walker = FreeWorker("gpumem-holders-walk")
        self._actions = FreeWorker("gpumem-reclaim")
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
