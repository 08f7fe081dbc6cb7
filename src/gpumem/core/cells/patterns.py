"""Memory patterns inside one cell: a staircase in the sampled timeline, gradients kept after a step.

Both are read from what the cell already measured (the sampler's timeline, the holder walk); nothing
here reads a device. The staircase check is strict on purpose: a loop that allocates and frees (a
training step's activations) must never look like one that accumulates.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from gpumem.core.cells.attribution import VariableReport
from gpumem.core.cells.record import CellWarning, DeviceChange, KindChange, VariableChange
from gpumem.core.readers.sources import AllocatorReading, Snapshot
from gpumem.core.units import MIB, format_bytes, format_delta

__all__ = [
    "STAIRCASE_MIN_BYTES",
    "STAIRCASE_MIN_SECONDS",
    "STAIRCASE_MIN_STEPS",
    "Staircase",
    "counted_staircase",
    "find_staircase",
    "gradient_note",
    "has_optimizer",
    "staircase_notes",
    "staircase_warning",
]

STAIRCASE_MIN_STEPS = 5
STAIRCASE_MIN_BYTES = 64 * MIB
STAIRCASE_MIN_SECONDS = 1.0  # shorter cells are not called out from the counters
_AHEAD = 0.5  # a sample this far (of the rise) ahead of a steady rise: the growth came at once, not per step
_STEP_TOLERANCE = 0.25  # each step within this fraction of the typical step
_NOISE_FLOOR_BYTES = MIB  # smaller moves between samples are not steps
_SHOWN_HOLDERS = 3
_MAX_POINTS = 100_000  # a window this long keeps every sample (no min/max decimation)
_GRADIENTS = "gradients"  # gpumem.core.holders.model.GRADIENTS
_MODEL_KINDS = ("parameters", _GRADIENTS, "optimizer state", "buffers")  # as gpumem.core.holders.model names them


class Staircase(NamedTuple):
    """Sampled memory that rose in ``steps`` similar steps of about ``step_bytes`` and did not fall back."""

    steps: int
    step_bytes: int
    rise_bytes: int  # from the first step's start to the end of the series
    duration_s: float  # from the first step to the last
    counted: bool = False  # steps are allocations kept to the cell's end (the allocator's counters), not samples

    @property
    def rate_bytes_per_s(self) -> float:
        return self.rise_bytes / self.duration_s if self.duration_s > 0 else math.inf


def find_staircase(
    times: Sequence[float],
    values: Sequence[float],
    *,
    min_steps: int = STAIRCASE_MIN_STEPS,
    min_total_bytes: int = STAIRCASE_MIN_BYTES,
    tolerance: float = _STEP_TOLERANCE,
) -> Staircase | None:
    """A staircase in sampled values (bytes), or None. Strict rules, so that "None" is the usual answer:

    at least ``min_steps`` rises within ``tolerance`` of their median, few other rises, no fall larger
    than one step, a net rise of at least ``min_total_bytes`` (and of most of the steps), and some
    flat intervals between steps: when every interval rose, steps may be faster than the samples and
    their size is unknown.
    """
    points = [(t, v) for t, v in zip(times, values, strict=False) if math.isfinite(t) and math.isfinite(v)]
    if len(points) < min_steps + 1:
        return None
    moves = [points[i + 1][1] - points[i][1] for i in range(len(points) - 1)]
    rises = [delta for delta in moves if delta >= _NOISE_FLOOR_BYTES]
    if len(rises) < min_steps:
        return None
    step = statistics.median(rises)
    steps = [i for i, delta in enumerate(moves) if abs(delta - step) <= tolerance * step]
    if len(steps) < min_steps or any(-delta > step for delta in moves):
        return None
    between = moves[steps[0] : steps[-1] + 1]
    flat = sum(1 for delta in between if abs(delta) < tolerance * step)
    if len(rises) - len(steps) > len(steps) // 4 or flat < len(steps) // 4:
        return None
    rise = points[-1][1] - points[steps[0]][1]
    if rise < min_total_bytes or rise < (1 - tolerance) * len(steps) * step:
        return None
    typical = statistics.median(moves[i] for i in steps)
    return Staircase(len(steps), round(typical), round(rise), points[steps[-1] + 1][0] - points[steps[0]][0])


def counted_staircase(
    change: DeviceChange,
    start: AllocatorReading | None,
    end: AllocatorReading | None,
    began_s: float,
    duration_s: float,
    sampled: Sequence[tuple[float, float]] = (),
    *,
    min_total_bytes: int = STAIRCASE_MIN_BYTES,
) -> Staircase | None:
    """A loop that keeps what it makes, from the allocator's exact counters, however fast its steps were.

    A cell of at least a second whose allocated memory rose by ``min_total_bytes`` or more, held in at
    least :data:`STAIRCASE_MIN_STEPS` more live allocations than at its start, whose exact peak stood no
    more than about one of them above its end (so nothing larger was made and freed on the way: not a
    training step, whose activations come and go), and whose samples in between (``(t, bytes)``, any
    number; ``began_s`` is the start's time on their clock) never fell by more than one of them nor ran well
    ahead of a steady rise.
    """
    if start is None or end is None or start.live_allocations < 0 or end.live_allocations < 0:
        return None
    kept = end.live_allocations - start.live_allocations
    rise = change.allocated_delta_bytes
    if duration_s < STAIRCASE_MIN_SECONDS or kept < STAIRCASE_MIN_STEPS or rise < min_total_bytes:
        return None
    step = rise / kept
    above_end = change.peak_allocated_bytes - change.allocated_after_bytes
    if not change.peak_exact or above_end > (1 + _STEP_TOLERANCE) * step:
        return None
    before = highest = float(change.allocated_before_bytes)
    for at, value in sampled:
        if value < highest - step or (value - before) / rise > (at - began_s) / duration_s + _AHEAD:
            return None
        highest = max(highest, value)
    return Staircase(kept, round(step), rise, duration_s, counted=True)


def _model_or_optimizer(variables: VariableReport, found: Staircase) -> bool:
    """Most of a counted rise is parameters, gradients, optimizer state or buffers: a model loaded or built,
    an optimizer's first step, not a loop that keeps its results."""
    if not found.counted:
        return False
    model = sum(change.delta_bytes for change in variables.kinds if change.kind in _MODEL_KINDS)
    return model * 2 >= found.rise_bytes


def staircase_warning(where: str, staircase: Staircase, variables: Sequence[VariableChange]) -> CellWarning:
    """The warning for a staircase on ``where`` (``cuda:0``), naming the variable that explains most of it."""
    rate = format_bytes(staircase.rate_bytes_per_s)
    if staircase.counted:
        text = (
            f"{where} allocated memory rose step by step, {format_delta(staircase.rise_bytes)} in "
            f"{staircase.steps} allocations of ~{format_bytes(staircase.step_bytes)} kept to the end of the cell, "
            f"over {staircase.duration_s:.1f} s ({rate}/s), and never fell back: a loop keeps what it makes"
        )
    else:
        text = (
            f"{where} allocated memory rose in {staircase.steps} steps of ~{format_bytes(staircase.step_bytes)} "
            f"({format_delta(staircase.rise_bytes)}) over {staircase.duration_s:.1f} s ({rate}/s) and never fell: "
            "something accumulates per iteration"
        )
    grown = [change for change in variables if not change.hidden and change.grown_bytes > 0]
    if grown and grown[0].grown_bytes * 2 >= staircase.rise_bytes:
        text += f"; `{grown[0].name}` grew most ({format_delta(grown[0].grown_bytes)})"
    text += " (keep numbers with .item(), tensors with .detach(), or move them off the GPU)"
    return CellWarning("staircase", text)


def gradient_note(kinds: Sequence[KindChange], holders: Sequence[tuple[str, int]], min_bytes: int) -> str | None:
    """Gradients that grew in the cell and are still held after it (information, not a warning)."""
    grown = next((change for change in kinds if change.kind == _GRADIENTS), None)
    if grown is None or grown.delta_bytes < min_bytes or not holders:
        return None
    names = ", ".join(f"`{name}` {format_bytes(nbytes)}" for name, nbytes in holders[:_SHOWN_HOLDERS])
    more = f" and {len(holders) - _SHOWN_HOLDERS} more" if len(holders) > _SHOWN_HOLDERS else ""
    return (
        f"gradients are kept after the cell ({format_bytes(grown.after_bytes)}: {names}{more}); "
        "optimizer.zero_grad(set_to_none=True) after the last step frees them until the next backward()"
    )


def has_optimizer(namespace: Mapping[str, Any] | None, torch: Any) -> bool:
    """Whether a name in ``namespace`` is a ``torch.optim.Optimizer`` (without importing torch)."""
    optimizer = getattr(getattr(torch, "optim", None), "Optimizer", None)
    if namespace is None or not isinstance(optimizer, type):
        return False
    return any(isinstance(value, optimizer) for value in list(namespace.values()))


def staircase_notes(
    timeline: Any,
    start: Snapshot,
    end: Snapshot,
    devices: Sequence[DeviceChange],
    variables: VariableReport,
    namespace: Mapping[str, Any] | None,
    min_bytes: int,
) -> tuple[list[CellWarning], tuple[str, ...]]:
    """The cell's patterns: staircases of a device's allocated memory (warnings) and gradients kept (notes)."""
    warnings: list[CellWarning] = []
    grown = [change for change in devices if change.allocated_delta_bytes >= min_bytes]
    if grown:
        series = timeline.window(start.monotonic_s, end.monotonic_s, _MAX_POINTS)
        for change in grown:
            sampled = list(series.values.get(f"cuda:{change.device}/allocated") or ())  # none: a short cell
            inside = list(series.times) if sampled else []
            times = [start.monotonic_s, *inside, end.monotonic_s]
            values = [float(change.allocated_before_bytes), *sampled, float(change.allocated_after_bytes)]
            found = find_staircase(times, values, min_total_bytes=min_bytes) or counted_staircase(
                change,
                start.allocator_for(change.device),
                end.allocator_for(change.device),
                start.monotonic_s,
                end.monotonic_s - start.monotonic_s,
                list(zip(inside, sampled, strict=False)),
                min_total_bytes=min_bytes,
            )
            if found is not None and not _model_or_optimizer(variables, found):
                warnings.append(staircase_warning(f"cuda:{change.device}", found, variables.changes))
    note = None
    if variables.kinds and has_optimizer(namespace, sys.modules.get("torch")):
        note = gradient_note(variables.kinds, variables.gradient_holders, min_bytes)
    return warnings, (note,) if note else ()
