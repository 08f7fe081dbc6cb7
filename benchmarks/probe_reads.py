"""What each part of a cell-boundary read costs, warm (back to back) and with cold caches (5 ms apart).

A cell starts after the user has paused, so its reads run with cold caches; a tight loop hides that.
Not a benchmark (``.ci/gpu`` runs only ``bench_*.py``): a tool for choosing what to make cheaper.

    python benchmarks/probe_reads.py [--reads 600]
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from collections.abc import Callable

from gpumem.core.readers.sources import SystemSource


def _parts(source: SystemSource) -> dict[str, Callable[[], object]]:
    import torch

    parts: dict[str, Callable[[], object]] = {
        "whole snapshot": source.snapshot,
        "host read (ours)": source.host.read,
        "psutil memory_info": source.host._process.memory_info,  # the figure the statm read replaces
        "getrusage (peak RSS)": lambda: resource.getrusage(resource.RUSAGE_SELF),
        "nvml read (ours)": lambda: [source.nvml.read(device) for device in source.nvml.devices()],
    }
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")
        parts["allocator read (ours)"] = lambda: source.torch.read(0)
        parts["torch._C._cuda_memoryStats"] = lambda: torch._C._cuda_memoryStats(0)
        parts["torch.cuda.memory_allocated"] = lambda: torch.cuda.memory_allocated(0)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=600)
    args = parser.parse_args()
    source = SystemSource()
    parts = _parts(source)
    source.snapshot()
    print(f"pid {os.getpid()}, {args.reads} reads per part")
    for pause_s in (0.0, 0.005):
        print(f"--- {pause_s * 1000:g} ms between reads")
        for name, read in parts.items():
            spent = []
            for _ in range(args.reads):
                if pause_s:
                    time.sleep(pause_s)
                began = time.perf_counter_ns()
                read()
                spent.append(time.perf_counter_ns() - began)
            spent.sort()
            median_us, p90_us = spent[len(spent) // 2] / 1000, spent[len(spent) * 9 // 10] / 1000
            print(f"{name:30s} median {median_us:7.1f} us  p90 {p90_us:7.1f} us")


if __name__ == "__main__":
    main()
