"""``%%gpumem --profile``: PyTorch's operator recorder around one cell, and the operators that allocated most.

PyTorch records every operator call with the memory it allocated and freed (CPU always; CUDA when a
device is available). The figures are net: bytes allocated minus bytes freed inside the call, so an
operator that frees more than it allocates shows a negative figure; "self" counts the operator
alone, "total" adds the operators it called; the rows are those of ``key_averages(
group_by_input_shape=True)``. Two recorders give them: by default PyTorch's CPU-side recorder
(``profile_records``: no Kineto trace to build when it stops, read a field at a time over arrays), else
``torch.profiler.profile(profile_memory=True, record_shapes=True)``, whose results are read
straight (``profile_events``) in about an eighth of ``key_averages``' time. Neither caps the
calls it keeps, so the cost is measured (the time to stop and to read back, and the change of this
process's resident memory) and said under the table. torch is only looked up in ``sys.modules``:
importing it here would cost seconds inside the cell being measured.
"""

from __future__ import annotations

import html
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from gpumem.core.cells.formatting import STYLE
from gpumem.core.diagnoses.profile_events import OperatorMemory, read_operators, shapes_text, sort_rows
from gpumem.core.readers.cuda_fault import cuda_faults, status_text
from gpumem.core.readers.torch_state import no_torch_reason
from gpumem.core.units import format_bytes

__all__ = [
    "DEFAULT_RECORDER",
    "DEFAULT_TOP_OPERATORS",
    "MANY_OPERATOR_CALLS",
    "RECORDERS",
    "CellProfiler",
    "OperatorMemory",
    "ProfileCost",
    "ProfileReport",
    "operator_rows",
]

DEFAULT_TOP_OPERATORS = 15
# "records": PyTorch's CPU-side operator recorder, read by gpumem (profile_records); "kineto":
# torch.profiler.profile, read by profile_events (where torch lacks the first, it is used anyway).
RECORDERS = ("records", "kineto")
DEFAULT_RECORDER = "records"
MANY_OPERATOR_CALLS = 1_000_000  # beyond this the profiler's own events take hundreds of MB of host memory
# Past this many seconds after the cell a shorter cell is advised: PyTorch stopping its profiler and the
# read-back both grow with the calls recorded (152,405 and 4.2 s for a 300-step training loop on an H200).
SLOW_AFTER_CELL_S = 5.0
_TEXT_COLUMNS = 2  # operator and input shapes, left-aligned; the figures are right-aligned


class ProfileCost(NamedTuple):
    """What the profiler itself cost: seconds to stop it and to read its events back (``group_s``), and host memory."""

    stop_s: float
    group_s: float
    rss_before_bytes: int | None
    rss_after_bytes: int | None
    operator_calls: int


class ProfileReport:
    """The table under a ``--profile`` cell: the top operators by memory, then what profiling cost."""

    def __init__(
        self, rows: Sequence[OperatorMemory], cost: ProfileCost, *, cuda: bool, top: int, cell: int | None
    ) -> None:
        self.rows = list(rows)
        self.cost = cost
        self.cuda = cuda
        self.top = top
        self.cell = cell

    def _title(self) -> str:
        where = f"cell [{self.cell}]" if self.cell is not None else "the cell"
        kinds = "CPU and CUDA" if self.cuda else "CPU (no CUDA device is available to PyTorch)"
        return f"gpumem profile of {where}: operators by memory, {kinds}"

    def _shown(self) -> list[OperatorMemory]:
        return [row for row in self.rows if row.largest_bytes() > 0][: self.top]

    def _header(self) -> list[str]:
        columns = ["operator", "input shapes", "calls", "self CPU", "total CPU"]
        return [*columns, "self CUDA", "total CUDA"] if self.cuda else columns

    def _cells(self, row: OperatorMemory) -> list[str]:
        cells = [row.name, row.input_shapes, f"{row.calls:,}"]
        figures = [row.self_cpu_bytes, row.cpu_bytes]
        if self.cuda:
            figures += [row.self_device_bytes, row.device_bytes]
        return cells + [_signed_bytes(value) for value in figures]

    def notes(self) -> list[str]:
        shown = self._shown()
        notes = []
        if not shown:
            notes.append("No operator allocated more than it freed during its call.")
        elif len(shown) < len([row for row in self.rows if row.largest_bytes() > 0]):
            notes.append(f"The {len(shown)} operators (with their input shapes) that allocated most are shown.")
        notes.append(
            "Bytes are net: allocated minus freed inside the call (negative: it freed more); self is the "
            "operator alone, total adds the operators it called."
        )
        notes.append(self.cost_text())
        return notes

    def cost_text(self) -> str:
        cost = self.cost
        text = (
            f"Profiling recorded {cost.operator_calls:,} operator calls and added about "
            f"{cost.stop_s + cost.group_s:.2f} s after the cell (stopping {cost.stop_s:.2f} s, reading back "
            f"{cost.group_s:.2f} s), besides slowing each operator while it ran"
        )
        if cost.rss_before_bytes is not None and cost.rss_after_bytes is not None:
            grown = cost.rss_after_bytes - cost.rss_before_bytes
            text += f"; host memory changed by {_signed_bytes(grown)} while profiling (the cell's own use included)"
        text += "."
        if cost.operator_calls >= MANY_OPERATOR_CALLS:
            text += (
                " The profiler keeps every call in host memory until the cell ends: profile a shorter cell "
                "(a few steps of the loop) to keep that down."
            )
        elif cost.stop_s + cost.group_s >= SLOW_AFTER_CELL_S:
            text += (
                " Both grow with the number of calls the profiler recorded: "
                "profile a shorter cell (a few steps of the loop) for a faster answer."
            )
        return text

    def __repr__(self) -> str:
        lines = [self._title()]
        shown = self._shown()
        if shown:
            table = [self._header(), *(self._cells(row) for row in shown)]
            widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
            for line in table:
                parts = [
                    value.ljust(width) if i < _TEXT_COLUMNS else value.rjust(width)
                    for i, (value, width) in enumerate(zip(line, widths, strict=True))
                ]
                lines.append("  " + "  ".join(parts).rstrip())
        lines.extend(self.notes())
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        parts = [STYLE, f"<div class='gpumem-report'><b>{html.escape(self._title())}</b>"]
        shown = self._shown()
        if shown:
            head = "".join(f"<th>{html.escape(name)}</th>" for name in self._header())
            body = "".join(
                "<tr>" + "".join(f"<td>{html.escape(value)}</td>" for value in self._cells(row)) + "</tr>"
                for row in shown
            )
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        parts.extend(f"<p>{html.escape(note)}</p>" for note in self.notes())
        parts.append("</div>")
        return "".join(parts)


def _signed_bytes(value: int) -> str:
    return "-" + format_bytes(-value) if value < 0 else format_bytes(value)


def _field(event: Any, *names: str) -> int:
    """The first of ``names`` the event has (torch renamed the CUDA fields to "device" in 2.4)."""
    for name in names:
        value = getattr(event, name, None)
        if isinstance(value, int):
            return value
    return 0


def operator_rows(events: Iterable[Any]) -> list[OperatorMemory]:
    """``key_averages(group_by_input_shape=True)`` as rows, the largest allocators first."""
    rows = [
        OperatorMemory(
            name=str(getattr(event, "key", "?")),
            input_shapes=shapes_text(getattr(event, "input_shapes", None)),
            calls=_field(event, "count"),
            self_cpu_bytes=_field(event, "self_cpu_memory_usage"),
            cpu_bytes=_field(event, "cpu_memory_usage"),
            self_device_bytes=_field(event, "self_device_memory_usage", "self_cuda_memory_usage"),
            device_bytes=_field(event, "device_memory_usage", "cuda_memory_usage"),
        )
        for event in events
    ]
    return sort_rows(rows)


class CellProfiler:
    """``start()`` before the cell, ``stop()`` after it; nothing here raises into the user's cell."""

    def __init__(
        self,
        top: int = DEFAULT_TOP_OPERATORS,
        rss: Callable[[], int | None] | None = None,
        *,
        recorder: str = DEFAULT_RECORDER,
    ) -> None:
        if recorder not in RECORDERS:
            raise ValueError(f"recorder must be one of {', '.join(RECORDERS)}, not {recorder!r}")
        self.top = top
        self.recorder = recorder
        self._rss = rss or _current_rss
        self._profiler: Any = None
        self._by_records = False  # the profiler running is PyTorch's CPU-side recorder (else Kineto's)
        self._cuda = False
        self._rss_before: int | None = None

    def start(self) -> str | None:
        """Start profiling; or why it cannot (then nothing is started)."""
        torch = sys.modules.get("torch")
        profiler = getattr(torch, "profiler", None)
        if torch is None or profiler is None or not hasattr(profiler, "profile"):
            return no_torch_reason("profile this one")
        if _profiler_running(torch):
            return "a PyTorch profiler is already running in this process (a second one would disturb it)"
        faults = cuda_faults()
        if faults:  # the profiler's CUDA calls would fail again
            return "; ".join(status_text(fault) for fault in faults.values())
        self._cuda = _cuda_available(torch)
        self._rss_before = self._rss()
        if self.recorder == "records" and self._start_records(torch):
            return None
        activities = [profiler.ProfilerActivity.CPU]
        if self._cuda:
            activities.append(profiler.ProfilerActivity.CUDA)
        recorder = profiler.profile(activities=activities, profile_memory=True, record_shapes=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "CUDA is not available" and similar notes from the profiler
            recorder.__enter__()
        self._profiler, self._by_records = recorder, False
        return None

    def _start_records(self, torch: Any) -> bool:
        """Start PyTorch's CPU-side recorder; False where this torch lacks it or it will not start."""
        # The records reader needs numpy: imported when a cell is profiled with it, never by loading the extension.
        from gpumem.core.diagnoses import profile_records

        if not profile_records.available(torch):
            return False
        records = profile_records.RecordsProfiler(torch)
        try:
            records.start()
        except Exception:  # a torch whose recorder takes other arguments: Kineto's instead
            return False
        self._profiler, self._by_records = records, True
        return True

    def stop(self, cell: int | None = None) -> ProfileReport | None:
        """Stop profiling and group its events; None when nothing was started."""
        recorder, self._profiler = self._profiler, None
        if recorder is None:
            return None
        began = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if self._by_records:
                records = recorder.stop()
                stopped = time.perf_counter()
                rows, calls = _read_records(records)
            else:
                recorder.__exit__(None, None, None)
                stopped = time.perf_counter()
                rows, calls = _read_back(recorder)
        grouped = time.perf_counter()
        cost = ProfileCost(stopped - began, grouped - stopped, self._rss_before, self._rss(), calls)
        return ProfileReport(rows, cost, cuda=self._cuda, top=self.top, cell=cell)

    def abandon(self) -> None:
        """Stop without a report (the extension is unloading with a cell in flight)."""
        recorder, self._profiler = self._profiler, None
        if recorder is None:
            return
        if self._by_records:
            recorder.stop()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                recorder.__exit__(None, None, None)


def _read_records(records: Any) -> tuple[list[OperatorMemory], int]:
    from gpumem.core.diagnoses.profile_records import read_records

    table = read_records(records)
    if table is None:
        raise ValueError("PyTorch's operator records were not as expected")
    return table.rows, table.calls


def _profiler_running(torch: Any) -> bool:
    """Whether a PyTorch profiler of any kind records in this process already."""
    if getattr(getattr(torch.autograd, "profiler", None), "_is_profiler_enabled", False):
        return True
    enabled = getattr(torch.autograd, "_profiler_enabled", None)
    try:
        return bool(enabled()) if callable(enabled) else False
    except Exception:
        return False


def _read_back(recorder: Any) -> tuple[list[OperatorMemory], int]:
    """The operators' memory, read straight from the results; through ``key_averages`` where that fails."""
    results = getattr(getattr(recorder, "profiler", None), "kineto_results", None)
    table = read_operators(results, sys.modules["torch"]) if results is not None else None
    if table is not None:
        return table.rows, table.calls
    rows = operator_rows(recorder.key_averages(group_by_input_shape=True))
    return rows, sum(row.calls for row in rows)


def _cuda_available(torch: Any) -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _current_rss() -> int | None:
    try:
        import psutil
    except ImportError:
        return None
    try:
        return int(psutil.Process().memory_info().rss)
    except Exception:
        return None
