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
from gpumem.core.sources import Snapshot
from gpumem.core.units import MIB, format_bytes, format_delta

__all__ = [
    "STAIRCASE_MIN_BYTES",
    "STAIRCASE_MIN_STEPS",
    "Staircase",
    "find_staircase",
    "gradient_note",
    "has_optimizer",
    "staircase_notes",
    "staircase_warning",
]

STAIRCASE_MIN_STEPS = 5
STAIRCASE_MIN_BYTES = 64 * MIB
_STEP_TOLERANCE = 0.25  # each step within this fraction of the typical step
_NOISE_FLOOR_BYTES = MIB  # smaller moves between samples are not steps
_SHOWN_HOLDERS = 3
_MAX_POINTS = 100_000  # a window this long keeps every sample (no min/max decimation)
_GRADIENTS = "gradients"  # gpumem.core.holders.model.GRADIENTS


class Staircase(NamedTuple):
    """Sampled memory that rose in ``steps`` similar steps of about ``step_bytes`` and did not fall back."""

    steps: int
    step_bytes: int
    rise_bytes: int  # from the first step's start to the end of the series
    duration_s: float  # from the first step to the last

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


def staircase_warning(where: str, staircase: Staircase, variables: Sequence[VariableChange]) -> CellWarning:
    """The warning for a staircase on ``where`` (``cuda:0``), naming the variable that explains most of it."""
    rate = format_bytes(staircase.rate_bytes_per_s)
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
            sampled = series.values.get(f"cuda:{change.device}/allocated")
            if sampled is None:
                continue
            times = [start.monotonic_s, *series.times, end.monotonic_s]
            values = [float(change.allocated_before_bytes), *sampled, float(change.allocated_after_bytes)]
            found = find_staircase(times, values, min_total_bytes=min_bytes)
            if found is not None:
                warnings.append(staircase_warning(f"cuda:{change.device}", found, variables.changes))
    note = None
    if variables.kinds and has_optimizer(namespace, sys.modules.get("torch")):
        note = gradient_note(variables.kinds, variables.gradient_holders, min_bytes)
    return warnings, (note,) if note else ()
