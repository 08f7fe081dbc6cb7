"""Conditions that outlast the cell that caused them: a device nearly full, a fragmented free reserve.

A warning belongs under the cell whose run created or worsened its condition, once: the same
standing condition under every later cell would teach people to stop reading. :class:`ToldConditions`
remembers, per device and kind, the level last told; a cell that worsens it by a step is told again,
and a condition that went away is forgotten. What holds right now, told or not, is
:func:`standing_conditions` (``%gpumem status``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from gpumem.core.cells.record import CellWarning, DeviceChange, HeldVariable
from gpumem.core.cells.warnings import graph_warning, output_cache_warning
from gpumem.core.diagnoses.fragmentation import (
    FreeReserve,
    ReserveReader,
    allocator_counters,
    empty_cache_advice,
    expandable_segments_advice,
    expandable_segments_on,
    fragmentation_text,
    worth_a_look,
)
from gpumem.core.readers.sources import AllocatorReading, DeviceReading, Snapshot
from gpumem.core.units import GIB, MIB, format_bytes

__all__ = [
    "Condition",
    "ToldConditions",
    "capacity_condition",
    "device_warnings",
    "fragmentation_condition",
    "standing_conditions",
]

_CAPACITY_STEP_SHARE = 100  # told again once used memory rose by 1 % of the device since the last warning
_FRAGMENTATION_STEP = GIB  # ... or the unusable free reserve by 1 GiB
_AFTER_CELL = "after this cell"


class Condition(NamedTuple):
    """Something that holds now and that the user should act on."""

    kind: str  # "capacity", "fragmentation", "graph", "output-cache"
    device: int | None
    level_bytes: int  # how bad: used bytes (capacity), unusable free reserve (fragmentation)
    message: str


class ToldConditions:
    """Per (kind, device), the level of the condition when the user was last told of it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._told: dict[tuple[str, int], int] = {}

    def tell(
        self, kind: str, device: int, condition: Condition | None, *, step: int, caused: bool, event: bool = False
    ) -> bool:
        """Whether to warn of ``condition`` (None: it does not hold) under a cell; ``caused``: the cell
        changed what the condition is measured from; ``event``: the condition struck in the cell (an
        allocation had to retry or failed), told whatever its level. A condition first seen under a
        cell that did not cause it is remembered as standing, not told."""
        key = (kind, device)
        if condition is None and key not in self._told:
            return False  # the usual case, decided without the lock: nothing held, nothing to forget
        with self._lock:
            if condition is None:
                self._told.pop(key, None)
                return False
            told = self._told.get(key)
            if told is None:
                self._told[key] = condition.level_bytes
                return caused
            if event or (caused and condition.level_bytes >= told + step):
                self._told[key] = max(told, condition.level_bytes)
                return True
            return False

    def clear(self) -> None:
        with self._lock:
            self._told.clear()


def capacity_condition(reading: DeviceReading | None, fraction: float, when: str = _AFTER_CELL) -> Condition | None:
    """The device is at least ``fraction`` full (NVML: every process's memory)."""
    if reading is None or reading.total_bytes <= 0:
        return None
    used = reading.used_bytes / reading.total_bytes
    if used < fraction:
        return None
    return Condition(
        "capacity",
        reading.device,
        reading.used_bytes,
        f"cuda:{reading.device} is {used:.0%} full {when} ({format_bytes(reading.used_bytes)} of "
        f"{format_bytes(reading.total_bytes)} used, all processes); `%gpumem who` lists what holds it",
    )


def fragmentation_condition(reserve: FreeReserve | None, retries: int = 0) -> Condition | None:
    """Much of the free reserve is in pieces no larger request can use.

    See :mod:`gpumem.core.diagnoses.fragmentation`.
    """
    if reserve is None or not reserve.fragmented:
        return None
    parts = [f"cuda:{reserve.device}: {fragmentation_text(reserve)}"]
    if retries > 0:
        allocations = "1 allocation" if retries == 1 else f"{retries:,} allocations"
        parts.append(
            f"{allocations} in this cell found no free piece large enough and made PyTorch return its cache "
            "to the device and retry"
        )
    parts.append(empty_cache_advice(reserve))
    if not (reserve.expandable or expandable_segments_on()):
        parts.append(expandable_segments_advice())
    return Condition("fragmentation", reserve.device, reserve.unusable_bytes, "; ".join(parts))


def device_warnings(
    devices: Sequence[DeviceChange],
    start: Snapshot,
    end: Snapshot,
    capacity_fraction: float,
    told: ToldConditions,
    reserves: ReserveReader,
    source: object,
) -> list[CellWarning]:
    """Per device in the cell: nearly full, then fragmented, each told when this cell caused or worsened it.

    The allocator's segments are read only for devices whose counters allow fragmentation, and at
    most once per change of those counters (:class:`~gpumem.core.diagnoses.fragmentation.ReserveReader`).
    """
    warnings: list[CellWarning] = []
    for change in devices:
        reading = end.device_for(change.device)
        condition = capacity_condition(reading, capacity_fraction)
        step = reading.total_bytes // _CAPACITY_STEP_SHARE if reading is not None else 0
        grew = (change.used_delta_bytes or 0) > 0
        if told.tell("capacity", change.device, condition, step=max(step, MIB), caused=grew) and condition is not None:
            warnings.append(CellWarning("capacity", condition.message))
    looked: dict[int, tuple[AllocatorReading | None, AllocatorReading]] = {}
    for change in devices:
        after = end.allocator_for(change.device)
        if after is None:
            continue
        before = start.allocator_for(change.device)
        if worth_a_look(before, after):
            looked[change.device] = (before, after)
        else:
            told.tell("fragmentation", change.device, None, step=_FRAGMENTATION_STEP, caused=False)
    found = reserves.read(source, [after for _before, after in looked.values()]) if looked else {}
    for device, (before, after) in looked.items():
        if device not in found:
            continue  # the segments could not be read: nothing is known, nothing is said or forgotten
        retries = after.num_alloc_retries - before.num_alloc_retries if before is not None else 0
        failed = before is not None and after.num_ooms > before.num_ooms
        condition = fragmentation_condition(found[device], retries)
        caused = before is None or allocator_counters(before) != allocator_counters(after)
        struck = retries > 0 or failed
        tell = told.tell("fragmentation", device, condition, step=_FRAGMENTATION_STEP, caused=caused, event=struck)
        if tell and condition is not None:
            warnings.append(CellWarning("fragmentation", condition.message))
    return warnings


def standing_conditions(
    snapshot: Snapshot | None,
    capacity_fraction: float,
    reserves: ReserveReader,
    source: object,
    held: Iterable[HeldVariable] = (),
) -> list[Condition]:
    """What holds now, whether or not a cell warned of it: devices nearly full or fragmented (from
    ``snapshot``; None when it could not be read), and the names in ``held`` (a holders walk) that keep
    autograd graphs or IPython's output cache alive."""
    conditions: list[Condition] = []
    for reading in snapshot.devices if snapshot is not None else ():
        capacity = capacity_condition(reading, capacity_fraction, when="now")
        if capacity is not None:
            conditions.append(capacity)
    looked = [reading for reading in snapshot.allocator if worth_a_look(None, reading)] if snapshot else []
    found: Mapping[int, FreeReserve] = reserves.read(source, looked) if looked else {}
    for reserve in found.values():
        fragmented = fragmentation_condition(reserve)
        if fragmented is not None:
            conditions.append(fragmented)
    rows = list(held)
    paths = [path for row in sorted(rows, key=lambda r: -r.nbytes) for path in row.graph_paths]
    if paths:
        conditions.append(Condition("graph", None, 0, graph_warning(paths).message))
    cached = [row.name for row in rows if row.hidden and row.nbytes]
    if cached:
        conditions.append(Condition("output-cache", None, 0, output_cache_warning(cached).message))
    return conditions
