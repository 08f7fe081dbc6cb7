"""Paired, interleaved A/B timing with an A/A control, for effects smaller than the machine's drift.

A ratio of two medians taken minutes apart shows the machine's drift (±4% round to round on a shared
H200), not a 0.5% cost. Here every round runs the baseline A and the variant B back to back in ABBA
order, so a linear drift within the round cancels in ``(B1 + B2) / (A1 + A2)``; the same round also
runs an A/A block (A four times, the middle two standing in for B), whose ratio would be exactly 1 on
a quiet machine. Its spread is the measurement's noise floor, printed beside the A/B ratio: an A/B
median inside the A/A's spread is no measurable cost. The two blocks alternate in order round to round.

Adaptive: after ``min_rounds`` rounds, if the A/A ratios' interquartile range is wider than
``±target`` the run length (``size``: steps, cells or loop iterations) is doubled and collection
starts again, because a longer run averages more of the jitter; rounds are then added until the time
budget is spent. Whether the A/A IQR came within the target is reported, never assumed.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

Workload = Callable[[int], float]  # runs ``size`` units, returns the seconds the timed part took
Variant = Callable[[], AbstractContextManager[Any]]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        only = values[0] if values else math.nan
        return only, only, only
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median, from order statistics (binomial ranks)."""
    n = len(values)
    ordered = sorted(values)
    tail = (1 - confidence) / 2
    cumulative, k = 0.0, 0
    while k < n:
        p = math.comb(n, k) / 2**n
        if cumulative + p > tail:
            break
        cumulative += p
        k += 1
    if k == 0:
        return math.nan, math.nan
    return ordered[k - 1], ordered[n - k]


def summarize(ratios: list[float]) -> dict[str, Any]:
    q1, q2, q3 = quartiles(ratios)
    low, high = median_ci(ratios)
    return {"median": q2, "q1": q1, "q3": q3, "iqr": q3 - q1, "ci95": [low, high], "rounds": len(ratios)}


def _timed(variant: Variant, workload: Workload, size: int) -> float:
    gc.collect()
    with variant():
        return workload(size)


def _round(a: Variant, b: Variant, workload: Workload, size: int, control_first: bool) -> tuple[float, float]:
    def ab() -> float:
        a1, b1, b2, a2 = (_timed(v, workload, size) for v in (a, b, b, a))
        return (b1 + b2) / (a1 + a2)

    def aa() -> float:
        a1, a2, a3, a4 = (_timed(a, workload, size) for _ in range(4))
        return (a2 + a3) / (a1 + a4)

    if control_first:
        control = aa()
        return ab(), control
    paired = ab()
    return paired, aa()


def paired_ratio(
    a: Variant,
    b: Variant,
    workload: Workload,
    *,
    size: int,
    budget_s: float,
    min_rounds: int = 6,
    target: float = 0.01,
    max_size: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Median and IQR of the per-round B/A ratio beside the A/A control's, within ``budget_s``."""
    started = time.monotonic()
    max_size = max_size or size * 16
    ratios: list[float] = []
    controls: list[float] = []
    sizes_tried = [size]
    workload(max(1, size // 4))  # warm-up, untimed
    while True:
        round_began = time.monotonic()
        paired, control = _round(a, b, workload, size, control_first=len(ratios) % 2 == 1)
        ratios.append(paired)
        controls.append(control)
        round_s = time.monotonic() - round_began
        left = budget_s - (time.monotonic() - started)
        q1, _, q3 = quartiles(controls)
        wide = q1 < 1 - target or q3 > 1 + target
        if len(controls) >= min_rounds and wide and size * 2 <= max_size and left > 2 * round_s * min_rounds:
            log(f"  A/A IQR [{q1:.4f}, {q3:.4f}] wider than ±{target:.1%} at size {size}: doubling the run length")
            size *= 2
            sizes_tried.append(size)
            ratios, controls = [], []
            continue
        if left < round_s and len(ratios) >= min(3, min_rounds):
            break
    control_summary = summarize(controls)
    reached = 1 - target <= control_summary["q1"] and control_summary["q3"] <= 1 + target
    result = {
        "paired": summarize(ratios),
        "control": control_summary,
        "size": size,
        "sizes_tried": sizes_tried,
        "target": target,
        "goal_reached": reached,
        "elapsed_s": time.monotonic() - started,
        "ratios": ratios,
        "controls": controls,
    }
    log(describe(result))
    return result


def describe(result: dict[str, Any]) -> str:
    p, c = result["paired"], result["control"]
    verdict = "reached" if result["goal_reached"] else "NOT reached"
    return (
        f"  B/A median {p['median']:.4f} (IQR {p['q1']:.4f}..{p['q3']:.4f}, 95% CI of median "
        f"{p['ci95'][0]:.4f}..{p['ci95'][1]:.4f}); A/A median {c['median']:.4f} (IQR {c['q1']:.4f}..{c['q3']:.4f}); "
        f"{p['rounds']} rounds of size {result['size']}; A/A IQR within ±{result['target']:.0%}: {verdict}"
    )


def _interval(low: float, high: float) -> str:
    return "n/a (under 6 rounds)" if math.isnan(low) else f"{low:.4f}..{high:.4f}"


def markdown_row(name: str, result: dict[str, Any]) -> str:
    p, c = result["paired"], result["control"]
    return (
        f"| {name} | {p['median']:.4f}x | {p['q1']:.4f}..{p['q3']:.4f} | {_interval(*p['ci95'])} "
        f"| {c['median']:.4f}x | {c['q1']:.4f}..{c['q3']:.4f} | {p['rounds']} x {result['size']} "
        f"| {'yes' if result['goal_reached'] else 'no'} |"
    )


MARKDOWN_HEADER = [
    (
        "| comparison | B/A median | B/A IQR | B/A median 95% CI | A/A median | A/A IQR | rounds x size "
        "| A/A IQR within ±1% |"
    ),
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
]

null_variant: Variant = contextlib.nullcontext
