"""How close ``%%gpumem --predict`` comes to the real allocator, how far the batch search can be trusted,
and what a dry run costs.

1. Accuracy (CUDA): for each workload of ``predict_workloads.py``, in a fresh process: the set-up (and
   warm-up steps) for real, then the step cell dry-run (``gpumem.core.predict.predict_source``), then the
   same cell for real; predicted vs real peak allocated (``max_memory_allocated``) and peak reserved
   (``max_memory_reserved``), absolute and above the memory at the start, and the dry run's time.
2. Largest batch (CUDA): with ``--capacity`` below the device size, the batch search's answer; then, each
   in a fresh process whose allocator is capped at the capacity less the CUDA context
   (``set_per_process_memory_fraction``), the step for real at that batch (must run) and at +25% (must OOM).
3. Cost (CPU, also on a GPU machine): a dry run of a training step of a ~1B-parameter transformer.

    python benchmarks/bench_predict.py --out DIR [--only NAME ...] [--skip-cost] [--skip-search]

Writes DIR/bench_predict.json and DIR/bench_predict.md (one row per workload, every figure).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
for path in (str(SRC), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

MIB = 1 << 20
GIB = 1 << 30
SEARCH = {"mlp_adamw_first_step": (1, 65536, 8 * GIB), "encoder_bf16_gradscaler": (1, 512, 16 * GIB)}


def _workload(name: str) -> Any:
    from predict_workloads import WORKLOADS

    return next(workload for workload in WORKLOADS if workload.name == name)


def _setup(name: str, bs: int) -> dict[str, Any]:
    workload = _workload(name)
    namespace: dict[str, Any] = {"device": "cuda", "bs": bs}
    exec(workload.setup, namespace)
    for _ in range(workload.warm):
        exec(workload.step, namespace)
    return namespace


def child_accuracy(name: str) -> dict[str, Any]:
    """One workload: dry run, then the real step; every figure."""
    import torch

    from gpumem.core.predict import predict_source

    workload = _workload(name)
    namespace = _setup(name, workload.bs)
    torch.cuda.synchronize()
    start_allocated, start_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    prediction = predict_source(workload.step, namespace)
    if prediction.refusal is not None:
        return {"workload": name, "refused": str(prediction.refusal), "line": prediction.refusal.line}
    device = prediction.device("cuda:0")
    assert device is not None
    torch.cuda.reset_peak_memory_stats()
    exec(workload.step, namespace)
    torch.cuda.synchronize()
    real_allocated, real_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    return {
        "workload": name,
        "bs": workload.bs,
        "start_allocated": start_allocated,
        "start_reserved": start_reserved,
        "predicted_peak_allocated": device.peak_allocated,
        "real_peak_allocated": real_allocated,
        "predicted_peak_reserved": device.peak_reserved,
        "reserved_at_least": device.reserved_at_least,
        "real_peak_reserved": real_reserved,
        "predicted_end_allocated": device.end_allocated,
        "real_end_allocated": torch.cuda.memory_allocated(),
        "workspace_bytes": device.workspace_bytes,
        "context_bytes": device.context_bytes,
        "dry_run_s": prediction.seconds,
        "iterations": prediction.iterations,
    }


def child_search(name: str, low: int, high: int, capacity: int) -> dict[str, Any]:
    from gpumem.core.predict import predict_source
    from gpumem.core.predict.batch import search

    workload = _workload(name)
    namespace = _setup(name, low)
    result = search(lambda v: predict_source(workload.step, namespace, capacity=capacity, values={"bs": v}), low, high)
    device = result.at_largest.device("cuda:0") if result.at_largest is not None else None
    context = device.context_bytes if device is not None else None
    return {
        "largest": result.largest,
        "first_over": result.first_over,
        "runs": len(result.runs),
        "search_s": result.seconds,
        "context_bytes": context,
        "refusal": None if result.refusal is None else str(result.refusal),
    }


def child_real(name: str, bs: int, limit: int) -> dict[str, Any]:
    import torch

    torch.cuda.init()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(limit / total)
    try:
        namespace = _setup(name, bs)
        exec(_workload(name).step, namespace)
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        return {"bs": bs, "oom": True}
    return {"bs": bs, "oom": False, "peak_reserved": torch.cuda.max_memory_reserved()}


def _child(*args: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=280)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr or done.stdout)[-1500:]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def search_rows() -> list[dict[str, Any]]:
    rows = []
    for name, (low, high, capacity) in SEARCH.items():
        found = _child("search", name, str(low), str(high), str(capacity))
        row: dict[str, Any] = {"workload": name, "capacity": capacity, **found}
        largest, context = found.get("largest"), found.get("context_bytes") or 0
        if isinstance(largest, int):
            limit = capacity - context
            row["real_at_largest"] = _child("real", name, str(largest), str(limit))
            row["real_at_125pct"] = _child("real", name, str(max(largest + 1, math.ceil(largest * 1.25))), str(limit))
        rows.append(row)
    return rows


def cost_row() -> dict[str, Any]:
    """A ~1B-parameter transformer's training step, dry-run on the CPU (the model's memory is never touched)."""
    import torch

    from gpumem.core.predict import predict_source

    with torch.device("meta"):
        layer = torch.nn.TransformerEncoderLayer(2048, 16, 8192, batch_first=True, dropout=0.0)
        model = torch.nn.TransformerEncoder(layer, 20, enable_nested_tensor=False)
    model = model.to_empty(device="cpu")  # uninitialised: pages are not touched
    parameters = sum(p.numel() for p in model.parameters())
    namespace = {"torch": torch, "model": model, "opt": torch.optim.AdamW(model.parameters())}
    step = "x = torch.randn(8, 1024, 2048)\nloss = model(x).pow(2).mean()\nloss.backward()\nopt.step()\n"
    started = time.perf_counter()
    prediction = predict_source(step, namespace)
    elapsed = time.perf_counter() - started
    device = prediction.device("cpu")
    return {
        "parameters": parameters,
        "dry_run_s": elapsed,
        "refusal": None if prediction.refusal is None else str(prediction.refusal),
        "predicted_peak": None if device is None else device.peak_allocated,
        "cpus": os.cpu_count(),
    }


def _error(predicted: int | None, real: int | None, start: int = 0) -> str:
    if predicted is None or real is None or real - start == 0:
        return "n/a"
    return f"{100 * (predicted - real) / (real - start):+.2f}%"


def markdown(rows: list[dict[str, Any]], searches: list[dict[str, Any]], cost: dict[str, Any] | None) -> str:
    out = [
        (
            "| workload | allocated peak predicted / real (MiB) | error above start | error absolute |"
            " reserved peak predicted / real (MiB) | error | dry run (s) |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if "predicted_peak_allocated" not in row:
            out.append(f"| {row['workload']} | {row.get('refused') or row.get('error', '')[-300:]} | | | | | |")
            continue
        start = row["start_allocated"]
        out.append(
            f"| {row['workload']} | {row['predicted_peak_allocated'] / MIB:,.1f}"
            f" / {row['real_peak_allocated'] / MIB:,.1f}"
            f" | {_error(row['predicted_peak_allocated'], row['real_peak_allocated'], start)}"
            f" | {_error(row['predicted_peak_allocated'], row['real_peak_allocated'])}"
            f" | {'at least ' if row.get('reserved_at_least') else ''}{row['predicted_peak_reserved'] / MIB:,.1f}"
            f" / {row['real_peak_reserved'] / MIB:,.1f}"
            f" | {_error(row['predicted_peak_reserved'], row['real_peak_reserved'])} | {row['dry_run_s']:.2f} |"
        )
    for row in searches:
        at, over = row.get("real_at_largest", {}), row.get("real_at_125pct", {})
        out.append(
            f"\nbatch search {row['workload']} under {row['capacity'] / GIB:.0f} GiB: largest {row.get('largest')} in "
            f"{row.get('runs')} dry runs ({row.get('search_s', 0):.1f} s); real at it: "
            f"{'OOM' if at.get('oom') else 'ran'} ; real at {over.get('bs')}: {'OOM' if over.get('oom') else 'ran'}"
            f" {row.get('error', '') or at.get('error', '') or over.get('error', '')}"
        )
    if cost is not None:
        out.append(
            f"\ndry run of a {cost['parameters'] / 1e9:.2f}B-parameter transformer training step on the CPU "
            f"({cost['cpus']} CPUs): {cost['dry_run_s']:.2f} s (goal < 10 s) {cost.get('refusal') or ''}"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=False)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--skip-search", action="store_true")
    parser.add_argument("--child", nargs="+")
    args = parser.parse_args()
    if args.child:
        kind, rest = args.child[0], args.child[1:]
        runner = {"accuracy": child_accuracy, "search": child_search, "real": child_real}[kind]
        print(json.dumps(runner(rest[0], *(int(value) for value in rest[1:]))))
        return
    import torch

    from predict_workloads import WORKLOADS

    rows: list[dict[str, Any]] = []
    searches: list[dict[str, Any]] = []
    if torch.cuda.is_available():
        names = args.only or [workload.name for workload in WORKLOADS]
        rows = [{"workload": name, **_child("accuracy", name)} for name in names]
        searches = [] if args.skip_search else search_rows()
    cost = None if args.skip_cost else cost_row()
    report = {"accuracy": rows, "search": searches, "cost": cost, "torch": torch.__version__}
    text = markdown(rows, searches, cost)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for suffix, content in ((".json", json.dumps(report, indent=1)), (".md", text)):
            target = args.out / f"bench_predict{suffix}"
            temporary = target.with_suffix(suffix + ".tmp")
            temporary.write_text(content)
            temporary.replace(target)


if __name__ == "__main__":
    main()
