import bisect
import math
import os
import random
import subprocess
import sys

import pytest

from _harness import SRC_DIR
from gpumem.core.sampling.timeline import DEFAULT_LEVELS, Level, Timeline, decimate_min_max


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


# ---- every sampled extreme stays visible: hand-overs between levels, windows inside buckets ----

INF = math.inf


def _feed(levels, count, step_s=0.1, marked=None, first_s=0.0):
    """A timeline of ``count`` samples of 1.0, ``step_s`` apart, but ``marked`` {index: value}."""
    marked = marked or {}
    timeline = Timeline(levels)
    times = [first_s + i * step_s for i in range(count)]
    for i, time_s in enumerate(times):
        timeline.append(time_s, {"v": marked.get(i, 1.0)})
    return timeline, times


def _window(timeline, start_s=-INF, end_s=INF, max_points=2_000):
    series = timeline.window(start_s, end_s, max_points)
    assert len(series.times) <= max_points
    assert len(series.values["v"]) == len(series.times)
    assert series.times == sorted(series.times)
    assert all(start_s <= t <= end_s for t in series.times)
    return series.values["v"]


def _assert_visible(timeline, at_s, value, far_s):
    """``value``, sampled at ``at_s``, shows in every window holding ``at_s`` and none ``far_s`` away."""
    pick = max if value > 1.0 else min
    for start in (-INF, at_s - 3.1, at_s - 0.35, at_s):
        for end in (at_s, at_s + 0.05, INF):
            for max_points in (4, 10**6):
                assert pick(_window(timeline, start, end, max_points)) == value, (at_s, start, end, max_points)
    for start, end in ((-INF, at_s - far_s), (at_s + far_s, INF)):
        values = _window(timeline, start, end, 4)
        assert value not in values, (at_s, start, end)


SWEEPS = {
    # raw 2 s, then 1 s buckets for ~8 s, then 4 s buckets: both hand-overs within the last 30 s
    "small": ((Level(0.0, 20), Level(1.0, 8), Level(4.0, 10)), 300, 0.1, 1),
    # the default levels' 1 s / 30 s shape with small rings: hand-overs ~5 s and ~45 s back
    "30s-buckets": ((Level(0.0, 50), Level(1.0, 45), Level(30.0, 10)), 1_200, 0.1, 7),
    # spans that do not divide each other, samples that do not line up with bucket edges
    "uneven": ((Level(0.0, 15), Level(1.0, 6), Level(1.7, 5), Level(3.4, 20)), 160, 0.37, 1),
}


@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_a_peak_and_a_trough_anywhere_stay_visible_in_every_window(name):
    levels, count, step_s, stride = SWEEPS[name]
    far_s = levels[-1].span_s * 2 + 0.11
    for i in range(0, count, stride):
        trough = (i + count // 2) % count
        timeline, times = _feed(levels, count, step_s, {i: 99.0, trough: -5.0})
        _assert_visible(timeline, times[i], 99.0, far_s)
        _assert_visible(timeline, times[trough], -5.0, far_s)
        assert max(_window(timeline, max_points=4)) == 99.0
        assert min(_window(timeline, max_points=4)) == -5.0


def test_the_spike_next_to_the_raw_hand_over_survives():
    """9,055 samples at 10 Hz: the raw ring has dropped samples 0-54, the 1 s level holds them."""
    timeline, _ = _feed(DEFAULT_LEVELS, 9_055, 0.1, {52: 99.0})
    for max_points in (4, 5, 2_000, 10**6):
        assert max(_window(timeline, max_points=max_points)) == 99.0
    assert max(_window(timeline, 5.0, 6.0)) == 99.0
    assert max(_window(timeline, 5.25, INF)) == 99.0  # starts inside the [5 s, 6 s) bucket, after the spike
    assert max(_window(timeline, 6.0, INF)) == 1.0


@pytest.mark.parametrize("index", [0, 9, 10, 49, 50, 52, 54, 55, 56, 59, 60, 61, 70, 9_054])
def test_a_spike_at_the_raw_to_1s_hand_over(index):
    timeline, times = _feed(DEFAULT_LEVELS, 9_055, 0.1, {index: 99.0})
    _assert_visible(timeline, times[index], 99.0, far_s=61.0)


def _hours_with_10hz_around(center_s, total_s):
    """1 Hz for ``total_s`` seconds, 10 Hz within a minute of ``center_s``: each second has a sample."""
    times = [float(s) for s in range(int(center_s) - 60)]
    times += [round(center_s - 60 + i * 0.1, 1) for i in range(1_200)]
    times += [float(s) for s in range(int(center_s) + 60, int(total_s))]
    return times


# The 1 s level holds 21,600 buckets: after 6 h 10 min of samples it has dropped the first ~610 s,
# which from then on only the 30 s level holds. The bucket where that happens is the hand-over.
_TOTAL_S = 21_600 + 611
_DROPPED_UP_TO_S = _TOTAL_S - 1 - 1 - 21_600  # the newest 1 s bucket dropped: [609 s, 610 s)
# so the 30 s level supplies [600 s, 630 s) whole and the 1 s level takes over from 630 s.


@pytest.mark.parametrize("offset_s", [-30.0, -9.1, -9.0, -0.1, 0.0, 0.5, 0.9, 1.0, 1.1, 20.9, 21.0, 31.0])
def test_a_spike_at_the_1s_to_30s_hand_over(offset_s):
    times = _hours_with_10hz_around(_DROPPED_UP_TO_S, _TOTAL_S)
    spike_s = _DROPPED_UP_TO_S + offset_s
    timeline = Timeline()
    for time_s in times:
        timeline.append(time_s, {"v": 99.0 if time_s == spike_s else 1.0})
    assert spike_s in times
    for max_points in (4, 2_000, 10**6):
        assert max(_window(timeline, max_points=max_points)) == 99.0
    bucket_s = spike_s // 30 * 30
    for start in (spike_s - 0.05, bucket_s, bucket_s + 0.05):
        assert max(_window(timeline, start, spike_s + 0.05, 4)) == 99.0
    assert max(_window(timeline, bucket_s + 61.0)) == 1.0


def test_a_window_starting_inside_a_coarse_bucket_includes_it():
    # 60 s at 10 Hz with a 3-bucket 1 s ring: everything older than ~4 s is in 10 s buckets only.
    levels = (Level(0.0, 20), Level(1.0, 3), Level(10.0, 100))
    timeline, _ = _feed(levels, 600, 0.1, {123: 99.0, 234: -5.0})  # at 12.3 s and 23.4 s
    assert max(_window(timeline, 12.31, 19.0)) == 99.0  # the [10 s, 20 s) bucket
    assert max(_window(timeline, 19.99, 20.5)) == 99.0
    assert min(_window(timeline, 29.9, 35.0)) == -5.0  # the [20 s, 30 s) bucket
    assert max(_window(timeline, 20.0, 35.0)) == 1.0
    times = timeline.window(15.0, 35.0).times
    assert times[0] == 15.0  # its points are drawn inside the window


def test_a_level_whose_whole_stretch_the_coarser_bucket_covers_is_skipped():
    # The 1 s ring holds 3 buckets, all inside the 10 s bucket that the 10 s level supplies whole.
    levels = (Level(0.0, 20), Level(1.0, 3), Level(10.0, 100))
    timeline, _ = _feed(levels, 1_053, 0.1, {1_029: 50.0})
    series = timeline.window()
    assert series.times == sorted(series.times)
    assert max(series.values["v"]) == 50.0


def test_memory_is_bounded_over_a_day_at_10_hz():
    channels = ["cuda:0/allocated", "cuda:0/reserved", "cuda:0/used", "host/rss"]
    rows = [dict.fromkeys(channels, float(i)) for i in range(1_000)]
    timeline = Timeline()
    hour = 3_600 * 10
    for i in range(hour):
        timeline.append(i * 0.1, rows[i % 1_000])
    held_after_an_hour = timeline.nbytes()
    for i in range(hour, 24 * hour):
        timeline.append(i * 0.1, rows[i % 1_000])
    per_row = {0: 1 + len(channels), 1: 1 + 2 * len(channels)}  # a key and one or two values per channel
    expected = sum(8 * level.capacity * per_row[min(index, 1)] for index, level in enumerate(DEFAULT_LEVELS))
    assert timeline.nbytes() == held_after_an_hour == expected == 3_366_720
    assert max(timeline.window(max_points=2_000).values["host/rss"]) == 999.0


def test_clear_forgets_every_level():
    timeline, _ = _feed((Level(0.0, 10), Level(1.0, 5), Level(5.0, 5)), 500, 0.1, {3: 99.0})
    timeline.clear()
    timeline.append(100.0, {"v": 2.0})
    assert timeline.window() == ([100.0], {"v": [2.0]})


# ---- reading only some channels, reading arrays, and what the numpy read must agree with ----


def _reference_decimation(times, values, max_points):
    """The rule, sample by sample: per bucket, the first lowest and the last highest value that are not NaN."""
    if len(times) <= max_points:
        return list(times), [list(row) for row in values]
    buckets = max_points // 2
    width = (times[-1] - times[0]) / buckets  # buckets are equal stretches of time; empty ones are dropped
    if width > 0:
        starts = sorted({bisect.bisect_left(times, times[0] + b * width) for b in range(buckets)})
    else:
        starts = [b * len(times) // buckets for b in range(buckets)]
    out_times, out_rows = [], [[] for _ in values]
    for lo, hi in zip(starts, [*starts[1:], len(times)], strict=True):
        out_times += [times[lo], times[lo + (hi - lo) // 2]]
        for row, out in zip(values, out_rows, strict=True):
            chunk = [(v, i) for i, v in enumerate(row[lo:hi]) if not math.isnan(v)]
            if not chunk:
                out.extend((math.nan, math.nan))
                continue
            low = min(v for v, _ in chunk)
            high = max(v for v, _ in chunk)
            low_at = min(i for v, i in chunk if v == low)
            high_at = max(i for v, i in chunk if v == high)
            out.extend((low, high) if low_at <= high_at else (high, low))
    return out_times, out_rows


def _same(a, b):
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("seed", range(6))
def test_decimation_matches_the_rule_with_ties_and_gaps(seed):
    rng = random.Random(seed)
    for _ in range(40):
        count = rng.randint(0, 700)
        times = [i * 0.1 for i in range(count)]
        gap = rng.choice([0.0, 0.3, 0.95])
        rows = [[math.nan if rng.random() < gap else float(rng.randint(0, 3)) for _ in times] for _ in range(3)]
        max_points = rng.choice([4, 5, 9, 64, 1_000])
        series = decimate_min_max(times, dict(zip("abc", rows, strict=True)), max_points)
        want_times, want_rows = _reference_decimation(times, rows, max_points)
        assert series.times == want_times
        for name, want in zip("abc", want_rows, strict=True):
            assert _same(series.values[name], want), (seed, count, max_points, name)


def _mixed_timeline():
    """Small rings with every hand-over in use, and a channel that appears after the first ones wrapped."""
    timeline = Timeline((Level(0.0, 20), Level(1.0, 8), Level(4.0, 50)))
    for i in range(600):
        values = {"a": float(i % 17), "b": float(-(i % 5))}
        if i >= 150:
            values["late"] = 99.0 if i == 160 else float(i % 3)
        timeline.append(i * 0.1, values)
    return timeline


def test_reading_some_channels_gives_the_same_lines():
    timeline = _mixed_timeline()
    for start, end, max_points in ((-INF, INF, 4), (-INF, INF, 10**6), (14.0, 17.0, 10), (50.0, INF, 7)):
        everything = timeline.window(start, end, max_points)
        some = timeline.window(start, end, max_points, channels=["late", "a", "missing", "late"])
        assert some.times == everything.times
        assert list(some.values) == ["late", "a"]  # in the order asked, once each; unknown names left out
        for name in some.values:
            assert _same(some.values[name], everything.values[name])
    assert max(timeline.window(max_points=4, channels=["late"]).values["late"]) == 99.0
    assert timeline.window(channels=[]).values == {}
    with pytest.raises(TypeError, match="sequence of channel names"):
        timeline.window(channels="late")


def test_a_channel_that_appears_late_keeps_its_peak_in_coarse_buckets():
    timeline = _mixed_timeline()
    series = timeline.window(max_points=10**6, channels=["late"])
    late = series.values["late"]
    assert math.isnan(late[0])  # before it appeared
    assert max(v for v in late if not math.isnan(v)) == 99.0  # sampled at 16.0 s, only in a 4 s bucket now
    assert timeline.window(16.5, 17.0, 4, ["late"]).values["late"].count(99.0) == 1


def test_window_arrays_agrees_with_window_and_shares_nothing_with_the_store():
    timeline = _mixed_timeline()
    arrays = timeline.window_arrays(10.0, INF, 50, ["b", "a"])
    series = timeline.window(10.0, INF, 50, ["b", "a"])
    assert arrays.channels == ("b", "a")
    assert arrays.values.shape == (2, len(series.times))
    assert arrays.times.tolist() == series.times
    assert arrays.values.tolist() == [series.values["b"], series.values["a"]]
    raw = timeline.window_arrays(58.0, INF, 10**6, ["a"])
    kept = raw.values.copy()
    for i in range(600, 700):
        timeline.append(i * 0.1, {"a": -1.0, "b": 0.0, "late": 0.0})  # overwrites the raw ring's slots
    assert raw.values.tolist() == kept.tolist()


def test_the_store_imports_numpy_only_when_read():
    code = (
        "import sys\n"
        "from gpumem.core.sampling.timeline import Timeline\n"
        "timeline = Timeline()\n"
        "for i in range(100):\n"
        "    timeline.append(i * 0.1, {'a': float(i)})\n"
        "timeline.latest(), timeline.nbytes()\n"
        "print('numpy' in sys.modules)\n"
        "timeline.window()\n"
        "print('numpy' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC_DIR), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-c", code]
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_reading_folds_open_buckets_in_without_changing_them():
    """A read takes each level's open bucket (and the finer open ones folded into it) as it is: the
    store, open buckets included, is the same after any number of reads, and so is what they give."""
    timeline = Timeline([Level(0.0, 8), Level(1.0, 4), Level(5.0, 100)])
    spikes = {13: 9.0, 27: -4.0, 41: 7.5}
    for i in range(43):  # the raw and 1 s levels have wrapped; the 5 s level has an open bucket
        timeline.append(i * 0.5, {"a": spikes.get(i, float(i % 3)), "b": float(-i)})
    before = timeline.store_state()
    assert before["levels"][1]["open"] is not None
    assert before["levels"][2]["open"] is not None
    first = timeline.window(0.0, 21.0, max_points=500, resolution_s=5.0)
    second = timeline.window(0.0, 21.0, max_points=500, resolution_s=5.0)
    assert repr(timeline.store_state()) == repr(before)
    assert first == second
    assert max(first.values["a"]) == 9.0
    assert min(first.values["a"]) == -4.0
    assert 7.5 in first.values["a"]  # only in the open buckets, not in any ring yet
    assert min(first.values["b"]) == -42.0
