"""The training loop's own timing noise, and which paired design averages it down to the A/A target.

Not a benchmark (``.ci/gpu`` runs only ``bench_*.py``): a tool for choosing ``_paired.py``'s run length
and quads per round on a machine. It times every step of ``bench_sampler.py``'s training loop for
``--seconds`` with nothing else running (synchronizing every ``--sync`` steps), once as the process
is and once pinned to two cores (``--pin``), and writes the step times. Then, over those A-only
series, it plays each design: runs of ``b`` steps, rounds of ``q`` A/B quads and ``q`` A/A quads
interleaved, through ``_paired.round_sums`` as ``_paired.paired_ratio`` runs them. Both ratios of a
round are A/A here, so their IQR is the floor a real comparison would see with that design, before any switching cost.

    python benchmarks/probe_noise.py --out DIR [--seconds 45] [--sync 5] [--pin]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _paired
import bench_sampler

BLOCKS = (5, 10, 25, 50, 100, 200, 400)
QUADS = (1, 2, 4, 8, 16, 32)


def step_times(seconds: float, sync_every: int) -> list[float]:
    """Each step's seconds over ``seconds`` of the loop; a synchronize closes every ``sync_every`` steps,
    inside the last step's time, as at the end of a run."""
    step, sync = bench_sampler.make_step("cuda" if torch.cuda.is_available() else "cpu")
    for _ in range(20):
        step()
    sync()
    times: list[float] = []
    clock = time.perf_counter
    ended = clock() + seconds
    while clock() < ended:
        for index in range(sync_every):
            began = clock()
            step()
            if index == sync_every - 1:
                sync()
            times.append(clock() - began)
    return times


def play(steps: list[float], block: int, quads: int) -> dict[str, float]:
    """The A/A ratios that design would give over ``steps``, through ``_paired``'s own rounds (a recorded
    run stands in for each timed one): their IQR, rounds, and a round's seconds."""
    runs = [sum(steps[i : i + block]) for i in range(0, len(steps) - block + 1, block)]
    recorded = iter(runs)
    ratios: list[float] = []
    with contextlib.suppress(StopIteration):  # the series ran out: its unfinished round is dropped
        while True:
            sums = _paired.round_sums(
                _paired.null_variant, _paired.null_variant, lambda _size: next(recorded), block, quads,
                control_first=len(ratios) // 2 % 2 == 1,
            )  # fmt: skip
            ratios += [sums.paired, sums.control]  # both are A/A here
    if len(ratios) < 4:
        return {"rounds": len(ratios)}
    q1, q2, q3 = _paired.quartiles(ratios)
    return {"rounds": len(ratios), "q1": q1, "median": q2, "q3": q3, "round_s": sum(runs[: 8 * quads])}


def table(steps: list[float]) -> list[str]:
    lines = ["| run (steps) | " + " | ".join(f"{q} quads" for q in QUADS) + " |"]
    lines.append("| ---: | " + " | ".join("---" for _ in QUADS) + " |")
    for block in BLOCKS:
        cells = []
        for quads in QUADS:
            result = play(steps, block, quads)
            if "q1" not in result:
                cells.append("-")
                continue
            half = max(1 - result["q1"], result["q3"] - 1)
            cells.append(f"±{half:.2%} ({result['rounds']} x {result['round_s']:.1f} s)")
        lines.append(f"| {block} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path())
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--sync", type=int, default=5, help="a synchronize every this many steps")
    parser.add_argument("--pin", action="store_true", help="also a series pinned to two cores")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")
    series = {"as is": step_times(args.seconds, args.sync)}
    if args.pin and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, set(cores[-2:]))
        series[f"pinned to cores {cores[-2:]}"] = step_times(args.seconds, args.sync)
        os.sched_setaffinity(0, set(cores))
    lines = []
    for name, steps in series.items():
        lines += [
            f"### {name}: {len(steps)} steps, median {statistics.median(steps) * 1e3:.3f} ms a step",
            "",
            "Half-width of the A/A IQR (rounds x a round's seconds) for each design:",
            "",
            *table(steps),
            "",
        ]
    (args.out / "probe_noise.json").write_text(json.dumps(series))
    (args.out / "probe_noise.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
