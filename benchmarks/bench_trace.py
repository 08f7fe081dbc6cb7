"""Cost of ``%%gpumem --trace``.

GPU half (skipped, exit 0, where CUDA is absent): the training cell (8 x Linear(1024), AdamW, batch 256,
300 steps) run as ``%%gpumem`` and as ``%%gpumem --trace`` in a real IPython shell, in paired, interleaved
rounds (the order alternates); reported: each variant's median wall time and the median of the per-round
ratios, which include recording, the snapshot, the analysis and the rendering. Goal: at most 1.15x.
CPU half: analysing and rendering a synthesized 100,000-entry trace to HTML. Goals: at most 1 s, 2 MB.

    python benchmarks/bench_trace.py [--out DIR] [--rounds 5] [--steps 300] [--entries 100000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from gpumem.core.trace import CellSnapshot, build_report
from gpumem.core.trace.synthetic import synthetic_snapshot

GOAL_RATIO = 1.15
GOAL_RENDER_S = 1.0
GOAL_BYTES = 2_000_000

SETUP = """\
import torch
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
data = torch.randn(256, 1024, device='cuda')
"""
TRAIN = """\
for _ in range({steps}):
    optimizer.zero_grad(set_to_none=True)
    loss = model(data).square().mean()
    loss.backward()
    optimizer.step()
torch.cuda.synchronize()
"""


def render_half(entries: int, runs: int = 5) -> dict[str, Any]:
    snapshot = synthetic_snapshot(entries)
    times, cpu_times, size = [], [], 0
    for _ in range(runs):
        start, cpu = time.perf_counter(), time.process_time()
        page = build_report(CellSnapshot(snapshot, {}, False, [], 2 * entries))._repr_html_()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
        size = len(page.encode())
    median = statistics.median(times)
    # CPU time beside wall time: on a shared machine the wall time includes other processes' turns.
    print(f"render {entries:,} entries: median {median * 1000:.0f} ms wall, "
          f"{statistics.median(cpu_times) * 1000:.0f} ms CPU (goal <= {GOAL_RENDER_S * 1000:.0f} ms), "
          f"{size:,} bytes (goal <= {GOAL_BYTES:,})")  # fmt: skip
    return {"entries": entries, "median_s": median, "times_s": times, "cpu_s": cpu_times, "html_bytes": size,
            "ok": median <= GOAL_RENDER_S and size <= GOAL_BYTES}  # fmt: skip


def gpu_half(rounds: int, steps: int) -> dict[str, Any] | None:
    try:
        import torch
    except ImportError:
        print("GPU half skipped: torch is not installed")
        return None
    if not torch.cuda.is_available():
        print("GPU half skipped: no CUDA device (torch.cuda.is_available() is False)")
        return None
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    shell = InteractiveShell.instance()
    assert shell.run_cell(SETUP).success
    assert shell.run_cell("%load_ext gpumem").success
    body = TRAIN.format(steps=steps)
    variants = {"plain": "%%gpumem -q\n" + body, "trace": "%%gpumem --trace\n" + body}

    def run(name: str) -> float:
        start = time.perf_counter()
        with capture_output(display=True):
            result = shell.run_cell(variants[name], store_history=True)
        elapsed = time.perf_counter() - start
        assert result.success, result.error_in_exec
        return elapsed

    run("plain")
    run("trace")  # warm-up: cuBLAS workspaces, the optimizer's state, the first snapshot
    times: dict[str, list[float]] = {"plain": [], "trace": []}
    ratios = []
    for round_number in range(rounds):
        order = ("plain", "trace") if round_number % 2 == 0 else ("trace", "plain")
        got = {name: run(name) for name in order}
        for name, seconds in got.items():
            times[name].append(seconds)
        ratios.append(got["trace"] / got["plain"])
    ratio = statistics.median(ratios)
    print(f"training cell, {steps} steps: plain median {statistics.median(times['plain']):.3f} s, "
          f"--trace median {statistics.median(times['trace']):.3f} s, paired ratio {ratio:.3f}x "
          f"(goal <= {GOAL_RATIO}x)")  # fmt: skip
    return {"steps": steps, "rounds": rounds, "times_s": times, "ratios": ratios, "median_ratio": ratio,
            "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "ok": ratio <= GOAL_RATIO}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write bench_trace.json there")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--entries", type=int, default=100_000)
    args = parser.parse_args()
    results = {
        "when": dt.datetime.now(dt.timezone.utc).isoformat(),
        "python": platform.python_version(),
        "render": render_half(args.entries),
        "gpu": gpu_half(args.rounds, args.steps),
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_trace.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
