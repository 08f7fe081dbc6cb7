"""The writer thread's CPU budget: pushes are spaced by what they cost, and a command is answered at once."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest

from gpumem.core.monitor import Monitor
from gpumem.panel import widget as widget_module
from gpumem.panel.traffic import CommRecorder
from gpumem.panel.widget import Panel, close_all
from gpumem.panel.writer import MAX_SPACING_S, WRITER_CPU_BUDGET, PushSchedule, shared_writer
from gpumem.testing import GIB, FakeSource


@pytest.fixture(autouse=True)
def _clean_panels() -> Iterator[None]:
    yield
    close_all()


def test_the_first_pass_does_not_count_and_later_ones_set_the_spacing_by_their_median() -> None:
    schedule = PushSchedule()
    assert schedule.spacing_s(1) == 0.0  # nothing known: the panel's own intervals apply
    schedule.note_push_cost(0.5)  # the first pass builds the widgets: not a push's usual cost
    assert schedule.push_cpu_s == 0.0
    for cost in (0.001, 0.002, 0.0015, 0.2):  # one pass slowed by a collection
        schedule.note_push_cost(cost)
    assert schedule.push_cpu_s == pytest.approx(0.00175)
    assert schedule.spacing_s(1) == pytest.approx(0.00175 / WRITER_CPU_BUDGET)
    assert schedule.spacing_s(2) == pytest.approx(2 * 0.00175 / WRITER_CPU_BUDGET)  # two shown panels share it
    schedule.note_push_cost(-1.0)  # a clock that went backwards is ignored
    assert schedule.push_cpu_s == pytest.approx(0.00175)


def test_however_costly_a_push_a_shown_panel_is_updated_every_few_seconds() -> None:
    schedule = PushSchedule()
    for _ in range(8):
        schedule.note_push_cost(1.0)
    assert schedule.spacing_s(1) == MAX_SPACING_S
    assert schedule.spacing_s(4) == MAX_SPACING_S


class _CpuClock:
    """``time.thread_time`` for the pass under test: each pass (two reads) costs ``cost_s``."""

    def __init__(self, cost_s: float) -> None:
        self.cost_s = cost_s
        self._reads = itertools.count()

    def __call__(self) -> float:
        read = next(self._reads)
        return read // 2 * 10.0 + (read % 2) * self.cost_s


def _shown_panel(monitor: Monitor) -> Panel:
    panel = Panel(monitor)
    panel._repr_mimebundle_()
    panel.set_state({"_view_count": 1})
    shared_writer.remove(panel._service)  # this test runs the panel's passes itself
    return panel


@pytest.mark.parametrize(("cost_s", "spaced"), [(0.0001, False), (0.004, True)])
def test_a_panel_pushes_its_curves_as_often_as_its_passes_cost_allows(
    monkeypatch: pytest.MonkeyPatch, cost_s: float, spaced: bool
) -> None:
    source = FakeSource(devices=1, total_bytes=80 * GIB)
    source.allocate(8 * GIB)
    monitor = Monitor(source)
    with CommRecorder():
        panel = _shown_panel(monitor)
        monkeypatch.setattr(widget_module.time, "thread_time", _CpuClock(cost_s))
        intervals = []
        for _ in range(6):
            monitor.sampler.sample_once()
            panel._schedule.invalidate()  # due now: each pass pushes
            before = time.monotonic()
            panel._service()
            intervals.append(panel._schedule.next_curves - before)
    usual = panel._stats.last_interval_s  # what the window and the traffic budget ask for
    expected = min(MAX_SPACING_S, cost_s / WRITER_CPU_BUDGET) if spaced else usual
    assert expected > usual if spaced else cost_s / WRITER_CPU_BUDGET < usual  # the case is what it says
    assert intervals[-1] == pytest.approx(expected, abs=0.05)
    assert panel._schedule.next_header - time.monotonic() <= expected + 0.05  # the header goes with them
    monitor.stop()


def test_a_command_is_answered_at_once_whatever_the_spacing(monkeypatch: pytest.MonkeyPatch) -> None:
    source = FakeSource(devices=1, total_bytes=80 * GIB)
    monitor = Monitor(source)
    with CommRecorder():
        panel = _shown_panel(monitor)
        monkeypatch.setattr(widget_module.time, "thread_time", _CpuClock(1.0))
        for _ in range(4):
            monitor.sampler.sample_once()
            panel._schedule.invalidate()
            panel._service()
        assert panel._schedule.next_curves - time.monotonic() > MAX_SPACING_S - 0.5
        pushes = panel._stats.curve_pushes
        panel._service(force=True)  # what a Refresh, a control changed or Free's result does
        assert panel._stats.curve_pushes == pushes + 1
    monitor.stop()
