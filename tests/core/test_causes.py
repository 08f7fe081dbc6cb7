"""Which measured cell caused each standing condition, and what fixes it (the panel's "Standing now")."""

from __future__ import annotations

from gpumem.core.cells.conditions import standing_by_cell
from gpumem.core.cells.record import STATUS_ERROR, STATUS_OK, CellRecord, CellWarning, HeldVariable
from gpumem.core.readers.readings import DeviceReading
from gpumem.testing import GIB, MIB


def _record(
    serial: int, count: int | None, warnings: tuple[CellWarning, ...] = (), *, failed: bool = False
) -> CellRecord:
    return CellRecord(
        serial=serial, execution_count=count, first_line="x", source_hash="0" * 16, started_wall_s=0.0,
        duration_s=0.1, status=STATUS_ERROR if failed else STATUS_OK, error="ValueError: no" if failed else None,
        devices=(), host=None, variables=(), variables_note="", warnings=warnings, cuda_note=None,
        keep_peaks=False, mode="magic", quiet=False,
    )  # fmt: skip


def _held(name: str, nbytes: int, *, hidden: bool = False, paths: tuple[str, ...] = ()) -> HeldVariable:
    return HeldVariable(name, "Tensor", "cuda:0", nbytes, paths, hidden)


def test_each_condition_names_the_oldest_cell_that_warned_of_it_and_no_other() -> None:
    graph = CellWarning("graph", "`loss` keeps its whole autograd graph alive: store `.item()`")
    records = [
        _record(1, 4, (CellWarning("graph", "`lossy` keeps its whole autograd graph alive"),)),
        _record(2, 5, (graph,)),
        _record(3, 6, (graph, CellWarning("output-cache", "IPython keeps references to Out[6]: end the cell"))),
        _record(4, 7, (CellWarning("capacity", "cuda:0 is 95% full after this cell (76 GiB of 80 GiB used)"),)),
        _record(5, 8, (CellWarning("capacity", "cuda:0 is 97% full after this cell"),)),
    ]
    held = [
        _held("loss", 0, paths=("loss",)),
        _held("Out[6]", 256 * MIB, hidden=True),
        _held("Out[60]", MIB, hidden=True),
    ]
    full = DeviceReading(
        device=0, total_bytes=80 * GIB, used_bytes=76 * GIB, free_bytes=4 * GIB, process_used_bytes=None
    )
    found = standing_by_cell(held, [full], records)
    assert [(c.kind, c.subject, c.cell) for c in found] == [
        ("output-cache", "Out[6]", "cell [6]"),
        ("output-cache", "Out[60]", "cell [60]"),  # no report warned of it: Out[60] is cell [60]'s result
        ("graph", "loss", "cell [5]"),  # the oldest warning naming `loss`, not `lossy`'s
        ("capacity", "cuda:0", "cell [7]"),  # raised by cell [7], told again at [8]: listed once
    ]
    assert found[0].text == "IPython holds 256.0 MiB in Out[6]"
    assert found[3].text == "cuda:0 is 95% full"


def test_what_no_longer_holds_is_not_listed() -> None:
    records = [_record(1, 2, (CellWarning("output-cache", "IPython keeps references to Out[2]"),))]
    roomy = DeviceReading(
        device=0, total_bytes=80 * GIB, used_bytes=40 * GIB, free_bytes=40 * GIB, process_used_bytes=None
    )
    assert standing_by_cell([_held("Out[2]", 0, hidden=True), _held("x", 5)], [roomy], records) == []


def test_the_last_exception_is_the_newest_failed_cells() -> None:
    records = [_record(1, 3, failed=True), _record(2, 4), _record(3, None, failed=True), _record(4, 9)]
    (found,) = standing_by_cell([_held("last exception (ValueError)", 2 * MIB, hidden=True)], [], records)
    assert (found.kind, found.cell, found.text) == (
        "exception",
        "measured cell #3",
        "IPython holds 2.0 MiB in last exception (ValueError)",
    )
    (unknown,) = standing_by_cell([_held("last exception", MIB, hidden=True)], [], [])
    assert unknown.cell == ""
