"""``%%gpumem --profile``'s read-back: gpumem's own reading of the profiler's results against PyTorch's
``key_averages(group_by_input_shape=True)``, on the same recording, with an A/A control.

Each round records ``bench_sampler``'s training step (8 x Linear(1024), AdamW, batch 256 on CUDA; where
CUDA is absent, its small CPU stand-in: width 128, batch 32, one thread) under
``torch.profiler.profile(profile_memory=True, record_shapes=True)``, then reads it three times in a
rotating order: gpumem's reader twice (the A/A pair) and ``key_averages`` once (it caches its parse, so
once is all a recording gives). Reported: each reader's median seconds, the per-round ratios ours /
PyTorch's and ours / ours (median and range), and whether the rows of every operator that moved memory
and the number of calls came out the same in every round.

    python benchmarks/bench_profile.py [--out DIR] [--rounds 5] [--steps 100]
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench_sampler import make_step
from gpumem.core.profile import operator_rows
from gpumem.core.profile_events import read_operators


def record(step: Callable[[], None], steps: int, device: str) -> Any:
    """One profiled run of ``steps`` training steps; the stopped profiler."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=True) as recorder:
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    return recorder


def _moving(rows: Any) -> list[Any]:
    return sorted(row for row in rows if row.moved_memory())


def one_round(step: Callable[[], None], steps: int, device: str, rotation: int) -> dict[str, Any]:
    recorder = record(step, steps, device)
    results = recorder.profiler.kineto_results
    seconds: dict[str, float] = {}
    tables: dict[str, Any] = {}
    order = ["ours", "torch", "ours again"]
    for name in order[rotation % 3 :] + order[: rotation % 3]:
        gc.collect()
        start = time.perf_counter()
        if name == "torch":
            rows = operator_rows(recorder.key_averages(group_by_input_shape=True))
            tables[name] = (_moving(rows), sum(row.calls for row in rows))
        else:
            table = read_operators(results, torch)
            tables[name] = (_moving(table.rows), table.calls) if table is not None else None
        seconds[name] = time.perf_counter() - start
    same = tables["ours"] == tables["torch"] == tables["ours again"]
    calls = tables["torch"][1]
    del recorder, results, tables
    gc.collect()
    return {"seconds": seconds, "same": same, "calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write bench_profile.json there")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    step, _ = make_step(device)
    one_round(step, 2, device, 0)  # warm-up: cuBLAS, the optimizer's state, the profiler's first start
    rounds = [one_round(step, args.steps, device, number) for number in range(args.rounds)]
    median = {
        name: statistics.median(one["seconds"][name] for one in rounds) for name in ("ours", "torch", "ours again")
    }
    speed = [one["seconds"]["ours"] / one["seconds"]["torch"] for one in rounds]
    control = [one["seconds"]["ours"] / one["seconds"]["ours again"] for one in rounds]
    same = all(one["same"] for one in rounds)
    line = (f"--profile read-back, {args.steps}-step training loop on {device}, {rounds[0]['calls']:,} calls, "
            f"{args.rounds} rounds: ours {median['ours']:.3f} s, key_averages {median['torch']:.3f} s; "
            f"ours/theirs {statistics.median(speed):.3f} ({min(speed):.3f}-{max(speed):.3f}), "
            f"A/A ours/ours {statistics.median(control):.3f} ({min(control):.3f}-{max(control):.3f}); "
            f"rows and calls the same in every round: {same}")  # fmt: skip
    print(line)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        summary = {"when": dt.datetime.now(dt.timezone.utc).isoformat(), "python": platform.python_version(),
                   "torch": torch.__version__, "device": device, "steps": args.steps, "rounds": rounds,
                   "median_s": median, "ratio": speed, "control": control, "same": same}  # fmt: skip
        (args.out / "bench_profile.json").write_text(json.dumps(summary, indent=1))
        (args.out / "bench_profile.md").write_text(f"## bench_profile ({torch.__version__})\n\n{line}\n")
    if not same:
        raise SystemExit("the read-back differs from key_averages")


if __name__ == "__main__":
    main()
