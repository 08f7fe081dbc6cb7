"""The staircase rule on synthetic sampled series, and the kinds and gradient wording (pure functions)."""

from __future__ import annotations

import random

import pytest

from gpumem.core.cells.kind_changes import kind_changes, kinds_line, read_kinds
from gpumem.core.cells.patterns import Staircase, find_staircase, gradient_note, has_optimizer, staircase_warning
from gpumem.core.cells.record import KindChange, VariableChange
from gpumem.core.holders.model import KindTotal
from gpumem.testing import GIB, MIB

RATE_S = 0.1  # the sampler's 10 Hz


def sampled(levels: list[float], base: float = GIB) -> tuple[list[float], list[float]]:
    """Samples 0.1 s apart at ``base + level``."""
    return [i * RATE_S for i in range(len(levels))], [base + level for level in levels]


def staircase_levels(steps: int, step: float, flat_between: int = 1, jitter: float = 0.0) -> list[float]:
    """``steps`` rises of ``step`` (each +- ``jitter``), ``flat_between`` unchanged samples after each."""
    rng = random.Random(7)
    levels, level = [0.0, 0.0], 0.0
    for _ in range(steps):
        level += step * (1 + rng.uniform(-jitter, jitter))
        levels += [level] * (1 + flat_between)
    return levels


def test_thirty_steps_of_64_mib_are_a_staircase() -> None:
    times, values = sampled(staircase_levels(30, 64 * MIB))
    found = find_staircase(times, values)
    assert found == Staircase(steps=30, step_bytes=64 * MIB, rise_bytes=30 * 64 * MIB, duration_s=pytest.approx(5.9))
    assert found is not None and found.rate_bytes_per_s == pytest.approx(30 * 64 * MIB / 5.9)


def test_steps_that_vary_within_a_fifth_and_small_noise_still_count() -> None:
    levels = staircase_levels(10, 32 * MIB, flat_between=2, jitter=0.1)
    rng = random.Random(3)
    noisy = [level + rng.uniform(-100_000, 100_000) for level in levels]  # allocator noise under 1 MiB
    found = find_staircase(*sampled(noisy))
    assert found is not None and found.steps == 10
    assert 29 * MIB < found.step_bytes < 35 * MIB


def test_a_sampling_delay_that_merges_two_steps_once_is_tolerated() -> None:
    levels = staircase_levels(12, 64 * MIB)
    del levels[6:8]  # one interval sees two steps
    found = find_staircase(*sampled(levels))
    assert found is not None and found.steps == 10  # the merged rise is not counted as a step


def test_a_sawtooth_training_loop_is_not_a_staircase() -> None:
    # Forward allocates activations in steps, backward frees them: every iteration falls back.
    levels: list[float] = []
    for _ in range(20):
        levels += [0, 64 * MIB, 128 * MIB, 192 * MIB, 0]
    assert find_staircase(*sampled(levels)) is None


def test_a_slowly_rising_sawtooth_is_not_a_staircase() -> None:
    # Each iteration keeps 1 MiB more but frees its 200 MiB of activations: no step is kept.
    levels: list[float] = []
    for i in range(30):
        levels += [i * MIB, i * MIB + 200 * MIB]
    assert find_staircase(*sampled(levels)) is None
    # Sampled with flat stretches, keeping 3 MiB per iteration (90 MiB in all): still not a staircase.
    levels = []
    for i in range(30):
        levels += [i * 3 * MIB, i * 3 * MIB + 200 * MIB, i * 3 * MIB + 200 * MIB, i * 3 * MIB]
    assert find_staircase(*sampled(levels)) is None


def test_one_big_allocation_is_not_a_staircase() -> None:
    assert find_staircase(*sampled([0, 0, 0, 2 * GIB, 2 * GIB, 2 * GIB])) is None
    assert find_staircase(*sampled([0.0] * 5 + [2.0 * GIB] * 50)) is None


def test_noise_is_not_a_staircase() -> None:
    rng = random.Random(11)
    assert find_staircase(*sampled([rng.uniform(0, 64 * MIB) for _ in range(200)])) is None


def test_too_few_steps_too_small_or_dissimilar_steps_are_not_a_staircase() -> None:
    assert find_staircase(*sampled(staircase_levels(4, 64 * MIB))) is None
    assert find_staircase(*sampled(staircase_levels(30, MIB))) is None  # 30 MiB in all, below 64 MiB
    assert find_staircase(*sampled(staircase_levels(30, MIB)), min_total_bytes=16 * MIB) is not None
    mixed: list[float] = [0.0]
    for step in [8, 64, 16, 128, 32, 8, 64, 16, 128, 32]:
        mixed += [mixed[-1] + step * MIB, mixed[-1] + step * MIB]
    assert find_staircase(*sampled(mixed)) is None


def test_steps_faster_than_the_samples_say_nothing() -> None:
    # Every interval rose: several steps may hide in each one, so their size is unknown.
    levels = [i * 96.0 * MIB for i in range(30)]
    assert find_staircase(*sampled(levels)) is None


def test_a_staircase_that_ends_freed_is_not_one() -> None:
    levels = [*staircase_levels(10, 64 * MIB), 0.0]
    assert find_staircase(*sampled(levels)) is None


def test_missing_samples_are_skipped() -> None:
    times, values = sampled(staircase_levels(8, 64 * MIB))
    values[3] = float("nan")
    assert find_staircase(times, values) is not None
    assert find_staircase([], []) is None


def test_the_warning_names_the_variable_only_when_it_explains_the_growth() -> None:
    found = Staircase(steps=30, step_bytes=64 * MIB, rise_bytes=30 * 64 * MIB, duration_s=1.5)
    acc = VariableChange("acc", "list", "cuda:0", 30 * 64 * MIB, None, hidden=False)
    small = VariableChange("tmp", "Tensor", "cuda:0", 64 * MIB, None, hidden=False)
    (_, message) = staircase_warning("cuda:0", found, [acc])
    assert message.startswith(
        "cuda:0 allocated memory rose in 30 steps of ~64.0 MiB (+1.9 GiB) over 1.5 s (1.2 GiB/s) and never fell: "
        "something accumulates per iteration; `acc` grew most (+1.9 GiB)"
    )
    assert "`tmp`" not in staircase_warning("cuda:0", found, [small]).message


def test_kinds_line_shows_only_kinds_that_changed_by_a_mib() -> None:
    before = read_kinds(type("R", (), {"kinds": (KindTotal("parameters", 400 * MIB), KindTotal("buffers", 10))})())
    after = (("parameters", 400 * MIB), ("gradients", 400 * MIB), ("activations (saved by autograd graphs)", 3 * MIB))
    changes = kind_changes(before, after)
    assert changes[-1] == KindChange("buffers", 10, 0)
    line = kinds_line(changes, "since cell [3]")
    assert line == "by kind (since cell [3]): gradients +400.0 MiB, activations +3.0 MiB"
    assert kinds_line(kind_changes(after, after), "since cell [3]") == ""
    assert read_kinds(object()) == () and read_kinds(type("R", (), {"kinds": "bad"})()) == ()


def test_gradient_note_only_when_gradients_grew() -> None:
    grew = [KindChange("gradients", 0, 400 * MIB)]
    note = gradient_note(grew, [("model", 400 * MIB)], 64 * MIB)
    assert note == (
        "gradients are kept after the cell (400.0 MiB: `model` 400.0 MiB); "
        "optimizer.zero_grad(set_to_none=True) after the last step frees them until the next backward()"
    )
    assert gradient_note([KindChange("gradients", 400 * MIB, 400 * MIB)], [("model", 400 * MIB)], 64 * MIB) is None
    assert gradient_note([KindChange("gradients", 0, 8 * MIB)], [("model", 8 * MIB)], 64 * MIB) is None
    assert gradient_note(grew, [], 64 * MIB) is None


def test_has_optimizer_looks_for_an_optimizer_instance() -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(2, 2)
    assert has_optimizer({"opt": torch.optim.SGD(model.parameters(), lr=0.1)}, torch)
    assert not has_optimizer({"model": model, "SGD": torch.optim.SGD}, torch)
    assert not has_optimizer(None, torch) and not has_optimizer({"x": 1}, None)
