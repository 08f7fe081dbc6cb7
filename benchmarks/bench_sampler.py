"""Sampler cost on a CUDA GPU, side by side in one run.

1. One allocator read per device: gpumem's fast path vs ``torch.cuda.memory_allocated`` vs NVML.
2. A launch-bound training loop (8 x Linear(1024), AdamW, batch 256, 600 steps) with no sampler, with
   gpumem's sampler at its default rate, and with a naive thread calling ``memory_allocated`` at 100 Hz.
   Variants are interleaved over several rounds; the fastest round of each (least disturbed by the
   machine) and the median are reported.

    python benchmarks/bench_sampler.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gpumem.core.monitor import Monitor
from gpumem.core.sampler import DEFAULT_RATE_HZ
from gpumem.core.sources import NvmlSource, SystemSource, TorchAllocatorSource


def per_call_us(call: Callable[[], object], repeat: int = 20_000) -> float:
    for _ in range(1_000):
        call()
    best = []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(repeat):
            call()
        best.append((time.perf_counter() - began) / repeat * 1e6)
    return statistics.median(best)


def read_costs() -> dict[str, float]:
    torch_source = TorchAllocatorSource()
    nvml = NvmlSource()
    system = SystemSource()
    return {
        "gpumem allocator read (fast path)": per_call_us(lambda: torch_source.read(0)),
        "torch.cuda.memory_allocated(0)": per_call_us(lambda: torch.cuda.memory_allocated(0)),
        "torch.cuda.memory_stats(0)": per_call_us(lambda: torch.cuda.memory_stats(0), repeat=5_000),
        "gpumem NVML read": per_call_us(lambda: nvml.read(0)),
        "gpumem full snapshot (allocator + NVML + host)": per_call_us(system.snapshot, repeat=5_000),
    }


class NaiveThread:
    def __init__(self, rate_hz: float) -> None:
        self.period = 1.0 / rate_hz
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop_event.wait(self.period):
            torch.cuda.memory_allocated()

    def __enter__(self) -> None:
        self.thread.start()

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.thread.join()


class NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def training_loop_s(steps: int = 600) -> float:
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    data = torch.randn(256, 1024, device="cuda")
    for _ in range(20):
        optimizer.zero_grad(set_to_none=True)
        model(data).square().mean().backward()
        optimizer.step()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        model(data).square().mean().backward()
        optimizer.step()
    torch.cuda.synchronize()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path())
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.zeros(1, device="cuda")
    costs = read_costs()
    gpumem_name = f"gpumem sampler ({DEFAULT_RATE_HZ:g} Hz)"
    monitors: list[Monitor] = []

    def gpumem_monitor() -> Monitor:
        monitors.append(Monitor(rate_hz=DEFAULT_RATE_HZ))
        return monitors[-1]

    variants = {
        "no sampler": NullContext,
        gpumem_name: gpumem_monitor,
        "naive memory_allocated thread (100 Hz)": lambda: NaiveThread(100.0),
    }
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in variants}
    training_loop_s(100)
    for round_index in range(args.rounds):
        # Rotate the order so that no variant always runs first (or right after another one).
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            with variants[name]():
                times[name].append(training_loop_s())
    medians = {name: statistics.median(values) for name, values in times.items()}
    fastest = {name: min(values) for name, values in times.items()}
    baseline = medians["no sampler"]
    fastest_baseline = fastest["no sampler"]
    # Per round, each variant against the no-sampler run of the same round: drift cancels out.
    paired = {
        name: statistics.median(v / b for v, b in zip(times[name], times["no sampler"], strict=True))
        for name in variants
    }
    sampler_cost = [monitor.sampler.cost() for monitor in monitors]
    busy_fraction = sum(c.total_s for c in sampler_cost) / sum(times[gpumem_name])
    result = {
        "date": dt.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "read_cost_us": costs,
        "training_loop_s": times,
        "median_s": medians,
        "fastest_s": fastest,
        "ratio_to_no_sampler_median": {name: value / baseline for name, value in medians.items()},
        "ratio_to_no_sampler_fastest": {name: value / fastest_baseline for name, value in fastest.items()},
        "ratio_to_no_sampler_paired_median": paired,
        "gpumem_sampler_busy_fraction": busy_fraction,
        "gpumem_samples": sum(c.samples for c in sampler_cost),
    }
    (args.out / "bench_sampler.json").write_text(json.dumps(result, indent=2))
    lines = [f"### Sampler cost ({result['gpu']}, torch {result['torch']}, {result['date']})", ""]
    lines += ["| read | us per call |", "| --- | --- |"]
    lines += [f"| {name} | {value:.1f} |" for name, value in costs.items()]
    lines += ["", f"Training loop, 600 steps, {args.rounds} rounds in rotating order:", ""]
    lines += [
        "| variant | fastest s | ratio | median s | ratio | paired median ratio |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {name} | {fastest[name]:.3f} | {fastest[name] / fastest_baseline:.4f}x "
        f"| {medians[name]:.3f} | {medians[name] / baseline:.4f}x | {paired[name]:.4f}x |"
        for name in variants
    ]
    lines += [
        "",
        (
            f"The gpumem sampler itself was busy {busy_fraction * 100:.3f}% of the loop's wall time "
            f"({result['gpumem_samples']} samples, timed around each read)."
        ),
    ]
    (args.out / "bench_sampler.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
