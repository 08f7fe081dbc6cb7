import itertools
import os
import threading
import time

import pytest

from gpumem.core.monitoring.monitor import Monitor, default_monitor, set_default_monitor
from gpumem.core.readers.sources import SystemSource
from gpumem.core.sampling.sampler import Sampler, channel_device, channels_of
from gpumem.core.sampling.timeline import Timeline
from gpumem.testing import GIB, FakeSource


def _sampler_threads():
    return [t for t in threading.enumerate() if t.name == "gpumem-sampler"]


def test_start_and_stop_are_idempotent_and_leave_no_thread():
    sampler = Sampler(FakeSource(), Timeline(), rate_hz=50)
    sampler.start()
    sampler.start()
    assert len(_sampler_threads()) == 1
    time.sleep(0.2)
    sampler.stop()
    sampler.stop()
    assert _sampler_threads() == []
    assert not sampler.running
    assert sampler.cost().samples >= 3


def test_sampler_follows_the_source_into_the_timeline():
    source = FakeSource()
    monitor = Monitor(source, rate_hz=100)
    with monitor:
        handle = source.allocate(3 * GIB)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            latest = monitor.timeline.latest()
            if latest and latest[1].get("cuda:0/allocated") == 3 * GIB:
                break
            time.sleep(0.01)
        source.free(handle)
    series = monitor.timeline.window()
    assert max(series.values["cuda:0/allocated"]) == 3 * GIB
    assert max(series.values["cuda:0/reserved"]) >= 3 * GIB
    assert _sampler_threads() == []


def test_schedule_is_fixed_not_drifting():
    sampler = Sampler(FakeSource(), Timeline(), rate_hz=20)
    sampler.start()
    time.sleep(1.0)
    sampler.stop()
    samples = sampler.cost().samples
    times = sampler.timeline.window().times
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert 10 <= samples <= 25
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(0.05, rel=0.3)


def test_slow_reads_skip_ticks_instead_of_bunching():
    class SlowSource(FakeSource):
        def snapshot(self, *, process_memory=False):
            time.sleep(0.03)
            return super().snapshot(process_memory=process_memory)

    sampler = Sampler(SlowSource(), Timeline(), rate_hz=100)
    sampler.start()
    time.sleep(0.5)
    sampler.stop()
    cost = sampler.cost()
    assert cost.skipped_ticks > 0
    times = sampler.timeline.window().times
    assert min(b - a for a, b in itertools.pairwise(times)) >= 0.025


def test_a_failing_source_does_not_kill_the_thread():
    class Flaky(FakeSource):
        calls = 0

        def snapshot(self, *, process_memory=False):
            Flaky.calls += 1
            if Flaky.calls % 2:
                raise RuntimeError("driver hiccup")
            return super().snapshot(process_memory=process_memory)

    sampler = Sampler(Flaky(), Timeline(), rate_hz=100)
    sampler.start()
    time.sleep(0.2)
    assert sampler.running
    sampler.stop()
    assert sampler.cost().samples >= 3


def test_listeners_are_called_and_their_errors_contained():
    seen = []

    def bad(snapshot):
        raise ValueError("boom")

    sampler = Sampler(FakeSource(), Timeline(), rate_hz=50)
    sampler.add_listener(seen.append)
    sampler.add_listener(bad)
    sampler.sample_once()
    assert len(seen) == 1
    assert "boom" in (sampler.last_error or "")
    sampler.remove_listener(bad)
    sampler.remove_listener(seen.append)
    sampler.sample_once()
    assert len(seen) == 1


@pytest.mark.parametrize("rate", [0, -1, float("nan"), float("inf")])
def test_bad_rates_are_refused(rate):
    with pytest.raises(ValueError, match="rate_hz"):
        Sampler(FakeSource(), Timeline(), rate_hz=rate)


def test_channels_of_a_snapshot():
    source = FakeSource(devices=2)
    source.allocate(GIB, device=1)
    channels = channels_of(source.snapshot())
    assert channels["cuda:1/allocated"] == GIB
    assert channels["cuda:0/allocated"] == 0
    assert "cuda:0/used" in channels and "host/rss" in channels


def test_real_host_sampling_without_gpu():
    monitor = Monitor(SystemSource(), rate_hz=50)
    with monitor:
        time.sleep(0.3)
    series = monitor.timeline.window()
    assert len(series.values["host/rss"]) >= 3
    assert all(v > 0 for v in series.values["host/rss"])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_while_sampling_gives_a_usable_child_and_no_hang():
    monitor = Monitor(SystemSource(), rate_hz=200)
    monitor.start()
    try:
        time.sleep(0.05)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                inherited = monitor.running
                monitor.start()
                time.sleep(0.05)
                sampled = monitor.sampler.cost().samples
                monitor.stop()
                code = 0 if (not inherited and sampled > 0) else 2
            finally:
                os.write(write, bytes([code]))
                os._exit(code)
        os.close(write)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.02)
        else:
            os.kill(pid, 9)
            pytest.fail("forked child hung")
        assert os.read(read, 1) == b"\x00"
        os.close(read)
        assert os.waitstatus_to_exitcode(status) == 0
        assert monitor.running
    finally:
        monitor.stop()


def test_default_monitor_is_shared_and_replaceable():
    original = default_monitor()
    assert default_monitor() is original
    fake = Monitor(FakeSource())
    previous = set_default_monitor(fake)
    try:
        assert previous is original
        assert default_monitor() is fake
    finally:
        set_default_monitor(original)
    assert default_monitor() is original


def test_shared_users_keep_the_sampler_until_the_last_one_releases():
    monitor = Monitor(FakeSource(), rate_hz=50)
    monitor.acquire("panel-1")
    monitor.acquire("auto")
    monitor.acquire("auto")
    assert monitor.running and monitor.users == {"panel-1", "auto"}
    monitor.release("panel-1")
    assert monitor.running
    monitor.release("never-acquired")
    assert monitor.running
    monitor.release("auto")
    assert not monitor.running
    assert _sampler_threads() == []
    monitor.acquire("x")
    monitor.stop()
    assert not monitor.running and monitor.users == frozenset()


def test_an_explicit_start_outlives_shared_users():
    monitor = Monitor(FakeSource(), rate_hz=50)
    monitor.start()
    monitor.acquire("panel")
    monitor.release("panel")
    assert monitor.running
    monitor.stop()
    assert not monitor.running


def test_the_sampler_runs_as_fast_as_its_fastest_user_asks_and_no_slower_than_its_own_rate():
    monitor = Monitor(FakeSource(), rate_hz=2)
    monitor.acquire("automatic mode")
    assert monitor.sampler.rate_hz == 2
    monitor.acquire("panel, 1 minute", rate_hz=10)
    monitor.acquire("slow view", rate_hz=0.5)
    assert monitor.sampler.rate_hz == 10
    monitor.acquire("panel, 1 minute", rate_hz=4)  # the same user asks again: its rate changes
    assert monitor.sampler.rate_hz == 4
    monitor.release("panel, 1 minute")
    assert monitor.sampler.rate_hz == 2
    monitor.rate_hz = 5
    assert monitor.sampler.rate_hz == 5 and monitor.rate_hz == 5
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="rate_hz"):
            monitor.acquire("bad", rate_hz=bad)
    assert "bad" not in monitor.users
    monitor.stop()
    assert _sampler_threads() == []


def test_a_faster_rate_takes_effect_at_once():
    sampler = Sampler(FakeSource(), Timeline(), rate_hz=0.2)
    sampler.start()
    try:
        deadline = time.monotonic() + 2
        while sampler.cost().samples < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        asked = time.monotonic()
        sampler.rate_hz = 50  # the thread is in a 5 s wait
        while sampler.cost().samples < 6 and time.monotonic() < asked + 2:
            time.sleep(0.005)
        assert sampler.cost().samples >= 6
        assert time.monotonic() - asked < 1.0
    finally:
        sampler.stop()
    assert _sampler_threads() == []


def test_channel_device_reads_back_the_names_channels_of_writes() -> None:
    assert [channel_device(name) for name in ("cuda:0/allocated", "cuda:12/reserved", "cuda:3/used")] == [0, 12, 3]
    assert channel_device("host/rss") is None
