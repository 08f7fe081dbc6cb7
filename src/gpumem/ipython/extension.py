"""The IPython side of gpumem: configuration, the pre/post-run hooks that measure cells, load and unload.

Loading registers ``%gpumem``/``%%gpumem``, one ``%%gpumem`` header transformer and two event
hooks; unloading removes exactly those, closes panels and stops the sampler if the extension
started it. ``%reload_ext gpumem`` therefore never leaves two sets behind.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from traitlets import Bool, Enum, Int
from traitlets.config import Configurable

from gpumem.core.cells import STATUS_OUT_OF_MEMORY, ActiveCell, CellOptions, CellRecord, CellTracker
from gpumem.core.monitor import Monitor, default_monitor
from gpumem.core.units import MIB
from gpumem.ipython import magics

__all__ = ["ExtensionState", "GpuMem", "get_state", "load", "unload"]



class GpuMem(Configurable):
    """gpumem settings, e.g. ``c.GpuMem.auto = True`` in ipython_config.py; ``%config GpuMem`` lists them."""

    auto = Bool(False, help="Measure every cell (automatic mode) from the start.").tag(config=True)
    threshold_bytes = Int(
        64 * MIB,
        min=0,
        help="Automatic mode: show a summary line under a cell whose memory changed by at least this many bytes.",
    ).tag(config=True)
    attribute = Enum(
        ("changed", "always", "never"),
        "changed",
        help="Automatic mode: when to look for the variables holding GPU memory (a namespace walk). "
        "'changed': only after cells that changed CUDA allocated memory by attribute_threshold_bytes.",
    ).tag(config=True)
    attribute_threshold_bytes = Int(
        MIB, min=0, help="Automatic mode: the allocated-memory change that triggers a variable inspection."
    ).tag(config=True)
    keep_peaks = Bool(
        False,
        help="Automatic mode: do not reset PyTorch's peak counters at each cell start (peaks become sampled "
        "lower bounds; torch.cuda.max_memory_allocated() keeps covering the whole session).",
    ).tag(config=True)
    top_variables = Int(magics.DEFAULT_TOP, min=0, help="Variables listed per cell.").tag(config=True)
    history_size = Int(10_000, min=1, help="Measured cells kept in the history (oldest dropped first).").tag(
        config=True
    )
    leak_runs = Int(3, min=2, help="Runs of the same cell, each growing memory alike, before a leak warning.").tag(
        config=True
    )
    leak_min_bytes = Int(MIB, min=1, help="Smallest per-run growth that counts towards a leak warning.").tag(
        config=True
    )


class _Pending(NamedTuple):
    """One cell between pre_run_cell and post_run_cell; ``request`` is set for a %%gpumem cell."""

    info: Any
    active: ActiveCell | None
    request: magics.CellRequest | None


# The request of a cell whose measurement could not start (compared by identity).
_NOT_MEASURED = magics.CellRequest(CellOptions(), None)


class ExtensionState:
    """Everything the loaded extension owns; other modules add cleanup with :meth:`on_unload`."""

    def __init__(self, shell: Any, monitor: Monitor, config: GpuMem) -> None:
        self.shell = shell
        self.monitor = monitor
        self.config = config
        self.tracker = CellTracker(
            monitor,
            history_size=config.history_size,
            leak_runs=config.leak_runs,
            leak_min_bytes=config.leak_min_bytes,
            attribute_threshold_bytes=config.attribute_threshold_bytes,
        )
        self.magic: magics.GpuMemMagic | None = None
        self._stack: list[_Pending] = []
        self._unload_callbacks: list[Callable[[], None]] = []

    @property
    def auto(self) -> bool:
        return bool(self.config.auto)

    @auto.setter
    def auto(self, value: bool) -> None:
        self.config.auto = bool(value)

    def on_unload(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` when the extension is unloaded (latest first; failures are reported, not raised)."""
        self._unload_callbacks.append(callback)

    # Settings -------------------------------------------------------------------------------------
    def _config_changed(self, change: Any) -> None:
        name, value = change["name"], change["new"]
        if name == "history_size":
            self.tracker.history_size = value
        elif name in ("leak_runs", "leak_min_bytes", "attribute_threshold_bytes"):
            setattr(self.tracker, name, value)
        if name == "auto":
            if value:
                self._warm_up()
            else:
                self.tracker.release_sampler()

    def _warm_up(self) -> None:
        """Start sampling now so that opening NVML and psutil happens off the first measured cell."""
        self.tracker._ensure_sampling()

    def _auto_options(self) -> CellOptions:
        attribute = {"changed": None, "always": True, "never": False}[self.config.attribute]
        return CellOptions(keep_peaks=self.config.keep_peaks, attribute=attribute, mode="auto")

    # Hooks ----------------------------------------------------------------------------------------
    def pre_run_cell(self, info: Any) -> None:
        try:
            self._begin(info)
        except (Exception, KeyboardInterrupt) as error:
            # Not measured, and marked so that the %%gpumem header line does not try (and complain) again.
            self._stack.append(_Pending(info, None, _NOT_MEASURED))
            _complain("could not start measuring this cell", error)

    def _begin(self, info: Any) -> None:
        if self._stack:
            # A cell run from inside another cell (get_ipython().run_cell): the outer one measures it.
            self._stack.append(_Pending(info, None, None))
            return
        raw = getattr(info, "raw_cell", "") or ""
        request: magics.CellRequest | None = None
        body = raw
        header = magics.split_cell_header(raw) if "%%gpumem" in raw[:200] else None
        if header is not None:
            try:
                request = magics.parse_cell_options(header[0])
                body = header[1]
            except Exception:
                request = None  # the %%gpumem magic itself reports the bad option, without running the body
        if request is None and not self.config.auto:
            self._stack.append(_Pending(info, None, None))
            return
        options = request.options if request is not None else self._auto_options()
        count = int(self.shell.execution_count) - 1 if getattr(info, "store_history", False) else None
        active = self.tracker.begin(body, options=options, execution_count=count, namespace=self.shell.user_ns)
        self._stack.append(_Pending(info, active, request))

    def post_run_cell(self, result: Any) -> None:
        pending = self._pop(result)
        if pending is None or pending.active is None:
            return
        try:
            self._finish(pending, result)
        except (Exception, KeyboardInterrupt) as error:
            _complain("could not finish measuring this cell", error)

    def _pop(self, result: Any) -> _Pending | None:
        if not self._stack:
            return None
        info = getattr(result, "info", None)
        for position in range(len(self._stack) - 1, -1, -1):
            if self._stack[position].info is info:
                pending = self._stack[position]
                del self._stack[position:]
                return pending
        top = self._stack[-1]
        if result is None or getattr(info, "raw_cell", None) == getattr(top.info, "raw_cell", None):
            # The cell was aborted outside the user's code: IPython reports it with a fresh result object.
            return self._stack.pop()
        return None  # an empty cell: IPython skips pre_run_cell for those

    def _finish(self, pending: _Pending, result: Any) -> None:
        active = pending.active
        assert active is not None
        if result is None:
            error: BaseException | None = RuntimeError("the cell did not complete")
        else:
            error = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
        count = getattr(result, "execution_count", None)
        if pending.info is not None and not getattr(pending.info, "store_history", False):
            count = None
        request = pending.request
        options = request.options if request is not None else None
        record = self.tracker.end(
            active,
            error=error,
            namespace=self.shell.user_ns,
            execution_count=count,
            options=options,
            hidden=self._new_output(count),
        )
        self.show(record, request)

    def _new_output(self, count: int | None) -> dict[str, Any] | None:
        """The cell's entry in IPython's output cache, which keeps its value alive."""
        outputs = self.shell.user_ns.get("Out")
        if count is None or not isinstance(outputs, dict) or count not in outputs:
            return None
        return {f"Out[{count}]": outputs[count]}

    def running_cell_number(self) -> int | None:
        """The execution count of the cell running now, if it is stored in the history."""
        if self._stack and getattr(self._stack[0].info, "store_history", False):
            return int(self.shell.execution_count) - 1
        return None

    def finish(self, active: ActiveCell, error: BaseException | None, request: magics.CellRequest) -> None:
        """End a measurement the %%gpumem magic ran itself, and show it."""
        try:
            record = self.tracker.end(active, error=error, namespace=self.shell.user_ns, options=request.options)
            self.show(record, request)
        except (Exception, KeyboardInterrupt) as failure:
            _complain("could not finish measuring this cell", failure)

    def show(self, record: CellRecord, request: magics.CellRequest | None) -> None:
        """Full report for %%gpumem; in automatic mode one line, only when it is worth a look."""
        from gpumem.core.cells.report import CellReport, CellSummary

        if record.quiet:
            return
        if request is not None:
            top = request.top if request.top is not None else self.config.top_variables
            magics.display(CellReport(record, top))
            return
        notable = (
            record.largest_change_bytes() >= self.config.threshold_bytes
            or bool(record.warnings)
            or record.status == STATUS_OUT_OF_MEMORY
        )
        if notable:
            magics.display(CellSummary(record))

    def cell_header_reached(self, request: magics.CellRequest) -> None:
        """A %%gpumem body starts inside the cell being run: measure that cell as asked, if not yet."""
        if not self._stack:
            return
        outer = self._stack[0]
        if outer.request is not None:
            return
        if outer.active is None:
            count = self.running_cell_number()
            source = getattr(outer.info, "raw_cell", "") or ""
            try:
                active = self.tracker.begin(
                    source, options=request.options, execution_count=count, namespace=self.shell.user_ns
                )
            except (Exception, KeyboardInterrupt) as error:
                self._stack[0] = outer._replace(request=_NOT_MEASURED)
                _complain("could not start measuring this cell", error)
                return
            outer = outer._replace(active=active)
        self._stack[0] = outer._replace(request=request)

    def adopt_cell_request(self, request: magics.CellRequest) -> bool:
        """A %%gpumem magic runs inside a cell already being measured: report that cell with these options."""
        for position, pending in enumerate(self._stack):
            if pending.active is not None:
                self._stack[position] = pending._replace(request=request)
                return True
        return False


def _complain(what: str, error: BaseException) -> None:
    detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    print(f"gpumem: {what}: {detail}", file=sys.stderr)


_state: ExtensionState | None = None


def get_state() -> ExtensionState | None:
    """The loaded extension's state, or None when it is not loaded."""
    return _state


def _make_config(shell: Any) -> GpuMem:
    try:
        return GpuMem(parent=shell)
    except Exception as error:
        _complain("ignoring the GpuMem configuration", error)
        return GpuMem()


def load(shell: Any) -> ExtensionState:
    """Install the magics and hooks into ``shell``; loading into the same shell twice changes nothing."""
    global _state
    if _state is not None:
        if _state.shell is shell:
            return _state
        unload(_state.shell)
    config = _make_config(shell)
    state = ExtensionState(shell, default_monitor(), config)
    state.magic = magics.register(shell)
    shell.events.register("pre_run_cell", state.pre_run_cell)
    shell.events.register("post_run_cell", state.post_run_cell)
    config.observe(state._config_changed)
    configurables = getattr(shell, "configurables", None)
    if isinstance(configurables, list):
        configurables.append(config)
    _state = state
    _call_optional("gpumem.panel.frontend", "register_status_target", shell)
    _call_optional("gpumem.panel.frontend", "set_sidebar_factory", _sidebar_panel)
    _call_optional("gpumem.core.oom", "install", shell)
    if config.auto:
        state._warm_up()
    return state


def unload(shell: Any) -> None:
    """Remove everything :func:`load` installed; unloading when not loaded does nothing."""
    global _state
    state = _state
    if state is None or state.shell is not shell:
        return
    _state = None
    for callback in reversed(state._unload_callbacks):
        try:
            callback()
        except Exception as error:
            _complain("an unload callback failed", error)
    _call_optional("gpumem.core.oom", "uninstall", shell, only_if_imported=True)
    _call_optional("gpumem.panel.frontend", "unregister_status_target", only_if_imported=True)
    _call_optional("gpumem.panel.frontend", "set_sidebar_factory", None, only_if_imported=True)
    _call_optional("gpumem.panel.sidebar", "close_all", only_if_imported=True)
    for event, hook in (("pre_run_cell", state.pre_run_cell), ("post_run_cell", state.post_run_cell)):
        with contextlib.suppress(ValueError):
            shell.events.unregister(event, hook)
    magics.unregister(shell, state.magic)
    state.magic = None
    state.config.unobserve(state._config_changed)
    configurables = getattr(shell, "configurables", None)
    if isinstance(configurables, list) and state.config in configurables:
        configurables.remove(state.config)
    state.tracker.close()
    state._stack.clear()


def _sidebar_panel() -> Any:
    """The front end asked for a docked panel: import the widget code only now (it needs numpy, bqplot)."""
    return importlib.import_module("gpumem.panel.sidebar").sidebar_panel()


def _call_optional(module_name: str, function: str, *args: Any, only_if_imported: bool = False) -> None:
    """Call another feature's hook; a missing module is fine, a failing one is reported in one line."""
    module = sys.modules.get(module_name)
    if module is None and not only_if_imported:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return
        except Exception as error:
            _complain(f"{_FEATURES.get(module_name, module_name)} is unavailable", error)
            return
    if module is None:
        return
    target = getattr(module, function, None)
    if not callable(target):
        return
    try:
        target(*args)
    except Exception as error:
        _complain(f"{_FEATURES.get(module_name, module_name)} failed ({function})", error)


# What the user knows the optional parts as, for the one line shown when one of them fails.
_FEATURES = {
    "gpumem.panel.frontend": "the sidebar and status-bar link",
    "gpumem.core.oom": "the out-of-memory explanation",
    "gpumem.panel.sidebar": "the live panel",
}
