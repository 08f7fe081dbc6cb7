import math
import random

import pytest

from gpumem.core.timeline import DEFAULT_LEVELS, Level, Timeline, decimate_min_max


def test_raw_samples_come_back_unchanged_when_few():
    timeline = Timeline()
    for i in range(10):
        timeline.append(float(i), {"a": float(i * i)})
    series = timeline.window()
    assert series.times == [float(i) for i in range(10)]
    assert series.values["a"] == [float(i * i) for i in range(10)]


def test_decimation_bounds_points_and_keeps_extremes():
    rng = random.Random(7)
    times = [i * 0.1 for i in range(100_000)]
    values = [rng.random() for _ in times]
    values[31_337] = 1e9
    values[77_777] = -1e9
    series = decimate_min_max(times, {"v": values}, max_points=2_000)
    assert len(series.times) <= 2_000
    assert len(series.values["v"]) == len(series.times)
    assert max(series.values["v"]) == 1e9
    assert min(series.values["v"]) == -1e9
    assert series.times == sorted(series.times)


def test_decimation_keeps_extreme_order_within_a_bucket():
    times = [float(i) for i in range(8)]
    values = [0.0, 5.0, 1.0, 1.0, 1.0, 1.0, -5.0, 0.0]
    series = decimate_min_max(times, {"v": values}, max_points=4)
    assert series.values["v"] == [0.0, 5.0, 1.0, -5.0]


def test_window_selects_range_and_channels_can_appear_later():
    timeline = Timeline()
    for i in range(100):
        values = {"a": float(i)}
        if i >= 50:
            values["b"] = float(-i)
        timeline.append(float(i), values)
    series = timeline.window(start_s=40.0, end_s=60.0)
    assert series.times[0] == 40.0 and series.times[-1] == 60.0
    assert math.isnan(series.values["b"][0])
    assert series.values["b"][-1] == -60.0


def test_peak_survives_after_raw_level_wraps():
    timeline = Timeline(levels=(Level(0.0, 100), Level(1.0, 1_000), Level(10.0, 1_000)))
    for i in range(5_000):
        t = i * 0.1
        timeline.append(t, {"a": 123.0 if i == 17 else 1.0})
    series = timeline.window()
    assert max(series.values["a"]) == 123.0
    assert series.times == sorted(series.times)
    recent = timeline.window(start_s=495.0)
    assert all(v == 1.0 for v in recent.values["a"])


def test_times_must_not_go_backwards():
    timeline = Timeline()
    timeline.append(1.0, {"a": 1.0})
    with pytest.raises(ValueError):
        timeline.append(0.5, {"a": 1.0})


def test_invalid_levels_are_refused():
    with pytest.raises(ValueError):
        Timeline(levels=(Level(1.0, 10),))
    with pytest.raises(ValueError):
        Timeline(levels=(Level(0.0, 10), Level(5.0, 10), Level(1.0, 10)))


def test_memory_is_bounded_for_a_day_at_the_default_rate():
    timeline = Timeline()
    channels = ["cuda:0/allocated", "cuda:0/reserved", "cuda:0/used", "host/rss"]
    day_at_10_hz = 24 * 3600 * 10
    step = 0.1
    for i in range(0, day_at_10_hz, 7):
        timeline.append(i * step, dict.fromkeys(channels, float(i)))
    assert timeline.nbytes() < 64 * 2**20
    series = timeline.window(max_points=2_000)
    assert len(series.times) <= 2_000
    assert max(series.values["host/rss"]) >= (day_at_10_hz - 7 * 2) * 1.0


def test_default_levels_cover_a_week():
    assert DEFAULT_LEVELS[-1].span_s * DEFAULT_LEVELS[-1].capacity >= 7 * 24 * 3600


def test_marks_and_latest():
    timeline = Timeline()
    assert timeline.latest() is None
    timeline.append(1.0, {"a": 2.0})
    timeline.add_mark(1.5, "[3]")
    timeline.append(2.0, {"a": 3.0})
    assert timeline.latest() == (2.0, {"a": 3.0})
    assert [m.label for m in timeline.marks(0, 10)] == ["[3]"]
    assert timeline.marks(1.6, 10) == []
    timeline.clear()
    assert timeline.latest() is None and timeline.marks() == []


def test_coarse_buckets_never_overlap_raw_samples():
    timeline = Timeline()
    for i in range(100):
        timeline.append(1000.0 + i * 0.05, {"a": float(i)})
    series = timeline.window()
    assert series.times == sorted(series.times)
    assert len(series.times) == 100
