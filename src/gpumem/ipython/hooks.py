"""The pre/post_run_cell pair: measure the cells (``%%gpumem`` ones, or all in automatic mode), show
the report, and explain an out-of-memory error.

IPython calls :meth:`CellHooks.pre_run_cell` before and :meth:`CellHooks.post_run_cell` after every
cell, also one run from inside another (``get_ipython().run_cell``): a stack pairs them. Nothing
here raises into IPython: a failure, Ctrl-C included, is one line on stderr and the cell stays the
user's.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from gpumem.core.cells import STATUS_OUT_OF_MEMORY, ActiveCell, CellOptions, CellRecord
from gpumem.core.readers.cuda_fault import fault_explanation, is_sticky_cuda_error, record_fault, take_untold
from gpumem.core.sessions.session_file import SavedReport
from gpumem.core.units import Amount
from gpumem.ipython import cell_recorders as recorders
from gpumem.ipython.arguments import complain, display
from gpumem.ipython.cell_magic import CellRequest, HeaderTransformer, split_cell_header
from gpumem.ipython.oom_explainer import OomExplainer
from gpumem.ipython.state import ExtensionState

__all__ = ["CellHooks"]

_T = TypeVar("_T")


class _Pending(NamedTuple):
    """One cell between pre_run_cell and post_run_cell; ``request`` is set for a %%gpumem cell."""

    info: Any
    active: ActiveCell | None
    request: CellRequest | None
    trace: Any = None  # the --trace recorder, recording
    profile: Any = None  # the --profile profiler, recording
    no_code: bool = False  # a %%gpumem cell with nothing but blank lines and comments below the header


REPORTS_KEPT = 32  # the latest --trace and --profile reports, for %gpumem export

# The request of a cell whose measurement could not start (compared by identity).
_NOT_MEASURED = CellRequest(CellOptions(), None)


class CellHooks:
    """The extension's one pair of cell hooks, and what the ``%%gpumem`` magic asks of the cell running."""

    def __init__(
        self, state: ExtensionState, header: HeaderTransformer | None = None, oom: OomExplainer | None = None
    ) -> None:
        self.state = state
        self.header = header if header is not None else HeaderTransformer(state.monitor.source)  # parses headers
        self.oom = oom  # None where the out-of-memory explanation could not be set up
        self._stack: list[_Pending] = []
        self.reports: deque[SavedReport] = deque(maxlen=REPORTS_KEPT)  # shown under cells, oldest first

    # The pair -------------------------------------------------------------------------------------
    def pre_run_cell(self, info: Any) -> None:
        try:
            self._begin(info)
        except (Exception, KeyboardInterrupt) as error:
            # Not measured, and marked so that the %%gpumem header line does not try (and complain) again.
            self._stack.append(_Pending(info, None, _NOT_MEASURED))
            complain("could not start measuring this cell", error)
        if self.oom is not None:
            self.oom.pre_run_cell(info)

    def post_run_cell(self, result: Any) -> None:
        pending = self._pop(result)
        if not self._stack:
            self.header.forget()
        if pending is not None and pending.active is not None:
            try:
                self._finish(pending, result)
            except (Exception, KeyboardInterrupt) as error:
                complain("could not finish measuring this cell", error)
        elif pending is not None and pending.no_code and pending.request is not None:
            _say_nothing_measured(pending.request)
        elif result is not None and pending is not None and pending.request is None:
            self._unmeasured_fault(result)
        if self.oom is not None:
            self.oom.post_run_cell(result)

    def _unmeasured_fault(self, result: Any) -> None:
        """A cell gpumem did not measure that left CUDA in an error state: said once, under it, all the same."""
        error: BaseException | None = getattr(result, "error_in_exec", None)
        count = getattr(result, "execution_count", None)
        if error is not None and is_sticky_cuda_error(error):  # most errors are not: then nothing is read
            try:
                readings = self.state.monitor.snapshot().allocator  # the counters still read: the last good figures
                record_fault(error, count, readings)
            except Exception as failure:
                complain("could not check this cell's CUDA error", failure)
                return
        for fault in take_untold():
            print(f"gpumem: {fault_explanation(fault, count)}.")

    def close(self) -> None:
        """At unload: forget the cells in flight and stop the out-of-memory observer."""
        for pending in self._stack:
            recorders.abandon(pending.trace)
            recorders.abandon(pending.profile)
        self._stack.clear()
        if self.oom is not None:
            self.oom.close()

    # Measuring ------------------------------------------------------------------------------------
    def _begin(self, info: Any) -> None:
        if self._stack:
            # A cell run from inside another cell (get_ipython().run_cell): the outer one measures it.
            self._stack.append(_Pending(info, None, None))
            return
        state = self.state
        raw = getattr(info, "raw_cell", "") or ""
        request: CellRequest | None = None
        body = raw
        header = split_cell_header(raw) if "%%gpumem" in raw[:200] else None
        if header is not None:
            try:
                request = self.header.parse(header[0])
                body = header[1]
            except Exception:
                request = None  # the %%gpumem magic itself reports the bad option, without running the body
        if request is not None and request.predict is not None:  # a dry run: the cell itself does not run
            self._stack.append(_Pending(info, None, None))
            return
        if request is None and (not state.config.auto or self._own_command(raw) or not has_code(raw)):
            self._stack.append(_Pending(info, None, None))
            return
        if request is not None and not has_code(body):
            self._stack.append(_Pending(info, None, request, no_code=True))
            return
        options = request.options if request is not None else state.auto_options()
        count = int(state.shell.execution_count) - 1 if getattr(info, "store_history", False) else None
        active = state.tracker.begin(body, options=options, execution_count=count, namespace=state.shell.user_ns)
        if request is None:  # automatic mode: no --trace, no --profile
            self._stack.append(_Pending(info, active, None))
            return
        self._stack.append(_Pending(info, active, request, **_recorders_started(request)))

    def _own_command(self, source: str) -> bool:
        """A cell of only ``%gpumem`` line magics: in automatic mode it would fill the history with gpumem's
        own commands (c.GpuMem.record_own_commands = True records them)."""
        if "%gpumem" not in source or self.state.config.record_own_commands:
            return False
        lines = [line.strip() for line in source.splitlines() if line.strip() and not line.strip().startswith("#")]
        return bool(lines) and all(re.match(r"%gpumem(\s|$)", line) for line in lines)

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
        count = getattr(result, "execution_count", None)
        if pending.info is not None and not getattr(pending.info, "store_history", False):
            count = None
        recorded = _recorders_stopped(pending.trace, pending.profile, count)
        if result is None:
            error: BaseException | None = RuntimeError("the cell did not complete")
        else:
            error = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
        request = pending.request
        record = self.state.tracker.end(
            active,
            error=error,
            namespace=self.state.shell.user_ns,
            execution_count=count,
            options=request.options if request is not None else None,
            hidden=self._new_output(count),
        )
        self.show(record, request)
        if request is not None:
            self._show_recorded(request, count, record.quiet, *recorded)

    def _show_recorded(self, request: CellRequest, cell: int | None, quiet: bool, traced: Any, profiled: Any) -> None:
        """The --trace and --profile reports under the cell (unless ``quiet``), each kept for an export."""
        shell = self.state.shell
        self._keep("trace", cell, recorders.show_trace(traced, request.trace, shell, cell, quiet))
        self._keep("profile", cell, recorders.show_profile(profiled, quiet))

    def _keep(self, kind: str, cell: int | None, report: object) -> None:
        """Remember a report shown under a cell (as its text) so that an export holds it."""
        if report is None:
            return
        try:
            self.reports.append(SavedReport(kind, cell, repr(report)))
        except (Exception, KeyboardInterrupt) as error:
            complain(f"could not keep the {kind} report for an export", error)

    def _new_output(self, count: int | None) -> dict[str, Any] | None:
        """The cell's entry in IPython's output cache, which keeps its value alive."""
        outputs = self.state.shell.user_ns.get("Out")
        if count is None or not isinstance(outputs, dict) or count not in outputs:
            return None
        return {f"Out[{count}]": outputs[count]}

    def show(self, record: CellRecord, request: CellRequest | None) -> None:
        """Full report for %%gpumem; in automatic mode one line, only when it is worth a look (the report
        module is imported, and the report built, only then: most automatic-mode cells show nothing)."""
        if record.quiet:
            return
        config = self.state.config
        if request is not None:
            from gpumem.core.cells.report import CellReport

            display(CellReport(record, request.top if request.top is not None else config.top_variables))
            return
        notable = (
            bool(record.warnings) or record.status == STATUS_OUT_OF_MEMORY or _changed_by(record, config.threshold)
        )
        if notable:
            from gpumem.core.cells.report import CellSummary

            display(CellSummary(record))

    # What the %%gpumem magic asks -----------------------------------------------------------------
    def running_cell_number(self) -> int | None:
        """The execution count of the cell running now, if it is stored in the history."""
        if self._stack and getattr(self._stack[0].info, "store_history", False):
            return int(self.state.shell.execution_count) - 1
        return None

    def cell_header_reached(self, request: CellRequest) -> None:
        """A %%gpumem body starts inside the cell being run: measure that cell as asked, if not yet."""
        if not self._stack:
            return
        outer = self._stack[0]
        if outer.request is not None:
            return
        if outer.active is None:
            source = getattr(outer.info, "raw_cell", "") or ""
            try:
                active = self.state.tracker.begin(
                    source,
                    options=request.options,
                    execution_count=self.running_cell_number(),
                    namespace=self.state.shell.user_ns,
                )
            except (Exception, KeyboardInterrupt) as error:
                self._stack[0] = outer._replace(request=_NOT_MEASURED)
                complain("could not start measuring this cell", error)
                return
            outer = outer._replace(active=active)
        self._stack[0] = outer._replace(request=request, **_recorders_started(request, outer))

    def measure_body(self, request: CellRequest, body: str, run: Callable[[], _T]) -> _T:
        """``%%gpumem`` called as a function: ``run()`` the body, measured as asked.

        Inside a cell already measured (``%%time`` above ``%%gpumem`` in automatic mode) that cell
        is reported with these options instead. The body runs even if measuring cannot start.
        """
        if self._adopt(request):
            return run()
        if not has_code(body):
            _say_nothing_measured(request)
            return run()
        state = self.state
        try:
            cell = state.tracker.begin(
                body, options=request.options, execution_count=self.running_cell_number(), namespace=state.shell.user_ns
            )
        except (Exception, KeyboardInterrupt) as failure:
            complain("could not start measuring this cell", failure)
            return run()  # the user's code runs all the same
        started = _recorders_started(request)
        error: BaseException | None = None
        try:
            return run()
        except BaseException as caught:
            error = caught
            raise
        finally:
            number = self.running_cell_number()
            recorded = _recorders_stopped(started["trace"], started["profile"], number)
            self._finish_body(cell, error, request)
            self._show_recorded(request, number, request.options.quiet, *recorded)

    def _adopt(self, request: CellRequest) -> bool:
        for position, pending in enumerate(self._stack):
            if pending.active is not None:
                self._stack[position] = pending._replace(request=request, **_recorders_started(request, pending))
                return True
        return False

    def _finish_body(self, active: ActiveCell, error: BaseException | None, request: CellRequest) -> None:
        try:
            record = self.state.tracker.end(
                active, error=error, namespace=self.state.shell.user_ns, options=request.options
            )
            self.show(record, request)
        except (Exception, KeyboardInterrupt) as failure:
            complain("could not finish measuring this cell", failure)


def _changed_by(record: CellRecord, threshold: Amount) -> bool:
    """Whether a figure of the cell moved by ``threshold``: a size, or a share of each device's own capacity."""
    if threshold.nbytes is not None:
        return record.largest_change_bytes() >= threshold.nbytes
    for change in record.devices:
        limit = threshold.of(change.total_bytes)
        moved = max(abs(change.allocated_delta_bytes), abs(change.reserved_delta_bytes), change.peak_above_start_bytes)
        if limit is not None and moved >= limit:
            return True
    return False


def has_code(source: str) -> bool:
    """Whether a cell has a line of code: not only blank lines and comments (a cell that runs nothing
    is not measured: its figures would be the sampler's noise, and its history row a blank)."""
    return any(line.strip() and not line.lstrip().startswith("#") for line in source.splitlines())


def _say_nothing_measured(request: CellRequest) -> None:
    if not request.options.quiet:
        print("%%gpumem: nothing measured (the cell has no code below the %%gpumem line)")


def _recorders_started(request: CellRequest, running: _Pending | None = None) -> dict[str, Any]:
    """The cell's --trace recorder and --profile profiler: those already ``running``, else started as asked."""
    return {
        "trace": (running and running.trace) or recorders.start_trace(request.trace),
        "profile": (running and running.profile) or recorders.start_profile(request.profile),
    }


def _recorders_stopped(trace: Any, profile: Any, cell: int | None) -> tuple[Any, Any]:
    """``(snapshot, profile report)``: the profiler stops first, so that its own work stays out of the trace."""
    profiled = recorders.stop_profile(profile, cell)
    return recorders.stop_trace(trace), profiled
