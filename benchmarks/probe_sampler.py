"""Where a sampler thread's CPU goes while the main thread is busy: one part of a sample at a time.

Each variant is a thread that wakes 10 times a second (as the sampler does) and does one thing: nothing,
an allocator read, an NVML read through pynvml (the GIL let go) or with the GIL held, the whole snapshot
either way, or the real sampler. While it runs, the main thread is busy (a pure-Python loop, or the
launch-bound training loop on CUDA). Per sample it prints the thread's CPU (thread clock) and how many
times the scheduler ran it (``/proc`` schedstat): each hand-off of the GIL from the busy main thread
costs wake-ups. Not a benchmark (``.ci/gpu`` runs only ``bench_*.py``): a tool for choosing what to cut.

    python benchmarks/probe_sampler.py [--seconds 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpumem.core.readers.sources import SystemSource
from gpumem.core.sampling.sampler import Sampler
from gpumem.core.sampling.timeline import Timeline

PERIOD_S = 0.1


def _runs(thread: threading.Thread) -> int:
    text = Path(f"/proc/self/task/{thread.native_id}/schedstat").read_text()
    return int(text.split()[2])


def _ticking(work: Callable[[], object], stop: threading.Event, counted: list[int]) -> None:
    next_tick = time.monotonic()
    while not stop.is_set():
        work()
        counted[0] += 1
        next_tick += PERIOD_S
        stop.wait(max(0.0, next_tick - time.monotonic()))


def _busy_python(seconds: float) -> float:
    """Iterations per second of a loop that always wants the GIL."""
    end = time.perf_counter() + seconds
    count = 0
    while time.perf_counter() < end:
        count += 1
    return count / seconds


def _training(seconds: float) -> Callable[[float], float] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    data = torch.randn(256, 1024, device="cuda")

    def steps_per_s(run_s: float) -> float:
        torch.cuda.synchronize()
        end = time.perf_counter() + run_s
        count = 0
        while time.perf_counter() < end:
            optimizer.zero_grad(set_to_none=True)
            model(data).square().mean().backward()
            optimizer.step()
            count += 1
        torch.cuda.synchronize()
        return count / run_s

    steps_per_s(min(1.0, seconds))
    return steps_per_s


def _variants(source: SystemSource) -> dict[str, Callable[[], object] | str]:
    import pynvml

    nvml = source.nvml
    handle = nvml._handles.get(0)
    held = nvml._held
    variants: dict[str, Callable[[], object] | str] = {"wake only": lambda: None}
    if source.torch.devices():
        variants["allocator read"] = lambda: source.torch.read(0)
    if handle is not None:
        variants["nvml read, GIL let go (pynvml)"] = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle)
        if held is not None:
            variants["nvml read, GIL held"] = lambda: held.read(handle)
    variants["host read"] = source.host.read
    variants["snapshot, GIL held"] = source.snapshot
    variants["sampler, GIL held"] = "sampler"
    variants["snapshot, GIL let go"] = "snapshot-release"
    variants["sampler, GIL let go"] = "sampler-release"
    return variants


def _measure(
    name: str, work: Callable[[], object] | str, source: SystemSource, load: Callable[[float], float], seconds: float
) -> dict[str, Any]:
    held = source.nvml._held
    if isinstance(work, str) and work.endswith("release"):
        source.nvml._held = None
    stop, counted = threading.Event(), [0]
    sampler = None
    if isinstance(work, str) and work.startswith("sampler"):
        sampler = Sampler(source, Timeline(), rate_hz=1 / PERIOD_S)
        sampler.start()
        thread = sampler._thread
    else:
        call = source.snapshot if isinstance(work, str) else work
        thread = threading.Thread(target=_ticking, args=(call, stop, counted), name="probe", daemon=True)
        thread.start()
    assert thread is not None
    time.sleep(0.3)
    clock = time.pthread_getcpuclockid(thread.ident)  # type: ignore[arg-type]
    cpu_before, runs_before = time.clock_gettime(clock), _runs(thread)
    samples_before = sampler.cost().samples if sampler else counted[0]
    rate = load(seconds)
    cpu, runs = time.clock_gettime(clock) - cpu_before, _runs(thread) - runs_before
    samples = (sampler.cost().samples if sampler else counted[0]) - samples_before
    if sampler is not None:
        sampler.stop()
    stop.set()
    thread.join(2)
    source.nvml._held = held
    return {
        "variant": name,
        "samples": samples,
        "cpu_us_per_sample": cpu / max(1, samples) * 1e6,
        "runs_per_sample": runs / max(1, samples),
        "cpu_ms_per_s": cpu / seconds * 1e3,
        "main_rate": rate,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    train = _training(args.seconds)
    source = SystemSource()
    source.snapshot()
    loads: dict[str, Callable[[float], float]] = {"busy Python loop": _busy_python}
    if train is not None:
        loads["training loop"] = train
    rows = []
    print(f"pid {os.getpid()}, {args.seconds:g} s per variant, NVML held: {source.nvml.reads_holding_gil}")
    for load_name, load in loads.items():
        baseline = load(args.seconds)
        print(f"--- main thread: {load_name} ({baseline:,.0f} per s alone)")
        for name, work in _variants(source).items():
            row = _measure(name, work, source, load, args.seconds)
            row["load"], row["main_loss"] = load_name, 1 - row["main_rate"] / baseline
            rows.append(row)
            print(
                f"{name:32s} {row['cpu_us_per_sample']:7.1f} us CPU/sample  {row['runs_per_sample']:4.1f} runs/sample"
                f"  {row['cpu_ms_per_s']:5.2f} ms/s  main {row['main_loss'] * 100:+5.2f}% slower"
            )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_sampler.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
