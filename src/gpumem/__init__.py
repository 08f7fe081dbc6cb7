"""Where did my GPU memory go? Per-cell memory diffs, a live panel and holder finders for PyTorch.

In IPython or Jupyter: ``%load_ext gpumem``. In scripts: :class:`gpumem.Monitor`.
Everything heavy (widgets, IPython, torch) is imported only when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from .monitor import Monitor

__all__ = [
    "Monitor",
    "Panel",
    "__version__",
    "free",
    "history",
    "holders",
    "load_ipython_extension",
    "measure",
    "measured",
    "unload_ipython_extension",
]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext gpumem``: register the magics and hooks."""
    from ._extension import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext gpumem``: remove every hook, thread and widget the extension made."""
    from ._extension import unload

    unload(ipython)


def history() -> Any:
    """The cells measured in this session (``%%gpumem`` and automatic mode) as a pandas DataFrame."""
    from ._extension import get_state
    from .report import history_dataframe

    state = get_state()
    if state is None:
        raise RuntimeError(
            "gpumem has no cell history here: load it first with %load_ext gpumem "
            "(in a script, gpumem.measured() lists the blocks measured with gpumem.measure())"
        )
    return history_dataframe(state.tracker.history)


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """For ``jupyter labextension develop``: the built front-end extension inside the package."""
    from ._frontend import _jupyter_labextension_paths as paths

    return paths()


def __getattr__(name: str) -> Any:
    if name == "Monitor":
        from .monitor import Monitor

        return Monitor
    if name == "Panel":
        from ._panel import Panel

        return Panel
    if name in ("measure", "measured"):
        from . import _measure as _measure_module

        return getattr(_measure_module, name)
    if name == "holders":
        import importlib

        return importlib.import_module(".holders", __name__)  # callable: gpumem.holders(device="cuda")
    if name == "free":
        from .cleanup import free

        return free
    raise AttributeError(f"module 'gpumem' has no attribute {name!r}")
