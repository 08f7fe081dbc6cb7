"""A peak kept by a coarse level is drawn where it happened, also in a window that mixes levels.

Regression: decimation split a window by sample count, so after 6 h the few 30 s buckets of the
oldest stretch shared one chunk with thousands of finer points, and a spike was drawn 12 minutes
from its time in the panel's "all" view (1,000 points per line).
"""

from __future__ import annotations

import math

from gpumem.core.sampling.timeline import Timeline

SPIKE_AT_S = 1430.2


def test_a_spike_in_the_coarse_stretch_is_drawn_near_its_time() -> None:
    timeline = Timeline()
    samples = int((23_520.1 - 1000.0) * 10) + 1  # 6.3 h at 10 Hz: the oldest part is left only at 30 s
    for i in range(samples):
        time_s = 1000.0 + i * 0.1
        timeline.append(time_s, {"a": 30.0 if abs(time_s - SPIKE_AT_S) < 1e-6 else 1.0})
    for points in (1000, 2000):
        series = timeline.window(max_points=points)
        span_s = series.times[-1] - series.times[0]
        at = [t for t, v in zip(series.times, series.values["a"], strict=True) if v == 30.0]
        assert len(series.times) <= points
        assert at, "the spike was lost"
        # One decimation chunk (2 * span / points) plus one 30 s bucket.
        assert min(abs(t - SPIKE_AT_S) for t in at) <= 2 * span_s / points + 30.0, (points, at)
    assert math.isclose(max(timeline.window(1400, 1500).values["a"]), 30.0)
