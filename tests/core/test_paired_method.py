"""The paired-rounds helper of benchmarks/ computes what BENCHMARKS.md says it does (no timing here:
the workload reports made-up durations, so every figure is known exactly)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from types import SimpleNamespace

import pytest

from _harness.benchmarks import load_benchmark

paired = load_benchmark("_paired")


def quiet(_: str) -> None:
    """A log that keeps the test output clean."""


class FakeWork:
    """Each run 'takes' size x unit seconds, times 1.25 while B is active, plus a linear drift.

    ``order`` has each run's variant; ``events`` has one item per variant entry, the runs made in it
    ("BB": B entered once for two runs), "-A" for a run outside any entry, and "gc" where the test
    records collections: the grouping is what the quads' shared middle entry is about.
    """

    def __init__(self, drift: float = 0.0) -> None:
        self.in_b = False
        self.inside = False
        self.order: list[str] = []
        self.sizes: list[int] = []
        self.events: list[str] = []
        self.drift = drift
        self.runs = 0

    @contextlib.contextmanager
    def _variant(self, *, in_b: bool) -> Iterator[None]:
        assert not self.inside, "variants never nest"
        self.in_b, self.inside = in_b, True
        self.events.append("")
        try:
            yield
        finally:
            self.in_b = self.inside = False

    def a(self) -> AbstractContextManager[None]:
        return self._variant(in_b=False)

    def b(self) -> AbstractContextManager[None]:
        return self._variant(in_b=True)

    def seconds(self, size: int) -> float:
        return size * (1.25 if self.in_b else 1.0) * (1 + self.drift * self.runs)

    def __call__(self, size: int) -> float:
        self.runs += 1
        letter = "B" if self.in_b else "A"
        self.order.append(letter)
        self.sizes.append(size)
        if self.inside:
            self.events[-1] += letter
        else:
            self.events.append("-" + letter)
        return self.seconds(size)


class NoisyControl(FakeWork):
    """The second middle run of each A/A quad takes 1.5x, then 0.5x, then 1.5x ... of its time.

    A round of one A/A quad thus has a control of 1.25 or 0.75 (far outside ±1%), while two adjacent
    rounds summed, or a round of two quads, have exactly 1. Each run moves a fake clock on by its
    seconds, so that a budget admits a known number of rounds.
    """

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.second_middles = 0

    def seconds(self, size: int) -> float:
        seconds = super().seconds(size)
        if self.events[-1] == "AA":  # the second run of an A entry: only an A/A quad's middle has two
            self.second_middles += 1
            seconds *= 1.5 if self.second_middles % 2 else 0.5
        self.now += seconds
        return seconds


def test_abba_rounds_give_the_exact_ratio_and_a_unit_control() -> None:
    work = FakeWork()
    result = paired.paired_ratio(work.a, work.b, work, size=4, budget_s=0, log=quiet)
    assert result["paired"]["median"] == pytest.approx(1.25)
    assert result["control"]["median"] == pytest.approx(1.0)
    assert result["goal_reached"] is True
    assert result["paired"]["rounds"] == 3  # a budget of 0 runs min(3, min_rounds) rounds
    assert result["quads"] == 1
    assert result["tried"] == [(4, 1)]


def test_each_round_starts_with_a_collection_and_an_untimed_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """No timed run is the first after a collection, and B is entered once per A/B quad, not per run."""
    work = FakeWork()
    monkeypatch.setattr(paired, "gc", SimpleNamespace(collect=lambda: work.events.append("gc")))
    paired.paired_ratio(work.a, work.b, work, size=4, budget_s=0, log=quiet)
    warm_up, round_warm_up, ab, aa = ["-A"], ["gc", "A"], ["A", "BB", "A"], ["A", "AA", "A"]
    first_round, second_round = round_warm_up + ab + aa, round_warm_up + aa + ab
    assert work.events[:17] == warm_up + first_round + second_round
    # The paired run's own warm-up is a quarter as long; every run after it has the round's size.
    assert work.sizes[0] == 1
    assert set(work.sizes[1:]) == {4}
    assert "".join(work.order[:19]) == "A" + "A" + "ABBA" + "AAAA" + "A" + "AAAA" + "ABBA"
    assert [event for event in work.events if "B" in event] == ["BB"] * 3  # one entry per A/B quad
    assert work.events.count("gc") == 3
    assert work.runs == 1 + 3 * (1 + 8)


def test_quads_alternate_their_order_within_and_across_rounds() -> None:
    work = FakeWork()
    result = paired.paired_ratio(work.a, work.b, work, size=4, budget_s=0, quads=2, log=quiet)
    round_runs = 1 + 2 * 2 * 4
    first = "".join(work.order[1 : 1 + round_runs])
    second = "".join(work.order[1 + round_runs : 1 + 2 * round_runs])
    assert first == "A" + "ABBA" + "AAAA" + "AAAA" + "ABBA"
    assert second == "A" + "AAAA" + "ABBA" + "ABBA" + "AAAA"
    assert result["ratios"] == [1.25] * 3  # exact: every sum is of whole fake seconds
    assert result["controls"] == [1.0] * 3
    assert result["quads"] == 2
    assert result["tried"] == [(4, 2)]
    assert [event for event in work.events if "B" in event] == ["BB"] * 6


def test_a_linear_drift_cancels_within_a_round() -> None:
    work = FakeWork(drift=0.01)
    result = paired.paired_ratio(work.a, work.b, work, size=4, budget_s=0, log=quiet)
    assert result["paired"]["median"] == pytest.approx(1.25, rel=1e-3)
    assert result["control"]["median"] == pytest.approx(1.0, rel=1e-3)


def test_a_linear_drift_cancels_over_several_quads() -> None:
    """Each quad is an ABBA of its own, so the drift cancels quad by quad, whatever the quads' number."""
    work = FakeWork(drift=0.01)
    result = paired.paired_ratio(work.a, work.b, work, size=4, budget_s=0, quads=3, log=quiet)
    assert work.runs == 1 + 3 * (1 + 3 * 2 * 4)  # the drift reaches +75% by the last run
    assert result["paired"]["median"] == pytest.approx(1.25, rel=1e-3)
    assert result["control"]["median"] == pytest.approx(1.0, rel=1e-3)
    assert all(ratio == pytest.approx(1.25, rel=1e-3) for ratio in result["ratios"])


def test_merged_rounds_sum_their_seconds_and_drop_an_odd_last() -> None:
    first = paired.RoundSums(5.0, 4.0, 3.0, 2.0)
    second = paired.RoundSums(1.0, 4.0, 1.0, 6.0)
    third = paired.RoundSums(9.0, 9.0, 9.0, 9.0)
    assert first + second == paired.RoundSums(6.0, 8.0, 4.0, 8.0)
    (merged,) = paired._merged([first, second, third])
    assert merged == paired.RoundSums(6.0, 8.0, 4.0, 8.0)
    # The ratios of the summed seconds, not the mean of the rounds' ratios (1.25 and 0.25 -> 0.75).
    assert merged.paired == 0.75
    assert merged.control == 0.5
    assert paired._merged([first]) == []


def test_grow_quads_joins_rounds_while_the_control_is_wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds of one A/A quad give controls of 1.25 and 0.75; joined two by two they give exactly 1.

    A budget of 0 stops at min(3, min_rounds) rounds, before the 2 * min_rounds that joining needs,
    so a fake clock moved by the fake seconds gives a budget of a known number of rounds: a round of
    one quad each way is 4 + 18 + 18 (or 14) seconds, the paired run's warm-up 1. With min_rounds=2,
    rounds 1-4 of one quad end at 41, 77, 117 and 153; the four are joined into two, and one round
    of two quads (72 s) ends at 225, after which 25 s are left, less than a round.
    """
    work = NoisyControl()
    monkeypatch.setattr(paired, "time", SimpleNamespace(monotonic=lambda: work.now))
    lines: list[str] = []
    result = paired.paired_ratio(
        work.a, work.b, work, size=4, budget_s=250, grow="quads", min_rounds=2, log=lines.append
    )
    assert result["quads"] == 2
    assert result["tried"] == [(4, 1), (4, 2)]
    assert result["sizes_tried"] == [4, 4]
    assert result["size"] == 4
    assert result["paired"]["rounds"] == 3  # two joined and one measured with two quads
    assert result["ratios"] == [1.25] * 3
    assert result["controls"] == [1.0] * 3
    assert result["goal_reached"] is True
    assert result["elapsed_s"] == 225
    assert sum("joining rounds" in line for line in lines) == 1
    assert [event for event in work.events if "B" in event] == ["BB"] * (4 + 2)


def test_an_unknown_growth_is_refused_before_anything_runs() -> None:
    work = FakeWork()
    with pytest.raises(ValueError, match="bogus"):
        paired.paired_ratio(work.a, work.b, work, size=4, budget_s=0, grow="bogus", log=quiet)
    assert work.runs == 0


@pytest.mark.parametrize(("quads", "shape"), [(4, "3 x 4 quads x 8"), (1, "3 x 8")])
def test_the_shape_names_the_quads_only_where_there_are_several(quads: int, shape: str) -> None:
    work = FakeWork()
    result = paired.paired_ratio(work.a, work.b, work, size=8, budget_s=0, quads=quads, log=quiet)
    described = paired.describe(result)
    row = paired.markdown_row("fake", result)
    assert f"rounds x quads x size {shape};" in described
    assert f"| {shape} |" in row
    assert ("quads" in row) is (quads > 1)
    assert described.count("quads") == 1 + (quads > 1)  # the label's, and the shape's where it has some
