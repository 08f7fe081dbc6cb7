"""``%%gpumem --profile``'s read-back: gpumem's own reading of the profiler's results against PyTorch's
``key_averages(group_by_input_shape=True)``, on the same recording, with an A/A control.

Each round records ``bench_sampler``'s training step (8 x Linear(1024), AdamW, batch 256 on CUDA; where
CUDA is absent, its small CPU stand-in: width 128, batch 32, one thread) under
``torch.profiler.profile(profile_memory=True, record_shapes=True)``, then reads it three times in a
rotating order: gpumem's reader twice (the A/A pair) and ``key_averages`` once (it caches its parse, so
once is all a recording gives). Reported: each reader's median seconds, the per-round ratios ours /
PyTorch's and ours / ours (median and range), and whether the rows of every operator that moved memory
and the number of calls came out the same in every round.

Then the whole cost of each recorder, paired with the bare loop: each round runs, in a rotating
order, the loop bare twice (the A/A control), under ``--profile``'s default recorder (PyTorch's
CPU-side records, ``profile_records``) and under the Kineto profiler, each recorded run timed from
the recorder's start to the end of gpumem's read-back (what a ``--profile`` cell adds), split into
recording, stopping and reading back. Reported: the medians of the per-round ratios to the bare run
beside the A/A's (goal for the whole ``--profile``: at most 2x), and the read-back's share of the
Kineto profiler's own recording + stop (goal: at most 10%). Beside them, the loop under a
``TorchDispatchMode`` that only passes each call on: the floor of any recorder at the dispatch level,
before it counts anything (it sees only the calls below autograd, not ``aten::linear``, autograd's
nodes or ``record_function`` labels, so its rows could not be ``key_averages``' anyway).

    python benchmarks/bench_profile.py [--out DIR] [--rounds 5] [--steps 100] [--whole-rounds 7]
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
from torch.utils._python_dispatch import TorchDispatchMode

from bench_sampler import make_step
from gpumem.core.diagnoses.profile import operator_rows
from gpumem.core.diagnoses.profile_events import read_operators
from gpumem.core.diagnoses.profile_records import RecordsProfiler, read_records


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


def _timed_run(step: Callable[[], None], steps: int, device: str, recorder: str) -> dict[str, float]:
    """One run of the loop: bare, or under a recorder from its start to the end of the read-back."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gc.collect()  # untimed: what the previous run left is not this run's cost
    sync()
    began = time.perf_counter()
    profiler: Any = None
    if recorder == "records":
        profiler = RecordsProfiler(torch)
        profiler.start()
    elif recorder == "dispatch":
        profiler = _Passthrough()
        profiler.__enter__()
    elif recorder == "kineto":
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=True)
        profiler.__enter__()
    for _ in range(steps):
        step()
    sync()
    ran = time.perf_counter()
    if recorder == "records":
        records = profiler.stop()
        stopped = time.perf_counter()
        table = read_records(records)
    elif recorder == "kineto":
        profiler.__exit__(None, None, None)
        stopped = time.perf_counter()
        table = read_operators(profiler.profiler.kineto_results, torch)
    else:
        if recorder == "dispatch":
            profiler.__exit__(None, None, None)
        stopped, table = ran, None
    done = time.perf_counter()
    if recorder in ("records", "kineto") and table is None:
        raise SystemExit(f"the {recorder} recorder's read-back failed")
    return {"whole": done - began, "recording": ran - began, "stop": stopped - ran, "read": done - stopped}


WHOLE = ("bare", "bare again", "records", "kineto", "dispatch")


class _Passthrough(TorchDispatchMode):
    """A dispatch-level recorder's floor: every aten call below autograd through Python, nothing kept."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def whole_cost(step: Callable[[], None], steps: int, device: str, rounds: int) -> dict[str, Any]:
    """Paired rounds of the bare loop (twice: A/A), and the loop under each recorder, rotating."""
    for name in WHOLE:  # warm-up
        _timed_run(step, 2, device, name.split()[0])
    runs: list[dict[str, dict[str, float]]] = []
    for number in range(rounds):
        order = WHOLE[number % len(WHOLE) :] + WHOLE[: number % len(WHOLE)]
        runs.append({name: _timed_run(step, steps, device, name.split()[0]) for name in order})
    ratio = {name: [one[name]["whole"] / one["bare"]["whole"] for one in runs] for name in WHOLE[1:]}
    share = [one["kineto"]["read"] / (one["kineto"]["recording"] - one["bare"]["whole"] + one["kineto"]["stop"])
             for one in runs]  # fmt: skip
    floor = [(one["records"]["recording"] + one["records"]["stop"]) / one["bare"]["whole"] for one in runs]
    median = {name: {part: statistics.median(one[name][part] for one in runs) for part in runs[0][name]}
              for name in WHOLE}  # fmt: skip
    for name in WHOLE[1:]:
        values = ratio[name]
        parts = median[name]
        print(f"  {name}: {statistics.median(values):.3f}x the bare loop ({min(values):.3f}-{max(values):.3f}); "
              f"recording {parts['recording']:.3f} s, stop {parts['stop']:.3f} s, "
              f"read-back {parts['read']:.3f} s")  # fmt: skip
    print(f"  bare loop {median['bare']['whole']:.3f} s; Kineto's read-back / its own recording + stop: "
          f"{statistics.median(share):.3f} ({min(share):.3f}-{max(share):.3f}; goal <= 0.10); "
          f"whole --profile with the records recorder {statistics.median(ratio['records']):.3f}x "
          "(goal <= 2x)")  # fmt: skip
    print(f"  the records recorder's recording + stop alone, before any read-back: {statistics.median(floor):.3f}x "
          f"({min(floor):.3f}-{max(floor):.3f}): the floor of a --profile on it")  # fmt: skip
    return {"runs": runs, "ratio_to_bare": ratio, "kineto_read_share": share, "records_floor": floor,
            "median_s": median}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write bench_profile.json there")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--whole-rounds", type=int, default=7, help="paired rounds of the whole cost (0: none)")
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
    whole = None
    if args.whole_rounds:
        print(f"whole --profile cost, {args.steps}-step training loop on {device}, {args.whole_rounds} paired rounds:")
        whole = whole_cost(step, args.steps, device, args.whole_rounds)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        summary = {"when": dt.datetime.now(dt.timezone.utc).isoformat(), "python": platform.python_version(),
                   "torch": torch.__version__, "device": device, "steps": args.steps, "rounds": rounds,
                   "median_s": median, "ratio": speed, "control": control, "same": same, "whole": whole}  # fmt: skip
        (args.out / "bench_profile.json").write_text(json.dumps(summary, indent=1))
        (args.out / "bench_profile.md").write_text(f"## bench_profile ({torch.__version__})\n\n{line}\n")
    if not same:
        raise SystemExit("the read-back differs from key_averages")


if __name__ == "__main__":
    main()
