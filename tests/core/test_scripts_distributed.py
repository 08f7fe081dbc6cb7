"""monitor.gather() in a real two-process torch.distributed job (gloo, on the CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpumem.core.monitoring.spans import DeviceChange
from gpumem.core.scripts.ranks import RankFigures, RankReport
from gpumem.testing import GIB

SRC = str(Path(__file__).resolve().parents[2] / "src")

JOB = """
    import json, os, sys
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from gpumem.core.monitoring.monitor import Monitor
    from gpumem.testing import GIB, FakeSource

    def worker(rank, world, out):
        dist.init_process_group("gloo", rank=rank, world_size=world)
        source = FakeSource()  # deterministic per-rank figures: rank r peaks at (r + 1) GiB
        mon = Monitor(source)
        mon.snapshot("start")
        source.transient((rank + 1) * GIB)
        mon.snapshot("end")
        report = mon.gather()
        everyone = mon.gather(all_ranks=True)
        if rank == 0:
            text = str(mon.recorder.report())
            with open(out, "w") as file:
                json.dump({"text": text, "peaks": report.peaks(), "all": everyone.peaks()}, file)
        else:
            assert report is None and everyone is not None
        mon.stop()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, sys.argv[1]), nprocs=2)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_gather_shows_every_rank_and_the_imbalance_on_rank_0(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    out = tmp_path / "rank0.json"
    env = {
        **os.environ,
        "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    done = subprocess.run(
        [sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=90, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["peaks"] == {"0": GIB, "1": 2 * GIB} == result["all"]
    text = result["text"]
    assert "memory per rank (2 ranks)" in text
    assert "imbalance: rank 1 peaks at 2.0 GiB, rank 0 at 1.0 GiB (1.0 GiB apart, 2.00x)" in text


def test_gather_without_a_process_group_says_what_to_do() -> None:
    pytest.importorskip("torch.distributed")
    from gpumem.core.monitoring.monitor import Monitor

    with pytest.raises(RuntimeError, match="init_process_group"):
        Monitor().gather()


def test_imbalance_needs_two_ranks_with_cuda_peaks() -> None:
    figures = DeviceChange(0, 0, 0, 0, 0, GIB, True, "", GIB, None, None, None, False)
    one = RankFigures(0, 1, "h", 1, (figures,), None, None)
    assert RankReport((one,)).imbalance_text() == ""
    empty = RankFigures(1, 2, "h", 2, (), None, None)
    assert RankReport((one._replace(devices=()), empty)).imbalance_text() == "imbalance: no CUDA peaks to compare"
