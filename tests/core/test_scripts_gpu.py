"""Tags, scopes, thresholds and ``python -m gpumem run`` on a real CUDA GPU, to the byte.

Every allocation is a multiple of 2 MiB (large-pool blocks, no rounding beyond 512 B), made after the
cache is emptied, so the allocator's counters move by exactly the requested sizes.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumem.core.monitoring.monitor import Monitor
from gpumem.core.monitoring.peaks import PEAK_RESET_NOTE
from gpumem.core.monitoring.spans import SpanRecord
from gpumem.core.sampling.thresholds import ThresholdEvent
from gpumem.core.sessions.loaded_session import LoadedSession
from gpumem.core.sessions.session_file import read_session

pytestmark = pytest.mark.gpu

GIB = 1 << 30
MIB = 1 << 20
SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture
def torch() -> Iterator[Any]:
    torch = pytest.importorskip("torch")
    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize(0)
    gc.collect()
    torch.cuda.empty_cache()
    yield torch
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture
def mon(torch: Any) -> Iterator[Monitor]:
    monitor = Monitor(warn_at=None)
    yield monitor
    monitor.stop()


def cuda0(record: SpanRecord | None) -> Any:
    assert record is not None
    figures = record.device(0)
    assert figures is not None
    return figures


def buffer(torch: Any, nbytes: int) -> Any:
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")


def test_nested_scopes_have_exact_peaks_on_a_real_gpu(torch: Any, mon: Monitor) -> None:
    kept = buffer(torch, 256 * MIB)
    base = torch.cuda.memory_allocated(0)
    for _ in range(2):  # the second forward peaks below the first backward: still exact
        with mon.track("step") as step:
            with mon.track("forward") as forward:
                activations = buffer(torch, GIB)
                del activations
            with mon.track("backward") as backward:
                grads = buffer(torch, 512 * MIB)
                del grads
        assert cuda0(forward.record).peak_allocated_bytes == base + GIB
        assert cuda0(backward.record).peak_allocated_bytes == base + 512 * MIB
        assert cuda0(step.record).peak_allocated_bytes == base + GIB
        for scope in (step, forward, backward):
            figures = cuda0(scope.record)
            assert figures.peak_exact, figures.peak_note
            assert figures.allocated_bytes == figures.allocated_before_bytes == base
    del kept


def test_tags_on_a_real_gpu_read_the_allocator_and_nvml(torch: Any, mon: Monitor) -> None:
    base = torch.cuda.memory_allocated(0)
    mon.snapshot("before_model")
    model = buffer(torch, GIB)
    transient = buffer(torch, 2 * GIB)
    del transient
    after = cuda0(mon.snapshot("after_model"))
    assert after.allocated_bytes - after.allocated_before_bytes == GIB
    assert after.peak_allocated_bytes == base + 3 * GIB and after.peak_exact
    assert after.reserved_bytes >= base + 3 * GIB  # the freed 2 GiB stays cached
    assert after.used_bytes is not None and after.total_bytes is not None  # NVML
    optimizer_state = buffer(torch, 512 * MIB)
    step = cuda0(mon.snapshot("after_optimizer"))
    assert step.peak_allocated_bytes == base + GIB + 512 * MIB and step.peak_exact  # since after_model only
    del model, optimizer_state


def test_the_users_own_reset_between_tags_is_caught(torch: Any, mon: Monitor) -> None:
    mon.snapshot("start")
    held = buffer(torch, GIB)
    del held
    torch.cuda.reset_peak_memory_stats(0)  # the guides' per-epoch reset/max pair
    figures = cuda0(mon.snapshot("end"))
    assert not figures.peak_exact and figures.peak_note == PEAK_RESET_NOTE
    assert "≥" in str(mon.recorder.report())


def test_threshold_callback_fires_once_per_crossing_on_a_real_gpu(torch: Any, mon: Monitor) -> None:
    snapshot = mon.snapshot()
    device = snapshot.device_for(0)
    if device is not None:
        used, total = device.used_bytes, device.total_bytes
    else:  # no NVML: the watch reads reserved against the device's capacity
        reading = snapshot.allocator_for(0)
        capacity = mon.source.device_info(0)
        assert reading is not None and capacity is not None
        used, total = reading.reserved_bytes, capacity.total_bytes
    events: list[ThresholdEvent] = []
    # Fire at 1 GiB above today's use, re-arm once back within 512 MiB of it: at most 2 GiB is allocated.
    mon.on_threshold((used + GIB) / total, events.append, rearm=(used + 512 * MIB) / total)
    for _ in range(2):
        block = buffer(torch, 2 * GIB)
        torch.cuda.synchronize(0)
        mon.sampler.sample_once()
        mon.sampler.sample_once()  # still above: no second event for the same crossing
        del block
        torch.cuda.empty_cache()
        mon.sampler.sample_once()  # back below the re-arm mark
    mon.thresholds.drain()
    assert len(events) == 2, events
    assert all(event.device == 0 and event.fraction >= event.threshold for event in events)
    assert events[0].allocated_bytes is not None and events[0].allocated_bytes >= 2 * GIB


def test_gpumem_run_reports_the_exact_peak_of_a_cuda_script_and_saves_a_session_load_shows(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
            del x
            y = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0")
            print("done")
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    save = tmp_path / "run.json"
    done = subprocess.run(
        [sys.executable, "-m", "gpumem", "run", "--save", str(save), str(script)],
        capture_output=True, text=True, timeout=180, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "done\n"
    assert "cuda:0: peak allocated 1.0 GiB" in done.stderr  # exact: no "≥"
    assert "at exit 256.0 MiB allocated" in done.stderr
    session = read_session(save)  # the one session format, as %gpumem load reads it
    assert session.run is not None
    (device,) = [row for row in session.run["figures"] if row["device"] == 0]
    assert device["peak_allocated_bytes"] == GIB and device["peak_exact"]
    assert "cuda:0/allocated" in session.timeline.values
    assert "cuda:0: peak allocated 1.0 GiB" in repr(LoadedSession(session, str(save)))


NCCL_JOB = """
    import json, os, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from gpumem.core.monitoring.monitor import Monitor

    def worker(rank, world, out):
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world)
        mon = Monitor(warn_at=None)
        mon.snapshot("start")
        block = torch.empty((rank + 1) << 30, dtype=torch.uint8, device=f"cuda:{rank}")
        del block
        mon.snapshot("end")
        report = mon.gather()
        if rank == 0:
            peaks = {str(r.rank): [d.peak_allocated_bytes for d in r.devices if d.device == r.rank]
                     for r in report.ranks}
            with open(out, "w") as file:
                json.dump({"peaks": peaks, "text": str(mon.recorder.report())}, file)
        mon.stop()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, sys.argv[1]), nprocs=2)
"""


def test_gather_over_nccl_on_two_gpus(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:  # NCCL needs a GPU per rank
        pytest.skip("needs two CUDA devices (NCCL cannot put two ranks on one GPU)")
    import json
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(NCCL_JOB))
    out = tmp_path / "rank0.json"
    env = {**os.environ, "PYTHONPATH": SRC, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    done = subprocess.run(
        [sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=240, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    peak0, peak1 = result["peaks"]["0"][0], result["peaks"]["1"][0]
    assert peak1 - peak0 == GIB  # each rank's own exact peak, gathered over NCCL
    assert "memory per rank (2 ranks)" in result["text"] and "imbalance: rank 1" in result["text"]
