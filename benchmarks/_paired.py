"""Paired, interleaved A/B timing with an A/A control, for effects smaller than the machine's drift.

A ratio of two medians taken minutes apart shows the machine's drift (±4% round to round on a shared
H200), not a 0.5% cost. Here the baseline A and the variant B run in quads, A B B A back to back, so a
linear drift within the quad cancels in ``(B1 + B2) / (A1 + A2)``; beside each runs an A/A quad (A four
times, the middle two standing in for B), whose ratio would be exactly 1 on a quiet machine. A round is
``quads`` of each kind, alternating, and its two ratios are sums over them: short runs keep A and B
within a fraction of a second of each other, where the machine's speed has not yet wandered off, and
the sums average the short runs' jitter. The A/A ratios' spread is the measurement's noise floor,
printed beside the A/B ratio: an A/B median inside it is no measurable cost.

Adaptive: while the A/A ratios' interquartile range is wider than ``±target``, rounds are made longer,
by joining adjacent rounds (``grow="quads"``, nothing measured is lost) or by doubling the run length
(``grow="size"``, for variants that need a long settling time); rounds are then added until the time
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
from typing import Any, NamedTuple

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


def _quad(a: Variant, b: Variant, workload: Workload, size: int) -> tuple[float, float]:
    """One A B B A quad (A A A A when ``b`` is ``a``): the middle two runs' seconds and the outer two's.

    The two middle runs share one entry of their variant, as the outer runs each have one of theirs.
    """
    with a():
        first = workload(size)
    with b():
        second = workload(size)
        third = workload(size)
    with a():
        fourth = workload(size)
    return second + third, first + fourth


class RoundSums(NamedTuple):
    """One round's seconds: the A/B quads' middle (B) and outer (A) runs, the A/A quads' the same."""

    b: float
    a: float
    control_middle: float
    control_outer: float

    @property
    def paired(self) -> float:
        return self.b / self.a

    @property
    def control(self) -> float:
        return self.control_middle / self.control_outer

    def __add__(self, other: object) -> RoundSums:
        assert isinstance(other, RoundSums)
        return RoundSums(*(mine + theirs for mine, theirs in zip(self, other, strict=True)))


def _round(a: Variant, b: Variant, workload: Workload, size: int, quads: int, control_first: bool) -> RoundSums:
    """One round: an untimed ``gc.collect()`` and one untimed run, so that no timed run is the first
    after a collection (every one follows another run), then :func:`round_sums`."""
    gc.collect()
    with a():
        workload(size)
    return round_sums(a, b, workload, size, quads, control_first)


def round_sums(a: Variant, b: Variant, workload: Workload, size: int, quads: int, control_first: bool) -> RoundSums:
    """``quads`` A/B quads and as many A/A quads, alternating: each ratio is a sum over its quads.

    Short runs, interleaved, put A and B within a fraction of a second of each other all through the
    round, so that the machine's slower swings cancel; the sums then average the short runs' jitter.
    """
    sums = {"AB": [0.0, 0.0], "AA": [0.0, 0.0]}
    order = ("AA", "AB") if control_first else ("AB", "AA")
    for index in range(quads):
        for kind in order if index % 2 == 0 else order[::-1]:
            middle, outer = _quad(a, b if kind == "AB" else a, workload, size)
            sums[kind][0] += middle
            sums[kind][1] += outer
    return RoundSums(*sums["AB"], *sums["AA"])


def _merged(rounds: list[RoundSums]) -> list[RoundSums]:
    """Adjacent rounds two by two: the rounds of twice as many quads they make (an odd last is dropped)."""
    return [first + second for first, second in zip(rounds[0::2], rounds[1::2], strict=False)]


def paired_ratio(
    a: Variant,
    b: Variant,
    workload: Workload,
    *,
    size: int,
    budget_s: float,
    quads: int = 1,
    grow: str = "size",
    min_rounds: int = 6,
    target: float = 0.01,
    max_size: int | None = None,
    max_quads: int = 64,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Median and IQR of the per-round B/A ratio beside the A/A control's, within ``budget_s``.

    While the A/A IQR is wider than ``±target``, ``grow`` makes rounds longer. ``"size"`` doubles the
    run length after ``min_rounds`` rounds, and collection starts again. ``"quads"`` doubles the quads
    per round once there are ``2 * min_rounds`` rounds, by joining adjacent rounds two by two, so that
    nothing measured is thrown away.
    """
    if grow not in ("size", "quads"):
        raise ValueError(f"grow must be 'size' or 'quads', not {grow!r}")
    started = time.monotonic()
    max_size = max_size or size * 16
    rounds: list[RoundSums] = []
    tried = [(size, quads)]
    workload(max(1, size // 4))  # warm-up, untimed
    while True:
        round_began = time.monotonic()
        rounds.append(_round(a, b, workload, size, quads, control_first=len(rounds) % 2 == 1))
        round_s = time.monotonic() - round_began
        left = budget_s - (time.monotonic() - started)
        q1, _, q3 = quartiles([r.control for r in rounds])
        wide = q1 < 1 - target or q3 > 1 + target
        longer = size * 2 <= max_size and left > 2 * round_s * min_rounds
        if wide and grow == "size" and len(rounds) >= min_rounds and longer:
            log(f"  A/A IQR [{q1:.4f}, {q3:.4f}] wider than ±{target:.1%} at size {size}: doubling it")
            size *= 2
            tried.append((size, quads))
            rounds = []
            continue
        if wide and grow == "quads" and len(rounds) >= 2 * min_rounds and quads * 2 <= max_quads:
            log(f"  A/A IQR [{q1:.4f}, {q3:.4f}] wider than ±{target:.1%} at {quads} quads a round: joining rounds")
            quads *= 2
            tried.append((size, quads))
            rounds = _merged(rounds)
            round_s *= 2
        if left < round_s and len(rounds) >= min(3, min_rounds):
            break
    ratios = [r.paired for r in rounds]
    controls = [r.control for r in rounds]
    control_summary = summarize(controls)
    reached = 1 - target <= control_summary["q1"] and control_summary["q3"] <= 1 + target
    result = {
        "paired": summarize(ratios),
        "control": control_summary,
        "size": size,
        "quads": quads,
        "sizes_tried": [s for s, _ in tried],
        "tried": tried,
        "target": target,
        "goal_reached": reached,
        "elapsed_s": time.monotonic() - started,
        "ratios": ratios,
        "controls": controls,
    }
    log(describe(result))
    return result


def _shape(result: dict[str, Any]) -> str:
    """Rounds x quads x run length, the quads left out where there is one a round."""
    quads = result.get("quads", 1)
    middle = f" x {quads} quads" if quads > 1 else ""
    return f"{result['paired']['rounds']}{middle} x {result['size']}"


def describe(result: dict[str, Any]) -> str:
    p, c = result["paired"], result["control"]
    verdict = "reached" if result["goal_reached"] else "NOT reached"
    return (
        f"  B/A median {p['median']:.4f} (IQR {p['q1']:.4f}..{p['q3']:.4f}, 95% CI of median "
        f"{p['ci95'][0]:.4f}..{p['ci95'][1]:.4f}); A/A median {c['median']:.4f} (IQR {c['q1']:.4f}..{c['q3']:.4f}); "
        f"rounds x quads x size {_shape(result)}; A/A IQR within ±{result['target']:.0%}: {verdict}"
    )


def _interval(low: float, high: float) -> str:
    return "n/a (under 6 rounds)" if math.isnan(low) else f"{low:.4f}..{high:.4f}"


def markdown_row(name: str, result: dict[str, Any]) -> str:
    p, c = result["paired"], result["control"]
    return (
        f"| {name} | {p['median']:.4f}x | {p['q1']:.4f}..{p['q3']:.4f} | {_interval(*p['ci95'])} "
        f"| {c['median']:.4f}x | {c['q1']:.4f}..{c['q3']:.4f} | {_shape(result)} "
        f"| {'yes' if result['goal_reached'] else 'no'} |"
    )


MARKDOWN_HEADER = [
    (
        "| comparison | B/A median | B/A IQR | B/A median 95% CI | A/A median | A/A IQR | rounds x quads x size "
        "| A/A IQR within ±1% |"
    ),
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
]

null_variant: Variant = contextlib.nullcontext
