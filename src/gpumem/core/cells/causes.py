"""The conditions that stand now, each with the measured cell that caused it and what to do about it.

The panel lists them under its cells: IPython holding tensor memory (``Out[N]``, the last exception), a
name keeping an autograd graph alive, a device nearly full. Everything comes from what is already known:
a holders walk (:class:`~gpumem.core.cells.record.HeldVariable` rows), the devices' readings, and the
measured cells' records (their warnings). A condition is found afresh each time, so one that no longer
holds is simply not listed; one line per condition, never repeated.

The cell named is the oldest measured cell whose report warned of that very condition (the name, the
``Out`` entry, the device); failing that, what is known for certain: ``Out[N]`` is cell ``[N]``'s result
and the last exception was raised by the newest cell that failed. Otherwise no cell is named.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

from gpumem.core.cells.conditions import capacity_condition
from gpumem.core.cells.record import CellRecord, HeldVariable
from gpumem.core.readers.readings import DeviceReading
from gpumem.core.units import format_bytes

__all__ = ["CAPACITY_FRACTION", "StandingCondition", "standing_by_cell"]

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
