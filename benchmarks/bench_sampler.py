"""Sampler cost, on the GPU (CPU-only machines run a smaller loop on the CPU, labelled as such).

1. With CUDA, one allocator read per device: gpumem's fast path vs ``torch.cuda.memory_allocated`` vs NVML.
2. A launch-bound training loop (8 x Linear(1024), AdamW, batch 256; on CPU 8 x Linear(128), batch 32)
   with no sampler (A) and gpumem's sampler at its default rate (B), in paired ABBA rounds with an A/A
   control (``benchmarks/_paired.py``): the B/A median is shown beside the A/A's spread, the noise floor.
   ``--naive`` adds a thread calling ``memory_allocated`` at 100 Hz as a second B.

    python benchmarks/bench_sampler.py --out DIR [--budget 150] [--steps 10] [--quads 8] [--naive]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _paired
from gpumem.core.monitoring.monitor import Monitor
from gpumem.core.readers.sources import NvmlSource, SystemSource, TorchAllocatorSource
from gpumem.core.sampling.sampler import DEFAULT_RATE_HZ


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


def make_step(device: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """One training step (not synchronized) and the device's synchronize, built once."""
    width, batch = (1024, 256) if device == "cuda" else (128, 32)
    if device == "cpu":
        torch.set_num_threads(1)  # a small CPU stand-in; one thread is less disturbed on a shared machine
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    data = torch.randn(batch, width, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(data).square().mean().backward()
        optimizer.step()

    return step, torch.cuda.synchronize if device == "cuda" else (lambda: None)


def make_loop(device: str) -> Callable[[int], float]:
    """The training loop, built once: ``loop(steps)`` returns the seconds ``steps`` steps took."""
    step, sync = make_step(device)

    def loop(steps: int) -> float:
        sync()
        began = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        return time.perf_counter() - began

    loop(20)
    return loop


class Sampling:
    """The B variant: the sampler started before a quad's two B runs and stopped after them, with the
    seconds it ran.

    A start takes its first sample at once, so with runs shorter than the sampler's period B samples
    more often than the default rate: the rate it really ran at is reported beside the ratio.
    """

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.seconds = 0.0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        began = time.monotonic()
        self.monitor.sampler.start()
        try:
            yield
        finally:
            self.monitor.sampler.stop()
            self.seconds += time.monotonic() - began

    def samples_per_s(self) -> float:
        samples = self.monitor.sampler.cost().samples
        return samples / self.seconds if self.seconds else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path())
    parser.add_argument("--budget", type=float, default=None, help="seconds per comparison (GPU 150, CPU 40)")
    parser.add_argument("--steps", type=int, default=10, help="training steps per run")
    parser.add_argument("--quads", type=int, default=8, help="A/B and A/A quads per round to start with")
    parser.add_argument("--naive", action="store_true", help="also compare a naive 100 Hz memory_allocated thread")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.zeros(1, device="cuda")
    costs = read_costs() if cuda else {}
    budget = args.budget or (150.0 if cuda else 40.0)
    steps = args.steps
    loop = make_loop(device)
    monitor = Monitor(rate_hz=DEFAULT_RATE_HZ)
    monitor.source.snapshot()  # opening NVML and psutil happens here, not inside the first timed run
    sampling = Sampling(monitor)
    comparisons = {f"gpumem sampler ({DEFAULT_RATE_HZ:g} Hz) / no sampler": sampling}
    if args.naive and cuda:
        comparisons["naive memory_allocated thread (100 Hz) / no sampler"] = lambda: NaiveThread(100.0)
    results = {}
    for name, variant in comparisons.items():
        print(name)
        results[name] = _paired.paired_ratio(
            _paired.null_variant, variant, loop, size=steps, budget_s=budget, quads=args.quads, grow="quads"
        )
    cost = monitor.sampler.cost()
    machine = torch.cuda.get_device_name(0) if cuda else "CPU, 2-core CI-class machine, not the goal machine"
    result = {
        "date": dt.date.today().isoformat(),
        "machine": machine,
        "device": device,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "read_cost_us": costs,
        "comparisons": results,
        "gpumem_samples": cost.samples,
        "samples_per_s_while_on": sampling.samples_per_s(),
        "gpumem_sample_mean_us": cost.mean_s * 1e6,
        "gpumem_sample_max_us": cost.max_s * 1e6,
    }
    (args.out / "bench_sampler.json").write_text(json.dumps(result, indent=2))
    lines = [f"### Sampler cost ({machine}, torch {result['torch']}, {result['date']})", ""]
    if costs:
        lines += ["| read | us per call |", "| --- | --- |"]
        lines += [f"| {name} | {value:.1f} |" for name, value in costs.items()]
        lines += [""]
    width = "8 x Linear(1024), batch 256" if cuda else "8 x Linear(128), batch 32, on the CPU"
    lines += [
        f"Training loop ({width}), paired ABBA quads with an A/A control, interleaved; size = steps per run:",
        "",
    ]
    lines += _paired.MARKDOWN_HEADER
    lines += [_paired.markdown_row(name, r) for name, r in results.items()]
    lines += [
        "",
        (
            f"The sampler's own reads: {cost.samples} samples, mean {cost.mean_s * 1e6:.1f} us, "
            f"max {cost.max_s * 1e6:.1f} us (timed around each read, on the sampler thread). "
            f"While on, it took {sampling.samples_per_s():.1f} samples a second (each start samples at once; "
            f"the default rate is {DEFAULT_RATE_HZ:g}): an upper bound on the default's cost."
        ),
    ]
    (args.out / "bench_sampler.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
