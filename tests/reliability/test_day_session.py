"""A simulated 24 h session at the default 10 Hz through the monitor's sampler, on a fake clock:
the memory held stays bounded and every injected spike is visible in every window the panel offers.

The fake allocator's clock is replaced (no sleeping); samples go through ``Sampler.sample_once``, the
same path the sampler thread takes, and each view is read with ``build_curve_frame``, what the panel
pushes. Spikes last one sample (100 ms), the hardest case for decimation.
"""

from __future__ import annotations

import math
import random
import time
import tracemalloc
from typing import Any

import numpy as np
import pytest

import gpumem.testing as testing_module
from gpumem.core.monitoring.monitor import Monitor
from gpumem.core.sampling.sampler import MAX_RATE_HZ as DEFAULT_RATE_HZ  # the fastest rate a view asks for
from gpumem.panel.curves import build_curve_frame
from gpumem.panel.options import DEFAULT_POINTS_PER_LINE, MAX_POINTS_PER_LINE, WINDOW_PRESETS, PanelOptions
from gpumem.testing import GIB, MIB, FakeSource

DAY_S = 24 * 3600
SPIKES = 200
MARK_EVERY_S = 300  # a measured cell every 5 minutes leaves a mark
SPIKE_BASE = 30 * GIB
SPIKE_STEP = 64 * MIB  # spikes are distinct and exact in float32 GiB (30 + k/16)


class FakeClock:
    """Stands in for the ``time`` module inside gpumem.testing: the session's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1.7e9 + self.now


def _views() -> list[PanelOptions]:
    return [
        PanelOptions(window_s=window_s, points_per_line=points)
        for _, window_s in WINDOW_PRESETS
        for points in (DEFAULT_POINTS_PER_LINE, MAX_POINTS_PER_LINE)
    ]


def _check_views(monitor: Monitor, now_s: float, spikes: dict[float, int], total: int) -> int:
    """Every spike inside each view's window appears there, at its value, near its time. Returns checks made."""
    checks = 0
    for options in _views():
        frame = build_curve_frame(monitor.timeline, options, now_s, 0.0, {0: total})
        row = [c.channel for c in frame.curves].index("cuda:0/allocated")
        values = frame.y[row].astype(np.float64) * frame.unit_bytes
        start = -math.inf if options.window_s is None else now_s - options.window_s
        span = (now_s - max(start, frame.x_ms[0] / 1000.0)) if len(frame.x_ms) else 0.0
        slack_s = 2 * span / options.points_per_line + 31.0  # a decimation chunk and a 30 s bucket
        for time_s, nbytes in spikes.items():
            if not start <= time_s <= now_s:
                continue
            # Two spikes in one decimation chunk show as the higher one: the curve reaches at least this one.
            near = np.abs(frame.x_ms / 1000.0 - time_s) <= slack_s
            shown = float(values[near].max()) if near.any() else 0.0
            assert shown >= float(np.float32(nbytes / frame.unit_bytes)) * frame.unit_bytes, (options, now_s, time_s)
            checks += 1
    return checks


def simulate_day(monkeypatch: pytest.MonkeyPatch, seed: int = 7) -> dict[str, Any]:
    clock = FakeClock()
    monkeypatch.setattr(testing_module, "time", clock)
    fake = FakeSource(devices=1)
    monitor = Monitor(fake)
    rng = random.Random(seed)
    period = 1.0 / DEFAULT_RATE_HZ
    samples = int(DAY_S * DEFAULT_RATE_HZ)
    spike_at = dict.fromkeys(sorted(rng.sample(range(10, samples - 10), SPIKES)), 0)
    for k, index in enumerate(spike_at):
        spike_at[index] = SPIKE_BASE + k * SPIKE_STEP
    check_at = {index + rng.randint(5, 500): index for index in spike_at}  # 0.5 s to 50 s after each spike
    seen: dict[float, int] = {}
    baseline = fake.allocate(1 * GIB)
    hour = int(3600 * DEFAULT_RATE_HZ)
    checks = 0
    held: dict[str, int] = {}
    started = time.monotonic()
    for i in range(samples):
        clock.now = 1000.0 + i * period
        if i % 6000 == 0:  # every 10 minutes the working set changes (1 to 10 GiB)
            fake.free(baseline)
            baseline = fake.allocate(rng.randint(1, 10) * GIB)
        if i % int(MARK_EVERY_S * DEFAULT_RATE_HZ) == 0:
            monitor.timeline.add_mark(clock.now, f"[{i}] cell")
        spike = spike_at.get(i)
        handle = fake.allocate(spike - fake.snapshot().allocator[0].allocated_bytes) if spike else None
        monitor.sampler.sample_once()
        if handle is not None:
            assert spike is not None
            seen[clock.now] = spike
            fake.free(handle)
        if i in check_at or i == samples - 1:
            checks += _check_views(monitor, clock.now, seen, fake.device_info(0).total_bytes)  # type: ignore[union-attr]
        if i == hour:
            held["timeline_after_1h"] = monitor.timeline.nbytes()
            tracemalloc.start()
            held["traced_at_1h"] = tracemalloc.get_traced_memory()[0]
    held["traced_growth_1h_to_24h"] = tracemalloc.get_traced_memory()[0] - held["traced_at_1h"]
    held["traced_peak"] = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    held["timeline_after_24h"] = monitor.timeline.nbytes()
    scratch = monitor.timeline._scratch  # the window reads' work arrays, kept up to a fixed size
    held["read_buffers"] = scratch.nbytes() if scratch is not None else 0
    held["read_buffers_cap"] = scratch.keep_bytes if scratch is not None else 0
    assert len(seen) == SPIKES
    return {
        "samples": samples,
        "spikes": len(seen),
        "view_checks": checks,
        "seconds": time.monotonic() - started,
        **held,
    }


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_a_day_at_10_hz_stays_bounded_and_keeps_every_spike(monkeypatch: pytest.MonkeyPatch) -> None:
    figures = simulate_day(monkeypatch)
    print(figures)
    assert figures["timeline_after_24h"] == figures["timeline_after_1h"]
    # The read buffers are bounded by design; everything else made after the first hour and still alive at
    # the end (marks, open buckets, caches) stays small.
    assert figures["read_buffers"] <= figures["read_buffers_cap"], figures
    assert figures["traced_growth_1h_to_24h"] - figures["read_buffers"] < 1 * MIB, figures
    assert figures["view_checks"] >= SPIKES * 4, figures
