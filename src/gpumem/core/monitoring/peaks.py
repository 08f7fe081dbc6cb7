"""Whether a measured peak is exact: PyTorch's peak counters, who resets them, and the rule.

The allocator keeps one peak counter per device, shared with the user's own
``torch.cuda.max_memory_allocated()``. A measurement's peak is exact when that counter covers exactly
the measurement; otherwise the peak is the highest sampled value, a lower bound. Three things decide:
whether the measurement reset the counter when it started (or found it at the current level), whether
anything reset it during the measurement (counted by :class:`PeakResetCounter`), and whether the
counter agrees with what was sampled.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

from gpumem.core.readers.cuda_fault import record_fault
from gpumem.core.readers.sources import AllocatorReading, MemorySource

__all__ = [
    "KEPT_PEAK_NOTE",
    "PEAK_RESETS",
    "PEAK_RESET_NOTE",
    "RUNNING",
    "PeakFigures",
    "PeakResetCounter",
    "RunningMeasurements",
    "RunningPeak",
    "cell_peak",
    "kept_counter_exact",
    "reset_raised_peaks",
]

PEAK_RESET_NOTE = "the peak counter was reset inside the cell; showing the sampled lower bound"
KEPT_PEAK_NOTE = "peak counters kept (not reset): sampled lower bound"


class _Measured(Protocol):
    finished: bool


class RunningMeasurements:
    """Every cell or block being measured in this process, whichever tracker measures it: while one runs,
    another starting inside it leaves the peak counters alone, so that the outer peak stays exact."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Weak references to the unfinished measurements: a block dropped unfinished stops counting when it
        # is collected. A dict of refs, not a WeakSet, because this is read twice a cell and a WeakSet's
        # guarded iteration costs several times as much; finished measurements are dropped as they are seen.
        self._cells: dict[int, weakref.ref[_Measured]] = {}

    def add(self, cell: _Measured) -> bool:
        """Count ``cell`` as running; whether another measurement runs too (as :meth:`others_running`)."""
        with self._lock:
            others = any(other is not cell for other in self._unfinished()) if self._cells else False
            self._cells[id(cell)] = weakref.ref(cell)
            return others

    def others_running(self, cell: _Measured) -> bool:
        with self._lock:
            return any(other is not cell for other in self._unfinished())

    def when_idle(self, action: Callable[[], None]) -> None:
        """Run ``action`` if nothing is measured, holding off new measurements until it is done."""
        with self._lock:
            if not self._unfinished():
                action()

    def _unfinished(self) -> list[_Measured]:
        """The measurements still running; the others are forgotten (the caller holds the lock)."""
        running = []
        for key, ref in list(self._cells.items()):
            cell = ref()
            if cell is None or cell.finished:
                del self._cells[key]
            else:
                running.append(cell)
        return running


class PeakResetCounter:
    """Counts, per device, calls that reset PyTorch's allocator peak counters.

    ``torch.cuda.reset_peak_memory_stats`` (and ``reset_max_memory_allocated``, built on it) call
    ``torch._C._cuda_resetPeakMemoryStats`` by name each time; a counting wrapper around that one
    function tells for certain whether the user's code reset a counter during a cell. Installed only
    once torch is imported and built with CUDA, and only while something is measured: one counter
    serves every tracker in the process (the extension's and ``gpumem.measure``'s), so the wrapper
    never wraps itself, and :meth:`release` removes it when the last measurement ends.
    """

    _NAME = "_cuda_resetPeakMemoryStats"

    def __init__(self, running: RunningMeasurements) -> None:
        self.calls: dict[int | None, int] = {}
        self._running = running
        self._lock = threading.Lock()
        self._module: Any = None
        self._original: Any = None
        self._wrapper: Any = None

    def install(self) -> None:
        with self._lock:
            module = getattr(sys.modules.get("torch"), "_C", None)
            current = getattr(module, self._NAME, None)
            if current is None or (current is self._wrapper and module is self._module):
                return
            original = current
            lock = self._lock

            def counting_reset(*args: Any, **kwargs: Any) -> Any:
                device = args[0] if args and isinstance(args[0], int) else None
                with lock:
                    self.calls[device] = self.calls.get(device, 0) + 1
                return original(*args, **kwargs)

            setattr(module, self._NAME, counting_reset)
            self._module, self._original, self._wrapper = module, original, counting_reset

    def release(self) -> None:
        """Put torch's own function back, unless a measurement still runs somewhere in the process."""
        self._running.when_idle(self._uninstall)

    def _uninstall(self) -> None:
        with self._lock:
            if self._module is not None and getattr(self._module, self._NAME, None) is self._wrapper:
                setattr(self._module, self._NAME, self._original)
            self._module = self._original = self._wrapper = None

    def snapshot(self) -> dict[int | None, int]:
        with self._lock:
            return dict(self.calls)

    def count(self, device: int) -> int:
        """Resets that may have touched ``device`` (a call without a device index counts for all)."""
        with self._lock:
            return self.calls.get(device, 0) + self.calls.get(None, 0)

    def reset_since(self, device: int, earlier: dict[int | None, int]) -> bool:
        """Whether ``device``'s counter was reset after ``earlier`` (a :meth:`snapshot`) was taken."""
        if not self.calls:
            return False  # nothing was ever reset (the usual case): no lock needed to say so
        return self.count(device) > earlier.get(device, 0) + earlier.get(None, 0)


RUNNING = RunningMeasurements()
PEAK_RESETS = PeakResetCounter(RUNNING)


def reset_raised_peaks(source: MemorySource, readings: Iterable[AllocatorReading]) -> list[int]:
    """Reset the counters that stand above current use, so they cover only what follows.

    Returns the devices reset; none when the reset failed (their counters then say nothing of the cell).
    """
    readings = list(readings)
    devices = [
        reading.device
        for reading in readings
        if reading.peak_allocated_bytes > reading.allocated_bytes
        or reading.peak_reserved_bytes > reading.reserved_bytes
    ]
    if devices:
        try:
            source.reset_peaks(devices)
        except Exception as error:
            record_fault(error, None, readings)  # a sticky CUDA error seen here: no CUDA call on that device again
            return []
    return devices


class PeakFigures(NamedTuple):
    """A measurement's peak on one device, and whether it is the counter's exact value."""

    allocated_bytes: int
    reserved_bytes: int
    exact: bool
    note: str  # why the peak is not exact, or ""


def _counter_covers_cell(before: AllocatorReading | None, reset_at_start: bool) -> bool:
    """The counter started at the cell's own level: CUDA was initialized inside the cell, the tracker
    reset it, or it had never risen above current use."""
    return (
        before is None
        or reset_at_start
        or (
            before.peak_allocated_bytes == before.allocated_bytes
            and before.peak_reserved_bytes == before.reserved_bytes
        )
    )


def _exactness(
    before: AllocatorReading | None,
    after: AllocatorReading,
    counter_consistent: bool,
    *,
    reset_at_start: bool,
    reset_in_cell: bool,
) -> tuple[bool, str]:
    if reset_in_cell:
        return False, PEAK_RESET_NOTE
    if _counter_covers_cell(before, reset_at_start):
        return counter_consistent, "" if counter_consistent else PEAK_RESET_NOTE
    assert before is not None
    exact, why = kept_counter_exact(
        before.peak_allocated_bytes, after.peak_allocated_bytes, consistent=counter_consistent, reset_seen=False
    )
    return exact, {"": "", "reset": PEAK_RESET_NOTE, "kept": KEPT_PEAK_NOTE}[why]


def kept_counter_exact(start_peak: float, end_peak: float, *, consistent: bool, reset_seen: bool) -> tuple[bool, str]:
    """The rule for a peak counter that a measurement found and kept (did not reset) when it began.

    It covers the measurement exactly when it rose above its value at the start (then its maximum was
    reached since), was not reset meanwhile (a drop is a reset), and stands at or above every sampled
    value (``consistent``). Returns whether it is exact and, when not, why: ``"reset"`` (it fell, was
    seen reset, or is below a sample) or ``"kept"`` (it never rose: its value predates the start).
    """
    if reset_seen or end_peak < start_peak or not consistent:
        return False, "reset"
    if end_peak > start_peak:
        return True, ""
    return False, "kept"


def cell_peak(
    before: AllocatorReading | None,
    after: AllocatorReading,
    sampled_allocated: int,
    sampled_reserved: int,
    *,
    reset_at_start: bool,
    reset_in_cell: bool,
) -> PeakFigures:
    """The peak of one device over a cell. ``sampled_*`` are the highest values seen, the start's and
    the end's included; ``reset_at_start``: the tracker reset this counter when the cell began;
    ``reset_in_cell``: something reset it while the cell ran."""
    counter_consistent = (
        after.peak_allocated_bytes >= sampled_allocated and after.peak_reserved_bytes >= sampled_reserved
    )
    exact, note = _exactness(
        before, after, counter_consistent, reset_at_start=reset_at_start, reset_in_cell=reset_in_cell
    )
    if exact:
        return PeakFigures(after.peak_allocated_bytes, max(after.peak_reserved_bytes, sampled_reserved), True, note)
    if reset_in_cell:
        # What the counter says now happened after the reset, inside the cell: a lower bound too.
        sampled_allocated = max(sampled_allocated, after.peak_allocated_bytes)
        sampled_reserved = max(sampled_reserved, after.peak_reserved_bytes)
    return PeakFigures(sampled_allocated, sampled_reserved, False, note)


class RunningPeak:
    """The highest value of one figure since a measured stretch began (:class:`gpumem.core.monitoring.spans.Stretch`: a
    cell, a scope, a panel opened, Reset peak), folded sample by sample: the highest sample and, where the
    stretch watches it (one that never resets it), the peak counter judged by :func:`kept_counter_exact`.

    The counter (``max_memory_allocated``, the process's peak RSS) is shared and kept: it says nothing of
    the time since the start until it rises above its value then. Once it drops, someone reset it (a
    measured cell does, at its start): its later values are still real peaks since the start, so they
    still count, but the figure is a lower bound from then on.
    """

    __slots__ = ("_counter_last", "_counter_peak", "_counter_start", "_reset_seen", "_sampled")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._sampled: float | None = None
        self._counter_start: float | None = None
        self._counter_last: float | None = None
        self._counter_peak: float | None = None  # highest counter value that is a peak since the start
        self._reset_seen = False

    def update(self, current: float, counter: float | None) -> None:
        """Fold one sample in: ``current``, and the peak counter's value (None: the counter is not watched)."""
        sampled = self._sampled
        if sampled is None or current > sampled:
            self._sampled = current
        if counter is None:
            return
        if self._counter_start is None:
            self._counter_start = self._counter_last = counter
            return
        if self._counter_last is not None and counter < self._counter_last:
            self._reset_seen = True
        self._counter_last = counter
        if self._reset_seen or counter > self._counter_start:
            self._counter_peak = counter if self._counter_peak is None else max(self._counter_peak, counter)

    def copy(self) -> RunningPeak:
        """A copy that later updates leave alone (cheaper than copy.copy, taken every header push per device)."""
        twin = RunningPeak.__new__(RunningPeak)
        for name in RunningPeak.__slots__:
            setattr(twin, name, getattr(self, name))
        return twin

    @property
    def value(self) -> float | None:
        """The highest value known since the start: exact (:attr:`exact`) or a lower bound."""
        sampled, counter = self._sampled, self._counter_peak
        if sampled is None or counter is None:
            return counter if sampled is None else sampled
        return max(sampled, counter)

    @property
    def sampled(self) -> float | None:
        """The highest sample since the start: what the curves drawn from the same samples reach."""
        return self._sampled

    @property
    def exact(self) -> bool:
        return self.why_not_exact == ""

    @property
    def why_not_exact(self) -> str:
        """"" when exact; ``"reset"``, ``"kept"`` (see :func:`kept_counter_exact`) or ``"no counter"``."""
        if self._counter_start is None or self._counter_last is None:
            return "no counter"
        end = self._counter_peak if self._counter_peak is not None else self._counter_last
        _exact, why = kept_counter_exact(
            self._counter_start, end, consistent=end >= (self._sampled or 0), reset_seen=self._reset_seen
        )
        return why
