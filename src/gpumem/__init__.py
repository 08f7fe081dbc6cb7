"""Where did my GPU memory go? Per-cell memory diffs, a live panel and holder finders for PyTorch.

In IPython or Jupyter: ``%load_ext gpumem``. In scripts: :class:`gpumem.Monitor`.
Everything heavy (widgets, IPython, torch) is imported only when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpumem._version import __version__

if TYPE_CHECKING:
    from gpumem.core.monitoring.monitor import Monitor

__all__ = [
    "CsvWriter",
    "JsonlWriter",
    "Monitor",
    "Panel",
    "TensorBoardWriter",
    "ThresholdEvent",
    "__version__",
    "free",
    "history",
    "holders",
    "load_ipython_extension",
    "measure",
    "measured",
    "predict",
    "search_batch",
    "unload_ipython_extension",
]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext gpumem``: register the magics and hooks."""
    from gpumem.ipython.extension import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext gpumem``: remove every hook, thread and widget the extension made."""
    from gpumem.ipython.extension import unload

    unload(ipython)


def history() -> Any:
    """The cells measured in this session (``%%gpumem`` and automatic mode) as a pandas DataFrame."""
    from gpumem.core.cells.report import history_dataframe
    from gpumem.ipython.extension import get_state

    state = get_state()
    if state is None:
        raise RuntimeError(
            "gpumem has no cell history here: load it first with %load_ext gpumem "
            "(in a script, gpumem.measured() lists the blocks measured with gpumem.measure())"
        )
    return history_dataframe(state.tracker.history)


def holders(device: str | int | None = "cuda", **options: Any) -> Any:
    """What holds memory on ``device`` (a HolderReport): the running IPython's names, else the caller's globals."""
    import sys

    from gpumem.core.holders import find_holders
    from gpumem.core.runtime import ipython_shell

    shell = ipython_shell()
    namespace = shell.user_ns if shell is not None else sys._getframe(1).f_globals  # noqa: SLF001 - caller's names
    return find_holders(namespace, device=device, shell=shell, **options)


def predict(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Will ``fn(*args, **kwargs)`` fit? A dry run on fake copies (nothing of yours changes, no GPU memory is
    taken): a :class:`gpumem.core.predict.Prediction` of the peak and end memory per device, by kind and by
    module; printed, the same report as ``%%gpumem --predict``. ``.against(capacity_bytes)`` compares it
    with a card you do not have."""
    from gpumem.core.predict import predict as dry_run

    return dry_run(fn, *args, **kwargs)


def search_batch(step: Any, low: int, high: int, *, capacity: int | str | None = None) -> Any:
    """The largest ``n`` in ``[low, high]`` for which ``step(n)`` fits (dry runs only, fewer than 10):
    ``capacity`` bytes or a size such as ``"24GiB"``, by default the memory free on the device now."""
    from gpumem.core.predict import search_batch as search
    from gpumem.core.units import parse_size

    size = parse_size(capacity) if isinstance(capacity, str) else capacity
    return search(step, low, high, capacity=size)


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """For ``jupyter labextension develop``: the built front-end extension inside the package."""
    from gpumem.panel.frontend import _jupyter_labextension_paths as paths

    return paths()


def __getattr__(name: str) -> Any:
    if name == "Monitor":
        from gpumem.core.monitoring.monitor import Monitor

        return Monitor
    if name in ("CsvWriter", "JsonlWriter", "TensorBoardWriter"):
        from gpumem.core.scripts import metric_writers

        return getattr(metric_writers, name)
    if name == "ThresholdEvent":
        from gpumem.core.sampling.thresholds import ThresholdEvent

        return ThresholdEvent
    if name == "Panel":
        from gpumem.panel.widget import Panel

        return Panel
    if name in ("measure", "measured"):
        from gpumem.core.cells import measure as _measure_module

        return getattr(_measure_module, name)
    if name == "free":
        from gpumem.core.cleanup import free

        return free
    raise AttributeError(f"module 'gpumem' has no attribute {name!r}")
