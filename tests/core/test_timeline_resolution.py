"""Reading a window at a coarser resolution: straight from a level's buckets, checked against the raw samples."""

import math
import random

import pytest

from gpumem.core.sampling.timeline import DEFAULT_LEVELS, Level, Series, Timeline

INF = math.inf


def _envelope(samples, name):
    """A bucket's two extremes in the order they first occurred, NaN (nothing measured) skipped."""
    values = [values[name] for _, values in samples if not math.isnan(values.get(name, math.nan))]
    if not values:
        return math.nan, math.nan
    low, high = min(values), max(values)
    return (low, high) if values.index(low) <= values.index(high) else (high, low)


def _closed_and_lost(keys, capacity):
    """Of a level's bucket keys (oldest first, the newest still open): the newest one its ring dropped."""
    closed = keys[:-1]
    return closed[-capacity - 1] if len(closed) > capacity else None


def _model(samples, levels, level, start_s=-INF, end_s=INF):
    """What a read from ``level`` (1 or 2) of three levels should give: (bucket span, key) pairs in order.

    Level 1 supplies its buckets from the level-2 bucket after the one holding its newest dropped
    bucket; level 2 supplies the rest, whole. The level-2 ring is made large enough never to drop any.
    """
    fine_s, coarse_s = levels[1].span_s, levels[2].span_s
    ratio = round(coarse_s / fine_s)
    fine_keys = sorted({math.floor(t / fine_s) for t, _ in samples})
    coarse_keys = sorted({math.floor(t / coarse_s) for t, _ in samples})
    lost = _closed_and_lost(fine_keys, levels[1].capacity) if level == 1 else max(coarse_keys, default=None)
    handover = None if lost is None else lost // ratio if level == 1 else lost
    picked = [(coarse_s, key) for key in coarse_keys if handover is not None and key <= handover]
    if level == 1:
        picked += [(fine_s, key) for key in fine_keys if handover is None or key // ratio > handover]
    return [(span, key) for span, key in picked if key * span + span > start_s and key * span <= end_s]


def _expected(samples, buckets, names, start_s=-INF, end_s=INF):
    newest = samples[-1][0] if samples else -INF
    until = max(start_s, min(end_s, newest))
    times, rows = [], {name: [] for name in names}
    grouped, spans = {}, {span for span, _ in buckets}
    for sample in samples:
        for span in spans:
            grouped.setdefault((span, math.floor(sample[0] / span)), []).append(sample)
    for span, key in buckets:
        times += [min(max(key * span, start_s), until), min(max(key * span + span / 2, start_s), until)]
        inside = grouped[span, key]
        for name in names:
            rows[name].extend(_envelope(inside, name))
    return times, rows


def _same(a, b):
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


def _random_samples(rng, count):
    """Uneven steps with pauses, small whole values (ties), gaps (NaN) and a channel that starts late."""
    samples, time_s = [], rng.uniform(0.0, 3.0)
    for i in range(count):
        time_s += rng.choice([0.0, 0.05, 0.1, 0.1, 0.5, 0.7, 2.3]) if i else 0.0
        values = {"a": math.nan if rng.random() < 0.1 else float(rng.randint(0, 4))}
        if i > count // 3:
            values["b"] = math.nan if rng.random() < 0.5 else float(-rng.randint(0, 2))
        samples.append((time_s, values))
    return samples


def _timeline(samples, levels=DEFAULT_LEVELS):
    timeline = Timeline(levels)
    for time_s, values in samples:
        timeline.append(time_s, values)
    return timeline


# the 1 s / 5 s shape with small rings: raw and 1 s buckets both wrap, 5 s buckets take over for old times
_LEVELS = (Level(0.0, 25), Level(1.0, 12), Level(5.0, 10_000))


def _same_series(a, b):
    same_lines = a.values.keys() == b.values.keys() and all(_same(a.values[n], b.values[n]) for n in a.values)
    return a.times == b.times and same_lines


@pytest.mark.parametrize("seed", range(8))
def test_a_resolution_read_is_each_buckets_envelope_of_the_raw_samples(seed):
    rng = random.Random(seed)
    read_from = {"buckets": 0, "finest": 0}
    for _ in range(12):
        samples = _random_samples(rng, rng.randint(1, 300))
        timeline = _timeline(samples, _LEVELS)
        first, last = samples[0][0], samples[-1][0]
        windows = [(-INF, INF), (rng.uniform(first, last), INF), (rng.uniform(first, last), last - 0.01)]
        for level, resolution_s in ((1, 1.0), (1, 4.99), (2, 5.0), (2, 1e9), (2, INF)):
            for start_s, end_s in windows:
                times, rows = _expected(samples, _model(samples, _LEVELS, level, start_s, end_s), "ab", start_s, end_s)
                max_points = max(4, len(times))  # room for every bucket's two points
                series = timeline.window(start_s, end_s, max_points, resolution_s=resolution_s)
                finest = timeline.window(start_s, end_s, 10**6)
                if len(finest.times) <= max_points:  # fits as it is: every sample at its own time
                    read_from["finest"] += 1
                    assert _same_series(series, finest), (seed, level, start_s, end_s)
                    continue
                read_from["buckets"] += 1
                assert series.times == times, (seed, level, start_s, end_s)
                for name in ("a", "b"):
                    assert _same(series.values[name], rows[name]), (seed, level, name, start_s, end_s)
    assert read_from["buckets"] >= 50 and read_from["finest"] >= 1, read_from


@pytest.mark.parametrize("seed", range(4))
def test_a_resolution_finer_than_the_first_buckets_reads_raw_samples(seed):
    samples = _random_samples(random.Random(seed), 200)
    timeline = _timeline(samples, _LEVELS)
    for start_s in (-INF, samples[150][0]):
        raw = timeline.window(start_s, max_points=10)
        for resolution_s in (0.0, 0.5, 0.999, 1.0):
            series = timeline.window(start_s, max_points=10, resolution_s=resolution_s)
            assert _same_series(series, raw) == (resolution_s < 1.0), resolution_s


def test_ten_minutes_at_10_hz_read_from_1s_buckets_need_no_decimation():
    samples = [(1_000.0 + i * 0.1, {"v": float(i % 5), "w": float(i // 3)}) for i in range(36_000)]
    samples[35_000] = (samples[35_000][0], {"v": 99.0, "w": -1.0})
    samples[-1] = (samples[-1][0], {"v": 50.0, "w": 0.0})
    timeline = _timeline(samples)
    end_s = samples[-1][0]
    start_s = end_s - 600.0
    series = timeline.window(start_s, end_s, 1_250, resolution_s=1.2)
    assert len(series.times) == 1_202  # 601 buckets (the first straddles the start), two points each
    buckets = [(1.0, key) for key in range(math.floor(start_s), math.floor(end_s) + 1)]
    assert _same_series(series, Series(*_expected(samples, buckets, "vw", start_s, end_s)))
    assert series.times[-2:] == [math.floor(end_s), math.floor(end_s) + 0.5]  # the newest second, still open
    assert series.values["v"][-2:] == [0.0, 50.0]  # its extremes in order: the newest sample is drawn
    assert max(series.values["v"]) == 99.0
    assert min(series.values["w"]) == -1.0


def test_ten_minutes_at_2_hz_fit_as_they_are():
    samples = [(1_000.0 + i * 0.5, {"v": float(i % 5)}) for i in range(7_200)]
    timeline = _timeline(samples)
    end_s = samples[-1][0]
    series = timeline.window(end_s - 600.0, end_s, 1_250, resolution_s=1.2)
    assert series == timeline.window(end_s - 600.0, end_s, 10**6)
    assert series.times == [t for t, _ in samples[-1_201:]]


def test_the_hand_over_to_30s_buckets_for_old_times():
    """6 h 20 min at 4 Hz: the 1 s level has dropped its first ~20 min, which only 30 s buckets hold."""
    seconds = 21_600 + 1_200
    samples = [(i / 4, {"v": 99.0 if i == 1_201 else -7.0 if i == 6_003 else float(i % 3)}) for i in range(4 * seconds)]
    timeline = _timeline(samples)
    lost = seconds - 2 - 21_600  # the newest 1 s bucket its ring dropped (the newest bucket is still open)
    handover = lost // 30
    buckets = [(30.0, key) for key in range(handover + 1)]
    buckets += [(1.0, key) for key in range((handover + 1) * 30, seconds)]
    expected = Series(*_expected(samples, buckets, "v"))
    series = timeline.window(max_points=len(expected.times), resolution_s=1.0)
    assert len(timeline.window(max_points=10**6).times) > len(expected.times)  # so the buckets are read
    assert series == expected
    assert max(series.values["v"]) == 99.0
    assert min(series.values["v"]) == -7.0
    assert timeline.window(300.0, 300.0, 4, resolution_s=1.0).values["v"] == [0.0, 99.0]  # its 30 s bucket, whole
    old = timeline.window(0.0, 3_000.0, 4, resolution_s=1.0)
    assert max(old.values["v"]) == 99.0
    assert min(old.values["v"]) == -7.0


def test_an_empty_timeline_and_a_single_sample():
    timeline = Timeline()
    assert timeline.window(resolution_s=1.0) == ([], {})
    assert timeline.window_arrays(resolution_s=30.0).times.size == 0
    timeline.append(3.2, {"v": 5.0})
    for resolution_s in (0.5, 1.0, 30.0):
        assert timeline.window(resolution_s=resolution_s) == ([3.2], {"v": [5.0]})
        assert timeline.window(3.3, resolution_s=resolution_s) == ([], {"v": []})


@pytest.mark.parametrize("resolution_s", [-1.0, math.nan, -INF])
def test_a_resolution_that_is_no_duration_is_refused(resolution_s):
    with pytest.raises(ValueError, match="resolution_s must be"):
        Timeline().window(resolution_s=resolution_s)


def test_the_open_buckets_middle_point_is_not_drawn_after_the_newest_sample():
    timeline = _timeline([(i / 10, {"v": float(i)}) for i in range(103)], _LEVELS)  # 0 s to 10.2 s
    series = timeline.window(max_points=30, resolution_s=1.0)
    assert len(series.times) == 22  # 11 buckets rather than 103 samples
    assert series.times[-2:] == [10.0, 10.2]
    assert series.values["v"][-2:] == [100.0, 102.0]
    assert timeline.window(0.0, 10.1, 30, resolution_s=1.0).times[-2:] == [10.0, 10.1]  # the window's end
