"""Give memory back: ``gc.collect``, then ``empty_cache``; ``deep`` first drops IPython's own references.

What ``deep=True`` releases, precisely (and nothing else):

- output-cache entries whose value reaches tensor memory (any device): ``Out[N]`` / ``_oh[N]``, the
  ``_N`` name and its copy in ``user_ns_hidden``, and ``_`` / ``__`` / ``___`` (reset to ``''`` in the
  namespace, its hidden copy and the display hook, as ``%reset out`` does) when they point to such a
  value; ``shell.last_execution_result.result`` likewise. Entries without tensors stay in ``Out``.
- the last exception's frames: the traceback is detached from the exception (and its ``__cause__`` /
  ``__context__`` chain), ``sys.last_traceback`` and ``shell.InteractiveTB.tb`` are cleared. The
  exception object itself stays (``sys.last_value`` still says what failed; ``%tb`` / ``%debug`` can no
  longer show its frames). If the exception object itself holds tensors (in its arguments), the
  references to it are dropped as well.

``workspaces=True`` also releases the cuBLAS(Lt) workspaces PyTorch keeps for matmuls (32 MiB per handle
and stream on an H200): the next matmul on each stream allocates its workspace again, so it only helps
when memory is needed for something else now.

It never deletes or rebinds a user's own name. A value that a user name also holds (``x = Out[3]``)
stays alive through that name and the result says so. An exception object a user name holds is not
modified. Called from another thread while a cell runs (a widget callback during training) it leaves the
output cache and its names alone (reported as kept: run it again once the cell is done) and only detaches
the last exception's frames.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

from gpumem.core.holders import find_holders, hidden_references
from gpumem.core.holders.objects import stable_list
from gpumem.core.readers.cuda_fault import cuda_faults, record_fault, status_text
from gpumem.core.readers.workspaces import CLEAR_CALL, clear_cublas_workspaces
from gpumem.core.runtime import ipython_shell
from gpumem.core.units import format_bytes, format_delta

__all__ = [
    "DeviceReclaim",
    "FreeResult",
    "cell_running",
    "describe_one_line",
    "device_reclaim_text",
    "empty_cache",
    "free",
    "free_lock",
    "release_last_exception",
    "release_output",
]

_free_lock = threading.Lock()
free_lock = _free_lock  # held by every free and reclaim action (gpumem.core.reclaim): one at a time
_OUTPUT_ALIASES = ("_", "__", "___")
_MAX_CHAINED_EXCEPTIONS = 64


class DeviceReclaim(NamedTuple):
    """PyTorch allocator counters of one CUDA device before and after a free."""

    device: int
    allocated_before_bytes: int
    allocated_after_bytes: int
    reserved_before_bytes: int
    reserved_after_bytes: int

    @property
    def allocated_reclaimed_bytes(self) -> int:
        return self.allocated_before_bytes - self.allocated_after_bytes

    @property
    def reserved_reclaimed_bytes(self) -> int:
        return self.reserved_before_bytes - self.reserved_after_bytes


class FreeResult(NamedTuple):
    """What :func:`free` did and what it gave back, per device."""

    devices: tuple[DeviceReclaim, ...]
    deep: bool
    released: tuple[str, ...]  # IPython references dropped ("Out[3]", "_3", "sys.last_traceback", ...)
    kept: tuple[str, ...]  # references found but left alone, with why ("_3: ...")
    collected_objects: int  # what gc.collect reported
    elapsed_s: float
    note: str = ""
    workspaces: bool = False  # the cuBLAS workspaces were released (asked for, and CUDA was initialized)

    @property
    def allocated_reclaimed_bytes(self) -> int:
        return sum(d.allocated_reclaimed_bytes for d in self.devices)

    @property
    def reserved_reclaimed_bytes(self) -> int:
        return sum(d.reserved_reclaimed_bytes for d in self.devices)

    def describe(self) -> str:
        """Plain text: per device, then the references released and kept."""
        objects = f"{self.collected_objects} object{'' if self.collected_objects == 1 else 's'}"
        lines = [f"gpumem free{' --deep' if self.deep else ''}: gc collected {objects}"]
        lines.extend(f"  {device_reclaim_text(d)}" for d in self.devices)
        if self.note:
            lines.append(f"  {self.note}")
        if self.workspaces:
            lines.append(f"  {WORKSPACES_RELEASED}")
        if self.released:
            lines.append("  released IPython references: " + ", ".join(self.released))
        elif self.deep:
            lines.append("  no IPython reference held tensor memory")
        lines.extend(f"  kept {item}" for item in self.kept)
        if not self.deep and self.kept:
            lines.append("  run `%gpumem free --deep` (or gpumem.free(deep=True)) to release IPython's references")
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, _cycle: bool) -> None:
        printer.text(self.describe())


WORKSPACES_RELEASED = (
    f"released the cuBLAS workspaces ({CLEAR_CALL}): the next matmul on each stream allocates its workspace again"
)


def free(deep: bool = False, shell: Any = None, source: Any = None, *, workspaces: bool = False) -> FreeResult:
    """``gc.collect()`` then ``empty_cache()``; with ``deep``, first drop IPython's references to tensors.

    ``workspaces`` also releases PyTorch's cuBLAS(Lt) workspaces before ``empty_cache`` (the next matmul
    re-allocates them).

    Safe to call from any thread, also while a cell runs (calls are serialized by a lock). ``source`` is a
    :class:`~gpumem.core.readers.sources.MemorySource` (the shared monitor's by default); ``shell`` defaults to the
    running IPython shell.
    """
    started = time.perf_counter()
    with _free_lock:
        if source is None:
            from gpumem.core.monitoring.monitor import default_monitor

            source = default_monitor().source
        if shell is None:
            shell = ipython_shell()
        before = _allocator_readings(source)
        released: list[str] = []
        kept: list[str] = []
        if deep and shell is not None:
            on_main_thread = threading.current_thread() is threading.main_thread()
            editable = on_main_thread or not _cell_running(shell)
            _drop_ipython_references(shell, released, kept, edit_output_cache=editable)
        elif shell is not None:
            kept.extend(_hidden_summary(shell))
        collected = gc.collect()
        cleared = workspaces and not cuda_faults() and _clear_workspaces()
        note = _empty_cache(source)
        after = _allocator_readings(source)
        devices = tuple(
            DeviceReclaim(
                device=index,
                allocated_before_bytes=before[index][0],
                allocated_after_bytes=after[index][0],
                reserved_before_bytes=before[index][1],
                reserved_after_bytes=after[index][1],
            )
            for index in sorted(set(before) & set(after))
        )
        if not devices and not note:
            note = "no CUDA device is initialized in this process: nothing to return to the driver"
        if deep and shell is None:
            note = (note + "; " if note else "") + "no IPython shell: there were no IPython references to drop"
        if workspaces and not cleared and not cuda_faults():
            note = (note + "; " if note else "") + "no cuBLAS workspace to release (CUDA is not initialized)"
    elapsed = time.perf_counter() - started
    result = FreeResult(devices, deep, tuple(released), tuple(kept), collected, elapsed, note, workspaces=cleared)
    _mark_timeline(source, result)
    return result


def empty_cache(source: Any) -> str:
    """``source.empty_cache()`` unless CUDA is in an error state; what went wrong, or ""."""
    return _empty_cache(source)


def _empty_cache(source: Any) -> str:
    """``empty_cache()`` unless CUDA is in an error state (:mod:`gpumem.core.readers.cuda_fault`).

    Returns what went wrong, or "".
    """
    if not cuda_faults():
        try:
            source.empty_cache()
        except Exception as error:
            if record_fault(error, None) is None:
                return f"empty_cache failed: {error}"
        else:
            return ""
    faults = "; ".join(status_text(fault) for fault in cuda_faults().values())
    return f"CUDA could not be emptied: {faults}"


def _clear_workspaces() -> bool:
    torch = sys.modules.get("torch")
    try:
        return torch is not None and clear_cublas_workspaces(torch)
    except Exception:
        return False


def cell_running(shell: Any) -> bool:
    """Whether ``shell`` is executing a cell now."""
    return _cell_running(shell)


def release_output(shell: Any, value: Any, label: str, *, aliases: bool = True) -> tuple[list[str], list[str]]:
    """Drop IPython's output-cache references to ``value``: ``(released, kept)``.

    Without ``aliases`` only ``Out[N]`` and its ``_N`` are popped (safe while a cell runs and the display
    hook may move ``_`` / ``__`` / ``___``); those and the last result are left.
    """
    released: list[str] = []
    kept: list[str] = []
    if aliases:
        _drop_output(shell, value, label, released, kept)
        return released, kept
    dropped = _drop_output_entries(shell.user_ns, getattr(shell, "user_ns_hidden", {}), value)
    if dropped:
        released.append(" ".join(dropped) if len(dropped) == 1 else f"{dropped[0]} ({', '.join(dropped[1:])})")
    return released, kept


def release_last_exception(shell: Any) -> tuple[list[str], list[str]]:
    """Detach the last exception's frames (and drop it where it holds tensors itself): ``(released, kept)``."""
    released: list[str] = []
    kept: list[str] = []
    _drop_last_exception(shell, released, kept)
    return released, kept


def _cell_running(shell: Any) -> bool:
    """IPython points its display hook at the current ExecutionResult only while a cell executes."""
    return getattr(getattr(shell, "displayhook", None), "exec_result", None) is not None


def _allocator_readings(source: Any) -> dict[int, tuple[int, int]]:
    try:
        snapshot = source.snapshot()
    except Exception:
        return {}
    return {r.device: (r.allocated_bytes, r.reserved_bytes) for r in snapshot.allocator}


def _mark_timeline(source: Any, result: FreeResult) -> None:
    from gpumem.core.monitoring.monitor import default_monitor

    monitor = default_monitor()
    if monitor.source is source:
        label = "free --deep" if result.deep else "free"
        if result.devices:
            label += f" {format_delta(-result.reserved_reclaimed_bytes)}"
        monitor.mark(label)


def _hidden_summary(shell: Any) -> list[str]:
    """Without ``deep``: which IPython references hold tensors (so the result can say what deep would do)."""
    report = _hidden_report(shell)
    if report is None:
        return []
    return [f"{row.name}: {format_bytes(row.nbytes)} held by IPython" for row in report.hidden if row.nbytes]


def _hidden_report(shell: Any) -> Any:
    """The holder walk of the shell's namespace on every device (None without a namespace or torch)."""
    user_ns = getattr(shell, "user_ns", None)
    if not isinstance(user_ns, dict) or sys.modules.get("torch") is None:
        return None
    return find_holders(user_ns, device="all", shell=shell, max_depth=8, time_budget_s=2.0)


def _drop_ipython_references(shell: Any, released: list[str], kept: list[str], *, edit_output_cache: bool) -> None:
    report = _hidden_report(shell)
    if report is None:
        return
    rows = {row.name: row for row in report.hidden}
    for ref in hidden_references(shell):
        row = rows.get(ref.name)
        if row is None:
            continue  # reaches no tensor memory: left in place
        count = len(released)
        if ref.name.startswith("Out[") or ref.name in (*_OUTPUT_ALIASES, "last result"):
            if not edit_output_cache:
                kept.append(f"{ref.name}: a cell is running, so the output cache and its names are left as they are")
                continue
            _drop_output(shell, ref.objects[0], ref.name, released, kept)
        else:
            _drop_last_exception(shell, released, kept)
        if not row.nbytes and len(released) > count:
            released[-1] += f" (its memory is still held by {', '.join(row.shared_with[:3])})"


def _drop_output(shell: Any, value: Any, label: str, released: list[str], kept: list[str]) -> None:
    """Remove every reference IPython's output cache keeps to ``value``."""
    user_ns: dict[str, Any] = shell.user_ns
    hidden_ns: dict[str, Any] = getattr(shell, "user_ns_hidden", {})
    displayhook = getattr(shell, "displayhook", None)
    dropped = _drop_output_entries(user_ns, hidden_ns, value)
    dropped.extend(_reset_output_aliases(user_ns, hidden_ns, displayhook, value))
    if _drop_execution_result(shell, displayhook, value):
        dropped.append("last result")
    if dropped:
        released.append(" ".join(dropped) if len(dropped) == 1 else f"{dropped[0]} ({', '.join(dropped[1:])})")
    elif label:
        kept.append(f"{label}: no reference left to drop")


def _drop_output_entries(user_ns: dict[str, Any], hidden_ns: dict[str, Any], value: Any) -> list[str]:
    """``Out[N]`` entries holding ``value``, and their ``_N`` names (popped: another thread may be there first)."""
    out = user_ns.get("_oh")
    if not isinstance(out, dict):
        return []
    dropped: list[str] = []
    for number in [n for n, v in stable_list(out.items) if v is value]:
        out.pop(number, None)
        dropped.append(f"Out[{number}]")
        name = f"_{number}"
        if hidden_ns.get(name) is value:
            hidden_ns.pop(name, None)
        if user_ns.get(name) is value:
            user_ns.pop(name, None)
            dropped.append(name)
    return dropped


def _reset_output_aliases(
    user_ns: dict[str, Any], hidden_ns: dict[str, Any], displayhook: Any, value: Any
) -> list[str]:
    """``_`` / ``__`` / ``___`` set to ``''`` where IPython made them point to ``value`` (as ``%reset out`` does)."""
    dropped: list[str] = []
    for name in _OUTPUT_ALIASES:
        if hidden_ns.get(name) is not value and getattr(displayhook, name, None) is not value:
            continue
        if user_ns.get(name) is value:
            user_ns[name] = ""
        if hidden_ns.get(name) is value:
            hidden_ns[name] = ""
        if displayhook is not None and getattr(displayhook, name, None) is value:
            setattr(displayhook, name, "")
        dropped.append(name)
    return dropped


def _drop_execution_result(shell: Any, displayhook: Any, value: Any) -> bool:
    """Clear ``result`` of the last (and the running) ExecutionResult where it is ``value``."""
    dropped = False
    for owner in (getattr(shell, "last_execution_result", None), getattr(displayhook, "exec_result", None)):
        if owner is not None and getattr(owner, "result", None) is value:
            owner.result = None
            dropped = True
    return dropped


def _drop_last_exception(shell: Any, released: list[str], kept: list[str]) -> None:
    """Detach the last exception's traceback (its frames hold the locals); keep the exception itself."""
    user_ns: dict[str, Any] = getattr(shell, "user_ns", {})
    user_values = {id(value) for value in stable_list(user_ns.values)}
    exceptions = _exception_chain(
        value
        for value in (
            getattr(sys, "last_value", None),
            getattr(sys, "last_exc", None),
            getattr(getattr(shell, "last_execution_result", None), "error_in_exec", None),
        )
        if isinstance(value, BaseException)
    )
    dropped = _detach_tracebacks(exceptions, user_values, kept)
    dropped.extend(_clear_traceback_references(shell, user_values, kept))
    if _exception_holds_tensors(exceptions):
        dropped.extend(_clear_exception_references(shell, user_values))
    if dropped:
        released.append("last exception (" + ", ".join(dropped) + ")")


def _detach_tracebacks(exceptions: list[BaseException], user_values: set[int], kept: list[str]) -> list[str]:
    """Set ``__traceback__`` to None on the chain's exceptions that no user name holds."""
    detached = False
    for error in exceptions:
        if id(error) in user_values:
            kept.append(f"{type(error).__name__}: the exception is also a user variable, its frames stay")
        elif error.__traceback__ is not None:
            error.__traceback__ = None
            detached = True
    return ["exception traceback"] if detached else []


def _clear_traceback_references(shell: Any, user_values: set[int], kept: list[str]) -> list[str]:
    dropped: list[str] = []
    last_tb = getattr(sys, "last_traceback", None)
    if last_tb is not None:
        if id(last_tb) in user_values:
            kept.append("sys.last_traceback: the traceback is also a user variable")
        else:
            sys.last_traceback = None
            dropped.append("sys.last_traceback")
    interactive_tb = getattr(shell, "InteractiveTB", None)
    if interactive_tb is not None and getattr(interactive_tb, "tb", None) is not None:
        interactive_tb.tb = None
        dropped.append("shell.InteractiveTB.tb")
    return dropped


def _clear_exception_references(shell: Any, user_values: set[int]) -> list[str]:
    """Drop the references to exception objects that hold tensors themselves (in their arguments)."""
    dropped: list[str] = []
    for name in ("last_value", "last_exc"):
        if getattr(sys, name, None) is not None and id(getattr(sys, name)) not in user_values:
            setattr(sys, name, None)
            dropped.append(f"sys.{name}")
    last = getattr(shell, "last_execution_result", None)
    if last is not None and getattr(last, "error_in_exec", None) is not None:
        last.error_in_exec = None
        dropped.append("last_execution_result.error_in_exec")
    return dropped


def _exception_chain(roots: Iterable[BaseException]) -> list[BaseException]:
    seen: dict[int, BaseException] = {}
    stack = list(roots)
    while stack and len(seen) < _MAX_CHAINED_EXCEPTIONS:
        error = stack.pop()
        if id(error) in seen:
            continue
        seen[id(error)] = error
        stack.extend(linked for linked in (error.__cause__, error.__context__) if linked is not None)
        members = getattr(error, "exceptions", None)
        if isinstance(members, tuple):
            stack.extend(member for member in members if isinstance(member, BaseException))
    return list(seen.values())


def _exception_holds_tensors(exceptions: list[BaseException]) -> bool:
    """Whether the exception objects themselves (their args and attributes, frames already detached) hold tensors."""
    torch = sys.modules.get("torch")
    if torch is None or not exceptions:
        return False
    namespace = {f"e{index}": error for index, error in enumerate(exceptions)}
    report = find_holders(namespace, device="all", include_hidden=False, max_depth=6)
    return report.total_bytes > 0


def device_reclaim_text(reclaim: DeviceReclaim) -> str:
    """One device's part of a free, in every text of it: allocated and reserved, before -> after (change)."""
    return (
        f"cuda:{reclaim.device} allocated {format_bytes(reclaim.allocated_before_bytes)} \u2192 "
        f"{format_bytes(reclaim.allocated_after_bytes)} ({format_delta(-reclaim.allocated_reclaimed_bytes)}), "
        f"reserved {format_bytes(reclaim.reserved_before_bytes)} \u2192 "
        f"{format_bytes(reclaim.reserved_after_bytes)} ({format_delta(-reclaim.reserved_reclaimed_bytes)})"
    )


def describe_one_line(result: FreeResult, *, host_rss_freed_bytes: int | None = None, deep_hint: str = "") -> str:
    """:meth:`FreeResult.describe` in one line, for narrow places (the panel's message).

    ``host_rss_freed_bytes`` is the caller's own measurement around the free; ``deep_hint`` follows
    the references kept when ``deep`` was off (it says how the caller's interface turns it on).
    """
    parts = [device_reclaim_text(d) for d in result.devices]
    if host_rss_freed_bytes is not None:
        parts.append(f"host RSS {format_delta(-host_rss_freed_bytes)}")
    parts.append(f"gc collected {result.collected_objects} object{'' if result.collected_objects == 1 else 's'}")
    if result.released:
        parts.append("released " + ", ".join(result.released))
    if result.kept:
        shown = 3
        held = "; ".join(result.kept[:shown]) + ("; \u2026" if len(result.kept) > shown else "")
        parts.append(f"IPython still holds {held}" + ("" if result.deep else deep_hint))
    if result.workspaces:
        parts.append("released the cuBLAS workspaces (the next matmul allocates them again)")
    if result.note:
        parts.append(result.note)
    return "; ".join(parts)
