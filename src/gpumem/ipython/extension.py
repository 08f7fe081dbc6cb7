"""Loading and unloading gpumem in an IPython shell (``%load_ext gpumem``).

:func:`load` builds one :class:`~gpumem.ipython.state.ExtensionState`, one pair of cell hooks
(:class:`~gpumem.ipython.hooks.CellHooks`, which also explain out-of-memory errors), one
:class:`~gpumem.ipython.magics.GpuMemMagics` for ``%gpumem``/``%%gpumem`` and one ``%%gpumem``
header transformer, and registers them here, in one place; the sidebar and status-bar link of
the front end is optional. :func:`unload` removes exactly what :func:`load` added, closes the
panels and stops the sampler if the extension started it, so ``%reload_ext gpumem`` never leaves
two sets behind. Nothing heavy is imported: no widgets, numpy, pandas or torch.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from gpumem.core.monitoring.monitor import default_monitor
from gpumem.ipython.arguments import complain
from gpumem.ipython.cell_magic import HeaderTransformer
from gpumem.ipython.hooks import CellHooks
from gpumem.ipython.magics import GpuMemMagics
from gpumem.ipython.oom_explainer import OomExplainer
from gpumem.ipython.state import ExtensionState, GpuMem, make_config

__all__ = ["ExtensionState", "GpuMem", "get_hooks", "get_state", "load", "unload"]

# What the user knows the optional parts as, for the one line shown when one of them fails.
_OOM_FEATURE = "the out-of-memory explanation"
_FRONTEND_FEATURE = "the sidebar and status-bar link"
_PANEL_FEATURE = "the live panel"


class _Step(NamedTuple):
    """One call into an optional part of gpumem; if it fails, one line names the part and the call."""

    feature: str
    function: Callable[..., Any]
    args: tuple[Any, ...] = ()


class _Loaded(NamedTuple):
    """What :func:`load` added to the shell, for :func:`unload` to take away again."""

    state: ExtensionState
    hooks: CellHooks
    magics: GpuMemMagics
    header: HeaderTransformer
    undo: list[_Step]  # the optional parts' undoing, in load order


_loaded: _Loaded | None = None


def get_state() -> ExtensionState | None:
    """The loaded extension's state, or None when it is not loaded."""
    return _loaded.state if _loaded is not None else None


def get_hooks() -> CellHooks | None:
    """The loaded extension's pre/post_run_cell pair (benchmarks time it), or None when it is not loaded."""
    return _loaded.hooks if _loaded is not None else None


def load(shell: Any) -> ExtensionState:
    """Install the magics and hooks into ``shell``; loading into the same shell twice changes nothing."""
    global _loaded
    if _loaded is not None:
        if _loaded.state.shell is shell:
            return _loaded.state
        unload(_loaded.state.shell)
    config = make_config(shell)
    state = ExtensionState(shell, default_monitor(), config)
    header = HeaderTransformer(state.monitor.source)  # the one parser of %%gpumem headers, once per cell
    hooks = CellHooks(state, header, oom=_explainer(shell))
    magics = GpuMemMagics(shell, state, hooks, header)
    shell.register_magics(magics)
    shell.input_transformers_cleanup.append(header)
    shell.events.register("pre_run_cell", hooks.pre_run_cell)
    shell.events.register("post_run_cell", hooks.post_run_cell)
    config.observe(state.config_changed)
    configurables = getattr(shell, "configurables", None)
    if isinstance(configurables, list):
        configurables.append(config)
    _loaded = _Loaded(state, hooks, magics, header, _connect_frontend(shell))
    _offer_cells_to_panels(state)
    if config.auto:
        state.warm_up()
    return state


def unload(shell: Any) -> None:
    """Remove everything :func:`load` installed; unloading when not loaded does nothing."""
    global _loaded
    loaded = _loaded
    if loaded is None or loaded.state.shell is not shell:
        return
    _loaded = None
    state = loaded.state
    state.run_unload_callbacks()
    for step in reversed(loaded.undo):
        _attempt(step)
    if "gpumem.panel.widget" in sys.modules:  # else no panel was ever made (%gpumem monitor, gpumem.Panel())
        from gpumem.panel.writer import close_all

        _attempt(_Step(_PANEL_FEATURE, close_all))
        from gpumem.ipython.panel_magics import forget_shown

        forget_shown()
    if "gpumem.panel.loaded" in sys.modules:  # %gpumem load showed a recorded session's panel
        from gpumem.panel.loaded import close_loaded

        _attempt(_Step(_PANEL_FEATURE, close_loaded))
    for event, hook in (("pre_run_cell", loaded.hooks.pre_run_cell), ("post_run_cell", loaded.hooks.post_run_cell)):
        with contextlib.suppress(ValueError):
            shell.events.unregister(event, hook)
    transformers = shell.input_transformers_cleanup
    while loaded.header in transformers:
        transformers.remove(loaded.header)
    _unregister_magics(shell, loaded.magics)
    state.config.unobserve(state.config_changed)
    configurables = getattr(shell, "configurables", None)
    if isinstance(configurables, list) and state.config in configurables:
        configurables.remove(state.config)
    state.tracker.close()
    loaded.hooks.close()


def _offer_cells_to_panels(state: ExtensionState) -> None:
    """The panels' compact history reads this session's measured cells (until unload)."""
    from gpumem.panel.cell_source import note_oom, set_cell_source

    set_cell_source(lambda: state.tracker.history)
    state.on_unload(lambda: set_cell_source(None))
    state.on_unload(lambda: note_oom(None))


def _explainer(shell: Any) -> OomExplainer | None:
    """The out-of-memory explainer the cell hooks own; one that cannot start is one line, not a failed load."""
    try:
        return OomExplainer(shell)
    except Exception as error:
        complain(f"{_OOM_FEATURE} failed (install)", error)
        return None


def _connect_frontend(shell: Any) -> list[_Step]:
    """Register the status-bar comm target and the sidebar's panel factory; returns how to undo that."""
    try:
        from gpumem.panel import frontend
    except ImportError:
        return []
    except Exception as error:
        complain(f"{_FRONTEND_FEATURE} is unavailable", error)
        return []
    undo: list[_Step] = []
    if _attempt(_Step(_FRONTEND_FEATURE, frontend.register_status_target, (shell,))):
        undo.append(_Step(_FRONTEND_FEATURE, frontend.unregister_status_target))
    if _attempt(_Step(_FRONTEND_FEATURE, frontend.set_sidebar_factory, (_sidebar_panel,))):
        undo.append(_Step(_FRONTEND_FEATURE, frontend.set_sidebar_factory, (None,)))
    return undo


def _sidebar_panel() -> Any:
    """The front end asked for a docked panel: import the widget code only now (it needs numpy, bqplot)."""
    from gpumem.panel.widget import sidebar_panel

    return sidebar_panel()


def _attempt(step: _Step) -> bool:
    """Run one step of an optional part; a failure is one line naming the part, never an exception."""
    try:
        step.function(*step.args)
    except Exception as error:
        complain(f"{step.feature} failed ({step.function.__name__})", error)
        return False
    return True


def _unregister_magics(shell: Any, magics: GpuMemMagics) -> None:
    """Take out of the magics manager (and the configurables) exactly the object :func:`load` registered."""
    manager = shell.magics_manager
    for kind in ("line", "cell"):
        table = manager.magics.get(kind, {})
        if getattr(table.get("gpumem"), "__self__", None) is magics:
            del table["gpumem"]
    if manager.registry.get(type(magics).__name__) is magics:
        del manager.registry[type(magics).__name__]
    configurables = getattr(shell, "configurables", None)
    if isinstance(configurables, list) and magics in configurables:
        configurables.remove(magics)
