"""probe_noise.py's replay of a paired design over recorded step times (made-up series: every figure is known)."""

from __future__ import annotations

import pytest

from _harness.benchmarks import load_benchmark

probe = load_benchmark("probe_noise")


def test_a_steady_or_linearly_drifting_loop_replays_as_exactly_one() -> None:
    """ABBA cancels a linear drift, so both series give A/A ratios of exactly 1."""
    for steps in ([0.002] * 4000, [0.002 + 1e-7 * i for i in range(4000)]):
        result = probe.play(steps, block=10, quads=2)
        assert result["rounds"] == 2 * (4000 // (10 * 8 * 2))  # two A/A ratios a round
        assert result["q1"] == pytest.approx(1.0)
        assert result["q3"] == pytest.approx(1.0)


def test_slow_middle_runs_show_in_the_replayed_ratio() -> None:
    """Runs 2 and 3 of every quad twice as slow: each replayed ratio is 2, so the replay reads real positions."""
    block = 5
    runs = [1.0, 2.0, 2.0, 1.0] * 64
    steps = [run / block for run in runs for _ in range(block)]
    result = probe.play(steps, block=block, quads=4)
    assert result["median"] == pytest.approx(2.0)
    assert result["round_s"] == pytest.approx(8 * 4 * 1.5)


def test_too_short_a_series_gives_no_quartiles() -> None:
    result = probe.play([0.002] * 100, block=25, quads=4)
    assert "q1" not in result
