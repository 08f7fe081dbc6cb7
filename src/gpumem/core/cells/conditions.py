"""Conditions that outlast the cell that caused them: a device nearly full, a fragmented free reserve; and
those that stand now, each with the measured cell that caused it (:func:`standing_by_cell`, for the panel).

A warning belongs under the cell whose run created or worsened its condition, once: the same
standing condition under every later cell would teach people to stop reading. :class:`ToldConditions`
remembers, per device and kind, the level last told; a cell that worsens it by a step is told again,
and a condition that went away is forgotten. What holds right now, told or not, is
:func:`standing_conditions` (``%gpumem status``).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

from gpumem.core.cells.record import CellRecord, CellWarning, DeviceChange, HeldVariable
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
from gpumem.core.readers.readings import DeviceReading
from gpumem.core.readers.sources import AllocatorReading, Snapshot
from gpumem.core.units import GIB, MIB, format_bytes

__all__ = [
    "CAPACITY_FRACTION",
    "Condition",
    "StandingCondition",
    "ToldConditions",
    "capacity_condition",
    "device_warnings",
    "fragmentation_condition",
    "standing_by_cell",
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


# The conditions that stand now, each with the measured cell that caused it and what to do about it.
#
# The panel lists them under its cells: IPython holding tensor memory (``Out[N]``, the last exception), a
# name keeping an autograd graph alive, a device nearly full. Everything comes from what is already known:
# a holders walk (:class:`~gpumem.core.cells.record.HeldVariable` rows), the devices' readings, and the
# measured cells' records (their warnings). A condition is found afresh each time, so one that no longer
# holds is simply not listed; one line per condition, never repeated.
#
# The cell named is the oldest measured cell whose report warned of that very condition (the name, the
# ``Out`` entry, the device); failing that, what is known for certain: ``Out[N]`` is cell ``[N]``'s result
# and the last exception was raised by the newest cell that failed. Otherwise no cell is named.
CAPACITY_FRACTION = 0.9  # "near full", as the cell tracker's default warns of it
_OUT = re.compile(r"^Out\[(\d+)\]$")
_EXCEPTION = "last exception"


class StandingCondition(NamedTuple):
    """One condition that holds now."""

    kind: str  # "output-cache", "exception", "graph", "capacity"
    subject: str  # what it is about: "Out[3]", a name, "cuda:0"
    text: str  # "IPython holds 256.0 MiB in Out[3]"
    cell: str  # "cell [3]" (the cell that caused it), or "" when no measured cell is known to have
    advice: str  # what to do, in words


def standing_by_cell(
    held: Sequence[HeldVariable],
    devices: Sequence[DeviceReading],
    records: Sequence[CellRecord],
    capacity_fraction: float = CAPACITY_FRACTION,
) -> list[StandingCondition]:
    """The conditions ``held`` (a holders walk) and ``devices`` show now, each with its cell among ``records``."""
    found = [_hidden_condition(row, records) for row in held if row.hidden and row.nbytes > 0]
    for row in held:
        if not row.hidden and row.graph_paths:
            path = re.compile(rf"`{re.escape(row.name)}[`\[.]")  # `x`, `x[0]`, `x.attr`: not `xy`
            cell = _first_warning(records, "graph", path.search)
            advice = f"store `.item()` for a number or `.detach()` for a tensor; or unbind {row.name}"
            found.append(StandingCondition("graph", row.name, f"{row.name} keeps an autograd graph alive",
                                           cell, advice))  # fmt: skip
    for reading in devices:
        condition = capacity_condition(reading, capacity_fraction, when="now")
        if condition is not None:
            subject = f"cuda:{reading.device}"
            used = f"{subject} is {reading.used_bytes / reading.total_bytes:.0%} full"
            cell = _first_warning(records, "capacity", re.compile(rf"^{re.escape(subject)} ").match)
            found.append(StandingCondition("capacity", subject, used, cell, "free what holds it (listed above)"))
    return found


def _hidden_condition(row: HeldVariable, records: Sequence[CellRecord]) -> StandingCondition:
    text = f"IPython holds {format_bytes(row.nbytes)} in {row.name}"
    if row.name.startswith(_EXCEPTION):
        cell = _newest(records, lambda record: record.error is not None)
        return StandingCondition("exception", row.name, text, cell, "drop the last exception's frames")
    cell = _first_warning(records, "output-cache", re.compile(rf"\b{re.escape(row.name)}(?![\w\[])").search)
    number = _OUT.match(row.name)
    if not cell and number is not None:
        cell = f"cell [{number.group(1)}]"  # Out[N] is cell N's result, measured or not
    return StandingCondition("output-cache", row.name, text, cell, f"release {row.name}")


def _first_warning(records: Sequence[CellRecord], kind: str, mentions: Callable[[str], object]) -> str:
    """The oldest record with a warning of ``kind`` whose message ``mentions`` it, as "cell [N]"; "" for none."""
    for record in sorted(records, key=lambda record: record.serial):
        if any(warning.kind == kind and mentions(warning.message) for warning in record.warnings):
            return _cell_label(record)
    return ""


def _newest(records: Sequence[CellRecord], wanted: Callable[[CellRecord], bool]) -> str:
    chosen = [record for record in records if wanted(record)]
    return _cell_label(max(chosen, key=lambda record: record.serial)) if chosen else ""


def _cell_label(record: CellRecord) -> str:
    number = record.execution_count
    return f"cell [{number}]" if number is not None else f"measured cell #{record.serial}"
