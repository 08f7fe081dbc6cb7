"""The per-thread CPU readings of benchmarks/bench_threads.py: parsing /proc and turning two readings into
rates (no timing here: the inputs are written out, so every figure is known exactly)."""

from __future__ import annotations

import pytest

from _harness.benchmarks import load_benchmark

bench = load_benchmark("bench_threads")

# A real /proc/<pid>/task/<tid>/stat line, with a thread name holding spaces and a parenthesis.
STAT = (
    "4242 (gpumem (x) y) S 1 4242 4242 0 -1 4194368 120 0 0 0 37 13 0 0 20 0 3 0 12345 1000 100 "
    "18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0"
)


def test_stat_ticks_are_utime_plus_stime_after_the_name() -> None:
    assert bench.proc_stat_ticks_s(STAT, 100) == pytest.approx(0.50)  # (37 + 13) ticks at 100 Hz


def test_schedstat_fields() -> None:
    assert bench.proc_schedstat_s("1500000000 250000 42\n") == pytest.approx(1.5)
    assert bench.proc_schedstat_runs("1500000000 250000 42\n") == 42


def test_per_second_keys_threads_by_tid() -> None:
    before = {("gpumem-sampler", 10): 1.0, ("gpumem-panel-writer", 11): 2.0, ("gpumem-sampler", 9): 5.0}
    after = {
        ("gpumem-sampler", 10): 1.5,  # the same thread: 0.5 s more
        ("gpumem-sampler", 12): 0.25,  # a namesake started in between: counted from 0
        ("gpumem-panel-writer", 11): 3.0,  # tid 9 ended in between: not counted, not subtracted
    }
    rates = bench.per_second(after, before, 2.0)
    assert rates == {"gpumem-sampler": pytest.approx(0.375), "gpumem-panel-writer": pytest.approx(0.5)}


def test_method_check_line_names_each_method() -> None:
    burner, sleeper = bench.METHOD_CHECK_NAMES
    check = {
        "burn_ms_per_s": 50.0,
        "burner_self_metered_ms_per_s": 49.9,
        "measured_ms_per_s": {
            "clock": {burner: 49.8, sleeper: 0.41},
            "proc_schedstat": {burner: 49.8, sleeper: 0.41},
            "proc_ticks": {burner: 50.0},
        },
        "clock_read_other_thread_us": 0.4,
    }
    line = bench.method_check_line(check)
    assert line.startswith("method check: burner 50.0 ms/s (self-metered 49.9) measured 49.8 (clock) / 49.8 ")
    assert "/ 50 (proc ticks)" in line
    assert "sleeper at 10 Hz 0.41 / 0.41 / 0;" in line
    assert "costs 0.40 us" in line


def test_the_holders_case_hides_the_view_then_gives_it_back() -> None:
    from gpumem.core.monitoring.monitor import Monitor
    from gpumem.panel.widget import Panel, close_all
    from gpumem.testing import FakeSource

    monitor = Monitor(FakeSource())
    panel = Panel(monitor, autostart=False)
    try:
        shown = panel.children
        with bench.holders_shown(panel, shown=False):
            assert panel._holders not in panel.children and len(panel.children) == len(shown) - 1
            assert panel._control.after_cells(True) is False  # no walk while hidden
        assert panel.children == shown and "after_cells" not in vars(panel._control)
        with bench.holders_shown(panel, shown=True):
            assert panel.children == shown
    finally:
        close_all()
        monitor.stop()
