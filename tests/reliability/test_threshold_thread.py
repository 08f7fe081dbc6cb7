"""Stopping the sampler ends the threshold-callback thread too: after a warning fired, nothing of
gpumem keeps running once the last user releases the monitor (or a script stops it).

Regression: the thread that runs threshold callbacks waited for work forever, so a panel closed
(or an extension unloaded) after a "device is 90% full" warning left a ``gpumem-thresholds`` thread.
"""

from __future__ import annotations

import threading
import warnings

import pytest

from gpumem.core.monitoring.monitor import Monitor
from gpumem.testing import GIB, FakeSource


def _threshold_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "gpumem-thresholds" and t.is_alive()]


@pytest.mark.parametrize("how", ["release", "stop"])
def test_no_threshold_thread_outlives_the_sampler(how: str) -> None:
    source = FakeSource(devices=1, total_bytes=10 * GIB, context_bytes=0)
    held = source.allocate(19 * GIB // 2)  # 95 %: above the default 90 % warning
    monitor = Monitor(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the default warning at 90 %: what fires is not the point here
        monitor.acquire("test")
        monitor.sampler.sample_once()
        monitor.thresholds.drain()
        assert _threshold_threads() == ["gpumem-thresholds"]
        if how == "release":
            monitor.release("test")
        else:
            monitor.stop()
    assert _threshold_threads() == []
    source.free(held)
