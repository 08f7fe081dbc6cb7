"""gpumem.measure: the per-cell report for a block of a script."""

from __future__ import annotations

import pytest

import gpumem
from gpumem.monitor import Monitor, default_monitor, set_default_monitor
from gpumem.testing import GIB, MIB, FakeSource


@pytest.fixture
def fake() -> FakeSource:
    source = FakeSource()
    previous = set_default_monitor(Monitor(source))
    yield source
    set_default_monitor(previous)


def test_a_block_is_measured_like_a_cell(fake: FakeSource) -> None:
    kept = fake.allocate(GIB)
    with gpumem.measure("epoch 1") as m:
        fake.allocate(256 * MIB)
        fake.transient(2 * GIB)
    record = m.record
    assert record is not None
    change = record.devices[0]
    assert change.allocated_delta_bytes == 256 * MIB
    assert change.peak_above_start_bytes == 2 * GIB + 256 * MIB
    assert record.status == "ok"
    assert "epoch 1" in repr(m.report)
    assert gpumem.measured()[-1] is record
    fake.free(kept)


def test_an_exception_is_recorded_and_still_raised(fake: FakeSource) -> None:
    with pytest.raises(ZeroDivisionError), gpumem.measure("bad block") as m:
        1 / 0  # noqa: B018
    assert m.record is not None and m.record.status == "error"


def test_sampling_runs_only_inside_the_block(fake: FakeSource) -> None:
    with gpumem.measure("block"):
        assert default_monitor().running
    assert not default_monitor().running


def test_bad_labels_are_refused() -> None:
    with pytest.raises(ValueError, match="label"):
        gpumem.measure("")
    with pytest.raises(RuntimeError, match="not finished"):
        _ = gpumem.measure("x").report
