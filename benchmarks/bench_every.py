"""What ``monitor.step()`` costs per training step, and what one measured step (``every(n)``) costs.

1. ``step()`` on a step that is not measured (a counter and a modulo): nanoseconds.
2. A measured step: two readings of the source, a peak reset and the metrics dict (``metrics()``).
3. The per-step average for every(1), every(10), every(100), every(1000).

On a GPU where one is usable (the allocator and NVML are read, and the counters really reset), else on
the CPU (the host reader; no CUDA figures); ``--device`` chooses. Writes JSON to ``--out``.

    python benchmarks/bench_every.py [--device auto|cuda|cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from gpumem.core.monitoring.monitor import Monitor


def per_call_us(call: Callable[[], object], repeat: int, rounds: int = 5) -> float:
    """The median over ``rounds`` of the mean cost of one call."""
    for _ in range(min(repeat, 100)):
        call()
    results = []
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(repeat):
            call()
        results.append((time.perf_counter() - began) / repeat * 1e6)
    return statistics.median(results)


def cuda_usable() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def measure(cuda: bool) -> dict[str, float]:
    if cuda:
        import torch

        keep = torch.zeros(1 << 20, device="cuda:0")  # CUDA initialized: the allocator is read
        torch.cuda.synchronize()
    mon = Monitor(warn_at=None)
    try:
        mon.every(1_000_000_000)
        figures = {"step() on a step that is not measured": per_call_us(mon.step, 1_000_000)}
        figures["metrics() (one measured step)"] = per_call_us(mon.metrics, 2_000)
        for steps in (1, 10, 100, 1000):
            mon.every(steps)
            figures[f"step() averaged over every({steps})"] = per_call_us(mon.step, max(2_000, 20 * steps))
        figures["snapshot() alone (one reading)"] = per_call_us(mon.snapshot, 2_000)
    finally:
        mon.stop()
    if cuda:
        del keep
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: CUDA if usable")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    options = parser.parse_args()
    cuda = options.device == "cuda" or (options.device == "auto" and cuda_usable())
    figures = measure(cuda)
    for name, value in figures.items():
        print(f"{name:45s} {value:10.3f} µs")
    options.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(tz=dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = options.out / f"bench_every_{'cuda' if cuda else 'cpu'}_{stamp}.json"
    path.write_text(json.dumps({"cuda": cuda, "per_call_us": figures}, indent=1) + "\n")
    print(f"written {path}")


if __name__ == "__main__":
    main()
