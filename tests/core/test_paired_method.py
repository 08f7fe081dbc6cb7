"""The paired-rounds helper of benchmarks/ computes what BENCHMARKS.md says it does (no timing here:
the workload reports made-up durations, so every figure is known exactly)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from _harness.benchmarks import load_benchmark

paired = load_benchmark("_paired")


class FakeWork:
    """Each run 'takes' size x unit seconds, times 1.25 while B is active, plus a linear drift."""

    def __init__(self, drift: float = 0.0) -> None:
        self.in_b = False
        self.order: list[str] = []
        self.drift = drift
        self.runs = 0

    @contextlib.contextmanager
    def b(self) -> Iterator[None]:
        self.in_b = True
        try:
            yield
        finally:
            self.in_b = False

    def __call__(self, size: int) -> float:
        self.runs += 1
        self.order.append("B" if self.in_b else "A")
        return size * (1.25 if self.in_b else 1.0) * (1 + self.drift * self.runs)


def test_abba_rounds_give_the_exact_ratio_and_a_unit_control() -> None:
    work = FakeWork()
    result = paired.paired_ratio(contextlib.nullcontext, work.b, work, size=4, budget_s=0, log=lambda _: None)
    assert result["paired"]["median"] == pytest.approx(1.25)
    assert result["control"]["median"] == pytest.approx(1.0)
    assert result["goal_reached"] is True
    assert result["paired"]["rounds"] >= 3
    # After the warm-up: ABBA then AAAA, the next round the other way round.
    assert work.order[1:9] == list("ABBAAAAA")
    assert work.order[9:17] == list("AAAAABBA")


def test_a_linear_drift_cancels_within_a_round() -> None:
    work = FakeWork(drift=0.01)
    result = paired.paired_ratio(contextlib.nullcontext, work.b, work, size=4, budget_s=0, log=lambda _: None)
    assert result["paired"]["median"] == pytest.approx(1.25, rel=1e-3)
    assert result["control"]["median"] == pytest.approx(1.0, rel=1e-3)


def test_median_interval_from_order_statistics() -> None:
    assert all(v != v for v in paired.median_ci([1.0] * 5))  # noqa: PLR0124 - NaN: too few values for 95%
    low, high = paired.median_ci([float(v) for v in range(1, 11)])
    assert (low, high) == (2.0, 9.0)  # ranks 2 and 9 of 10 cover the median with >= 95%
