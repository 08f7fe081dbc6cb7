"""Cost of ``%gpumem who``: the holder walk over 1,000 variables and a 100M-parameter model with AdamW state.

The namespace holds 700 tensors, 100 lists of 4 tensors, 100 dicts of 2 tensors (one a view), 100 plain
objects with a tensor attribute, and a 12-block MLP of 100.7M parameters whose AdamW optimizer has taken
one step (parameters, gradients and two state tensors per parameter), and ``loss``: the model's output
on a fresh batch, before backward, so its autograd graph (about 50 nodes, the activations it saved) is
walked too. Reported: the median and fastest of N walks (``find_holders``), and of the walk plus the text
and HTML rendering, after two warm-up runs. Goal: at most 20 ms on a GPU machine.

    python benchmarks/bench_holders.py --out DIR [--device cuda|cpu] [--runs 30]
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

import torch

from gpumem.core.holders import find_holders, render_html, render_text

GOAL_MS = 20.0


class Record:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.label = "record"


def build_namespace(device: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    for index in range(700):
        namespace[f"t{index}"] = torch.zeros(256, device=device)
    for index in range(100):
        namespace[f"list{index}"] = [torch.zeros(64, device=device) for _ in range(4)]
    for index in range(100):
        base = torch.zeros(128, device=device)
        namespace[f"dict{index}"] = {"base": base, "view": base[:64], "step": index}
    for index in range(100):
        namespace[f"obj{index}"] = Record(torch.zeros(32, device=device))
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 2048))
        for _ in range(12)
    ]
    model = torch.nn.Sequential(*blocks, torch.nn.LayerNorm(2048)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, 2048, device=device)).sum().backward()
    optimizer.step()
    namespace["model"] = model
    namespace["optimizer"] = optimizer
    namespace["loss"] = model(torch.randn(8, 2048, device=device)).sum()  # keeps its graph's activations
    return namespace


def timed(call: Any, runs: int) -> list[float]:
    for _ in range(2):
        call()
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        call()
        times.append((time.perf_counter() - began) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path())
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    namespace = build_namespace(args.device)
    parameters = sum(p.numel() for p in namespace["model"].parameters())
    variables = len(namespace)
    report = find_holders(namespace, device=args.device, include_hidden=False)
    walk = timed(lambda: find_holders(namespace, device=args.device, include_hidden=False), args.runs)

    def walk_and_render() -> None:
        result = find_holders(namespace, device=args.device, include_hidden=False)
        render_text(result)
        render_html(result)

    full = timed(walk_and_render, args.runs)
    model_row = next(row for row in report.holders if row.name == "model")
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "variables": variables,
        "model_parameters": parameters,
        "holders": len(report.holders),
        "tensor_bytes_found": report.total_bytes,
        "model_breakdown_bytes": model_row.breakdown,
        "truncated": report.truncated,
        "graph_saved_bytes": getattr(report, "graph_saved_bytes", None),
        "kinds": [list(kind) for kind in getattr(report, "kinds", ())],
        "runs": args.runs,
        "walk_median_ms": statistics.median(walk),
        "walk_min_ms": min(walk),
        "walk_and_render_median_ms": statistics.median(full),
        "walk_and_render_min_ms": min(full),
        "goal_ms": GOAL_MS,
    }
    result["meets_goal"] = result["walk_and_render_median_ms"] <= GOAL_MS
    (args.out / "bench_holders.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"### `%gpumem who` walk ({result['device']}: {result['device_name']}, torch {result['torch']})",
        "",
        (
            f"{variables} variables incl. a {parameters / 1e6:.1f}M-parameter model with AdamW state "
            f"({len(report.holders)} holder rows, {report.total_bytes / 2**30:.2f} GiB of tensors found, "
            f"truncated: {report.truncated}); {args.runs} runs after 2 warm-ups."
        ),
        "",
        "| step | median | fastest | goal |",
        "| --- | --- | --- | --- |",
        f"| find_holders | {result['walk_median_ms']:.1f} ms | {result['walk_min_ms']:.1f} ms | |",
        (
            f"| find_holders + text + HTML | {result['walk_and_render_median_ms']:.1f} ms | "
            f"{result['walk_and_render_min_ms']:.1f} ms | <= {GOAL_MS:.0f} ms |"
        ),
    ]
    (args.out / "bench_holders.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
