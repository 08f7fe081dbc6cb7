"""Cells that allocate and drop memory while four threads call ``gpumem.free(deep=True)`` in a loop:
no exception in any thread, no deadlock (every wait is bounded), and every record's figures agree.

The in-process IPython shell in automatic mode. Two sources: the real one (CPU tensors of the CPU
build of torch; host figures) and the fake allocator with one CUDA device (device figures too).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from typing_extensions import Self

from _harness import run_cell_capture
from gpumem.core.cells.history import history_rows
from gpumem.core.monitoring.monitor import Monitor, set_default_monitor
from gpumem.ipython import extension
from gpumem.testing import MIB, FakeSource

torch = pytest.importorskip("torch")

FREE_THREADS = 4
JOIN_TIMEOUT_S = 30.0


class Freers:
    """``FREE_THREADS`` threads calling ``gpumem.free(deep=True)`` until stopped; what they raised is kept."""

    def __init__(self) -> None:
        import gpumem

        self._free = gpumem.free
        self.stop = threading.Event()
        self.calls = [0] * FREE_THREADS
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._loop, args=(i,), name=f"freer-{i}") for i in range(FREE_THREADS)]

    def _loop(self, index: int) -> None:
        while not self.stop.is_set():
            try:
                result = self._free(deep=True)
                assert result.deep and result.elapsed_s >= 0
                for device in result.devices:
                    assert (
                        device.allocated_reclaimed_bytes == device.allocated_before_bytes - device.allocated_after_bytes
                    )
            except BaseException as error:
                self.errors.append(error)
                return
            self.calls[index] += 1

    def __enter__(self) -> Self:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(JOIN_TIMEOUT_S)
        stuck = [thread.name for thread in self.threads if thread.is_alive()]
        assert not stuck, f"freeing threads still running after {JOIN_TIMEOUT_S} s: {stuck}"


def _cell(i: int, fake: FakeSource | None) -> str:
    """A cell that allocates, drops or replaces memory; every few cells one leaves its value in Out."""
    size = (1 + i % 7) * MIB
    slot = f"t{i % 5}"
    if i % 3 == 2:
        return f"{slot} = None"
    if i % 11 == 0:
        return f"torch.ones({size // 4})" if fake is None else f"src.allocate({size})"
    if fake is None:
        return f"{slot} = torch.ones({size // 4})\nscratch = torch.zeros({size // 8}); del scratch"
    return f"{slot} = Handle(src, {size})\nsrc.transient({2 * size})"


class Handle:
    """A fake CUDA allocation freed when the last reference goes, like a tensor."""

    def __init__(self, source: FakeSource, nbytes: int) -> None:
        self.source, self.handle = source, source.allocate(nbytes)

    def __del__(self) -> None:
        self.source.free(self.handle)


@pytest.fixture(params=["system", "fake-cuda"])
def source(request: pytest.FixtureRequest) -> Iterator[FakeSource | None]:
    fake = FakeSource(devices=1) if request.param == "fake-cuda" else None
    set_default_monitor(Monitor(fake) if fake is not None else None)
    try:
        yield fake
    finally:
        set_default_monitor(None)


def _check_record(row: dict[str, Any], devices: int) -> None:
    assert row["status"] == "ok", row
    before, after = row["host_rss_before_bytes"], row["host_rss_after_bytes"]
    assert before is not None and after is not None, row
    assert after == before + row["host_rss_delta_bytes"], row
    assert row["host_peak_rss_bytes"] >= max(before, after), row
    for d in range(devices):
        a0, a1 = row[f"cuda{d}_allocated_before_bytes"], row[f"cuda{d}_allocated_after_bytes"]
        r0, r1 = row[f"cuda{d}_reserved_before_bytes"], row[f"cuda{d}_reserved_after_bytes"]
        assert a1 == a0 + row[f"cuda{d}_allocated_delta_bytes"], row
        assert r1 == r0 + row[f"cuda{d}_reserved_delta_bytes"], row
        peak = row[f"cuda{d}_peak_allocated_bytes"]
        assert peak >= max(a0, a1), row
        assert peak == a0 + row[f"cuda{d}_peak_above_start_bytes"], row
        assert 0 <= a0 <= r0 and 0 <= a1 <= r1, row


def run_cells_while_freeing(ip: Any, fake: FakeSource | None, cells: int) -> dict[str, float]:
    ip.user_ns.update(torch=torch, src=fake, Handle=Handle)
    assert ip.run_cell("%load_ext gpumem\n%gpumem auto on").success
    started = time.monotonic()
    with Freers() as freers:
        for i in range(cells):
            result, cap = run_cell_capture(ip, _cell(i, fake))
            assert result.success, (i, result.error_in_exec, cap.stderr)
            assert "Traceback" not in cap.stderr + cap.stdout, cap.stderr
    elapsed = time.monotonic() - started
    assert not freers.errors, freers.errors[:3]
    assert min(freers.calls) > 0, freers.calls  # every thread really ran
    state = extension.get_state()
    assert state is not None
    records = list(state.tracker.history)
    assert [r.serial for r in records] == list(range(1, cells + 1))  # every cell, none twice
    devices = 1 if fake is not None else 0
    for row in history_rows(records):
        _check_record(row, devices)
    ip.run_cell("%unload_ext gpumem")
    return {"cells": cells, "seconds": elapsed, "free_calls": sum(freers.calls)}


@pytest.mark.timeout(300)
def test_forty_cells_while_four_threads_free(ip: Any, source: FakeSource | None) -> None:
    figures = run_cells_while_freeing(ip, source, 40)
    print(figures)


@pytest.mark.soak
@pytest.mark.timeout(1200)
def test_a_thousand_cells_while_four_threads_free(ip: Any, source: FakeSource | None) -> None:
    figures = run_cells_while_freeing(ip, source, 1000)
    print(figures)
