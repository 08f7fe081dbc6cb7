"""The entry points: who holds the memory (:func:`find_holders`), what only cycles hold (:func:`find_cycles`)."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from gpumem.core.diagnoses.device_split import DeviceSplit, device_split
from gpumem.core.gc_pause import collector_paused
from gpumem.core.holders.graphs import GraphWalker, saved_by_graphs
from gpumem.core.holders.hidden import hidden_references, ipython_names
from gpumem.core.holders.hints import array_note, cycle_hint
from gpumem.core.holders.holder_report import HolderReport
from gpumem.core.holders.kinds import kind_totals
from gpumem.core.holders.model import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_ITEMS,
    DEFAULT_TIME_BUDGET_S,
    HIDDEN_RANK,
    TENSORS,
    CycleReport,
    Holder,
)
from gpumem.core.holders.objects import ATOMIC_TYPES, stable_list, type_name
from gpumem.core.holders.ownership import attribute
from gpumem.core.holders.remainder import Remainder, allocator_blocks, split_remainder
from gpumem.core.holders.tensors import DeviceFilter
from gpumem.core.holders.walk import OutOfTimeError, Root, Walker, walk_root
from gpumem.core.readers.devices import parse_device
from gpumem.core.readers.sources import SystemSource
from gpumem.core.readers.torch_state import no_device_reason
from gpumem.core.readers.workspaces import WorkspaceSizes, workspace_sizes
from gpumem.core.runtime import cuda_source, ipython_shell
from gpumem.core.units import format_bytes

__all__ = ["find_cycles", "find_holders"]

_CYCLE_TYPES_KEPT = 8

_REMAINDER_CAUSES = "tensors reachable from no name (closures, C++ objects, other threads, or beyond the walk's limits)"


def find_holders(
    namespace: Mapping[str, Any],
    *,
    device: str | int | None = "cuda",
    shell: Any = None,
    include_hidden: bool = True,
    max_depth: int = DEFAULT_MAX_DEPTH,
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
    max_items: int = DEFAULT_MAX_ITEMS,
    source: Any = None,
    cycles: bool = False,
    names: Iterable[str] | None = None,
) -> HolderReport:
    """Walk ``namespace`` (and, with an IPython ``shell``, its hidden references) for tensor memory.

    ``device`` filters storages: ``"cuda"`` (every CUDA device), ``"cuda:N"``, ``"cpu"`` or ``"all"``.
    ``shell`` defaults to the running IPython shell when ``namespace`` is its user namespace. ``source``
    (a :class:`~gpumem.core.readers.sources.MemorySource`) supplies ``memory_allocated`` for the remainder; it defaults
    to the shared monitor's. ``cycles=True`` runs one garbage collection to find tensors in reference
    cycles (which frees them). ``names`` restricts the walk to those names. Safe while another thread
    changes ``namespace``: it is copied first.
    """
    started = time.perf_counter()
    devices = DeviceFilter(*parse_device(device))
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    cycle_report = find_cycles(device) if cycles else None
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "Tensor"):
        return HolderReport(
            holders=[],
            total_bytes=0,
            hidden=[],
            unattributed=f"{no_device_reason()}, so no tensor can hold memory",
            truncated=False,
            elapsed_s=time.perf_counter() - started,
            device=_device_label(devices),
            torch_loaded=False,
            cycles=cycle_report,
            arrays=array_note(namespace) if names is None else "",
        )
    if shell is None:
        shell = _running_shell(namespace)
    walker = GraphWalker(torch, devices, max_depth, max_items, started + time_budget_s)
    skip = ipython_names(shell) if shell is not None and namespace is getattr(shell, "user_ns", None) else set()
    with collector_paused():
        roots = _walk_namespace(walker, namespace, skip, names, shell if include_hidden else None, time_budget_s)
        saved_per_root, _, graph_notes = saved_by_graphs(torch, walker, roots)
        walker.truncation.extend(graph_notes)
        memory = _memory_readings(source, devices)
        rows = attribute(roots, walker.sizes, walker.incomplete, saved_per_root)
    report = _report(walker, rows, devices, memory, cycles=cycle_report, started=started)
    # numpy arrays are host memory: named where the question is about host memory too.
    wanted = devices.kind != "cuda" and names is None
    return report._replace(arrays=array_note(namespace)) if wanted else report


class _Memory(NamedTuple):
    """What the allocator and NVML say, read once per report."""

    allocated: int | None
    splits: tuple[DeviceSplit, ...] = ()
    numbers: tuple[int, ...] = ()  # the CUDA devices read
    real: bool = False  # read from this process's own torch, so its blocks and workspaces can be read too


def _report(
    walker: GraphWalker,
    rows: list[tuple[bool, Holder]],
    devices: DeviceFilter,
    memory: _Memory,
    *,
    cycles: CycleReport | None,
    started: float,
) -> HolderReport:
    """Rows from what the walk reached, the remainder against ``memory_allocated``, and the kinds."""
    user_rows = [row for hidden, row in rows if not hidden]
    hidden_rows = [row for hidden, row in rows if hidden]
    total = sum(row.nbytes for row in user_rows)
    hidden_total = sum(row.nbytes for row in hidden_rows)
    graph_saved = sum(walker.saved_keys.values())
    remainder = _remainder(walker, memory)
    unattributed_bytes = None if memory.allocated is None else memory.allocated - total - hidden_total
    return HolderReport(
        holders=user_rows,
        total_bytes=total,
        hidden=hidden_rows,
        unattributed=_with_cycle_hint(
            _unattributed_text(devices.kind, memory.allocated, unattributed_bytes, remainder),
            unattributed_bytes,
            remainder,
            cycles,
        ),
        truncated=bool(walker.truncation),
        elapsed_s=time.perf_counter() - started,
        hidden_bytes=hidden_total,
        device=_device_label(devices),
        allocated_bytes=memory.allocated,
        unattributed_bytes=unattributed_bytes,
        truncation=tuple(walker.truncation),
        torch_loaded=True,
        cycles=cycles,
        kinds=kind_totals(user_rows, hidden_total, graph_saved, remainder),
        remainder=remainder,
        device_splits=memory.splits,
        graph_saved_bytes=graph_saved,
    )


def _remainder(walker: GraphWalker, memory: _Memory) -> Remainder | None:
    """The remainder split; blocks and workspace sizes are read only from this process's own torch."""
    if memory.allocated is None:
        return None
    counted = {key: nbytes for key, nbytes in walker.sizes.items() if key[0].startswith("cuda")}
    saved = {key: nbytes for key, nbytes in walker.saved_keys.items() if key[0].startswith("cuda")}
    sizes: dict[str, WorkspaceSizes] = {}
    blocks = None
    if memory.real:
        for number in memory.numbers:
            found = workspace_sizes(number)
            if found is not None:
                sizes[f"cuda:{number}"] = found
        if memory.allocated > sum(counted.values()) + sum(saved.values()):
            blocks = allocator_blocks(memory.numbers)
    return split_remainder(memory.allocated, counted, saved, sizes=sizes, blocks=blocks)


def _walk_namespace(
    walker: Walker,
    namespace: Mapping[str, Any],
    skip: set[str],
    names: Iterable[str] | None,
    shell: Any,
    time_budget_s: float,
) -> list[Root]:
    """One root per user name (then per IPython reference when ``shell`` is given), walked until the budget ends."""
    try:
        items = stable_list(namespace.items)
    except Exception as error:
        items = []
        walker.truncation.append(f"the namespace could not be read ({type(error).__name__}: {error})")
    wanted = set(names) if names is not None else None
    roots: list[Root] = []
    try:
        for order, (name, value) in enumerate(items):
            if type(value) in ATOMIC_TYPES or name in skip or (wanted is not None and name not in wanted):
                continue
            if not isinstance(name, str) or (name.startswith("__") and name.endswith("__")):
                continue
            roots.append(Root(name, type_name(value), order, hidden=False))
            walk_root(walker, roots[-1], (value,), 0)
        if shell is not None:
            for order, ref in enumerate(hidden_references(shell)):
                roots.append(Root(ref.name, type_name(ref.objects[0]), len(items) + order, hidden=True, note=ref.note))
                walk_root(walker, roots[-1], ref.objects, HIDDEN_RANK)
    except OutOfTimeError:
        walker.incomplete.add(id(walker.root))
        walker.truncation.append(f"time budget {time_budget_s:g} s used up; later names were not walked")
    return roots


def _device_label(devices: DeviceFilter) -> str:
    if devices.kind is None:
        return "all"
    return devices.kind if devices.number is None else f"{devices.kind}:{devices.number}"


def _running_shell(namespace: Mapping[str, Any]) -> Any:
    shell = ipython_shell()
    if shell is not None and getattr(shell, "user_ns", None) is namespace:
        return shell
    return None


def _memory_readings(source: Any, devices: DeviceFilter) -> _Memory:
    """PyTorch's ``memory_allocated`` summed over the filtered CUDA devices, and each device's NVML split."""
    if devices.kind not in (None, "cuda"):
        return _Memory(None)
    # This process's own allocator (the default, or the real source a cell tracker passes): its blocks and
    # workspace sizes can be read too. A fake or remote source's figures are not this process's.
    real = source is None or isinstance(source, SystemSource)
    source = cuda_source(source)
    if source is None:
        return _Memory(None)
    try:
        snapshot = source.snapshot(process_memory=True)
    except Exception:
        return _Memory(None)
    readings = [r for r in snapshot.allocator if devices.number is None or r.device == devices.number]
    if not readings:
        return _Memory(None)
    splits = tuple(split for r in readings if (split := device_split(snapshot, r.device)) is not None)
    numbers = tuple(r.device for r in readings)
    return _Memory(int(sum(r.allocated_bytes for r in readings)), splits, numbers, real=real)


def _with_cycle_hint(text: str, unattributed: int | None, split: Remainder | None, cycles: CycleReport | None) -> str:
    """Add the hint that unexplained memory may be cycle-held, unless ``--cycles`` already looked."""
    if cycles is not None or unattributed is None:
        return text
    hint = cycle_hint(split.unexplained_bytes if split is not None else unattributed)
    return f"{text}; {hint}" if hint else text


def _unattributed_text(
    device_kind: str | None, allocated: int | None, remainder: int | None, split: Remainder | None
) -> str:
    if allocated is None or remainder is None:
        if device_kind not in (None, "cuda"):
            return "memory_allocated: n/a (PyTorch counts only CUDA allocations)"
        return f"memory_allocated: unavailable ({no_device_reason()})"
    if remainder < 0:
        return (
            f"named tensors add up to {format_bytes(-remainder)} more than memory_allocated "
            f"({format_bytes(allocated)}): memory changed during the walk"
        )
    text = f"{format_bytes(remainder)} of {format_bytes(allocated)} allocated held by no name"
    if split is None:
        return f"{text}: {_REMAINDER_CAUSES}"
    parts = [
        f"{label} {format_bytes(nbytes)}"
        for label, nbytes in (
            ("saved by autograd graphs", split.graph_saved_bytes),
            ("cuBLAS workspaces" + ("" if split.workspaces_confirmed else " (estimate)"), split.workspace_bytes),
            ("allocator rounding", split.rounding_bytes),
        )
        if nbytes
    ]
    parts.append(f"unexplained {format_bytes(split.unexplained_bytes)}")
    return f"{text}: " + ", ".join(parts)


def find_cycles(device: str | int | None = "cuda") -> CycleReport:
    """Run one collection with ``gc.DEBUG_SAVEALL`` to see the tensors only cycles keep alive.

    The unreachable objects are inspected, then released and collected again: like the next automatic
    collection would, this frees them. Tensors are counted by storage, on the filtered devices.
    """
    devices = DeviceFilter(*parse_device(device))
    torch = sys.modules.get("torch")
    found = _unreachable_objects()
    try:
        counts: dict[str, int] = {}
        for obj in found:
            name = type_name(obj)
            counts[name] = counts.get(name, 0) + 1
        nbytes, tensor_count = _cycle_tensors(torch, devices, found) if torch is not None else (0, 0)
        object_count = len(found)
    finally:
        found.clear()
        del found
        gc.collect()
    ranked = tuple(sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:_CYCLE_TYPES_KEPT])
    return CycleReport(nbytes, tensor_count, object_count, ranked)


def _unreachable_objects() -> list[Any]:
    """What one collection finds unreachable, kept alive (taken out of ``gc.garbage``) for inspection."""
    previous_flags = gc.get_debug()
    start = len(gc.garbage)
    gc.set_debug(previous_flags | gc.DEBUG_SAVEALL)
    try:
        gc.collect()
    finally:
        gc.set_debug(previous_flags)
    found = gc.garbage[start:]
    del gc.garbage[start:]
    return found


def _cycle_tensors(torch: Any, devices: DeviceFilter, found: list[Any]) -> tuple[int, int]:
    """(bytes, tensors) of the tensors among ``found``, storages counted once."""
    walker = Walker(torch, devices, 1, 0, float("inf"))
    root = Root("cycles", "", 0, hidden=False)
    walker.root = root
    for obj in found:
        if isinstance(obj, walker.tensor_type):
            walker.tensor(obj, "", 0, TENSORS)
    return sum(walker.sizes[key] for key in root.reach), len(root.tensor_ids)
