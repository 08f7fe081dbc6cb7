"""gpumem's threads, steady, with the panel shown and the main thread busy or idle, and where a writer pass goes.

``bench_threads.py``'s set-up (its monitor, a shown panel, a status comm a front end confirmed, messages
serialized by CommRecorder), then ``--seconds`` of the main thread either spinning in pure Python (``busy``:
it wants the GIL all the time, as a launch-bound training loop nearly does) or sleeping (``idle``). Prints each
thread's CPU per second of wall time and runs per second, the panel's pushes per second, and per part of a
writer pass (header, curve frame, curve message, the readers' status...) how often it ran, its median CPU and
wall time on the writer thread (wall far above CPU: the pass waited for the GIL) and its CPU per second.

Not a benchmark (``.ci/gpu`` runs only ``bench_*.py``): a tool for finding what to make cheaper. ``cuda`` uses
the real sources (the allocator, NVML, the host), ``fake`` gpumem's fake allocator.

    python benchmarks/profile_threads.py [cuda|fake] [busy|idle] [--seconds 10] [--no-cuda-init]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_threads

WRITER = "gpumem-panel-writer"
# (owner, attribute, label): the parts of a writer pass that are timed.
_PARTS: tuple[tuple[str, str, str], ...] = (
    ("Panel", "_service", "pass"),
    ("Panel", "_push_header", "header push"),
    ("Panel", "_push_curves", "curve push"),
    ("widget", "build_curve_frame", "curve frame"),
    ("widget", "build_header", "header model"),
    ("widget", "render_header", "header HTML"),
    ("PanelView", "show_frame", "curve message"),
    ("PanelView", "show_header", "header message"),
)


def _timed(function: Callable[..., Any], label: str, parts: dict[str, list[tuple[float, float]]]) -> Any:
    """``function``, recording the CPU and wall time of each call made on the writer thread."""

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name != WRITER:
            return function(*args, **kwargs)
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            parts.setdefault(label, []).append((time.thread_time() - cpu, time.perf_counter() - wall))

    return timed


def _instrument(parts: dict[str, list[tuple[float, float]]]) -> None:
    from gpumem.core.monitoring.monitor import Monitor
    from gpumem.panel import view, widget

    owners: dict[str, Any] = {"Panel": widget.Panel, "widget": widget, "PanelView": view.PanelView}
    for owner, name, label in _PARTS:
        setattr(owners[owner], name, _timed(getattr(owners[owner], name), label, parts))
    Monitor.status = _timed(Monitor.status, "readers' status", parts)  # type: ignore[method-assign]


def _spin_or_sleep(seconds: float, busy: bool) -> None:
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        if busy:
            total = 0
            for i in range(1000):
                total += i
        else:
            time.sleep(0.01)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", choices=("cuda", "fake"), default="fake")
    parser.add_argument("main_thread", nargs="?", choices=("busy", "idle"), default="busy")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds after the panel opens, not counted")
    parser.add_argument(
        "--no-cuda-init", action="store_true",
        help="leave CUDA uninitialized (then NVML is read through pynvml, which lets go of the GIL)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.source == "cuda" and not args.no_cuda_init:
        import torch

        if torch.cuda.is_available():
            torch.zeros(1, device="cuda")  # as in a notebook that put a tensor on the GPU
    from _harness.traffic import CommRecorder
    from gpumem.panel import widget

    parts: dict[str, list[tuple[float, float]]] = {}
    _instrument(parts)
    probe = bench_threads.Probe(1.0)
    with CommRecorder(), bench_threads.threads_on(probe, cuda=args.source == "cuda", settle_s=args.settle):
        panel = widget.open_panels()[0]
        parts.clear()
        cpu_before, runs_before = bench_threads.thread_cpu_s(), bench_threads.thread_runs()
        pushes_before, began = panel.stats().curve_pushes, time.monotonic()
        _spin_or_sleep(args.seconds, args.main_thread == "busy")
        wall_s = time.monotonic() - began
        cpu = bench_threads.per_second(bench_threads.thread_cpu_s(), cpu_before, wall_s)
        runs = bench_threads.per_second(bench_threads.thread_runs(), runs_before, wall_s)
        pushes = (panel.stats().curve_pushes - pushes_before) / wall_s
    print(f"{args.source} source, main thread {args.main_thread}, {wall_s:.1f} s:")
    for name in bench_threads.THREAD_NAMES:
        print(f"  {name:22s} {cpu.get(name, 0.0) * 1e3:7.3f} ms CPU per s, {runs.get(name, 0.0):5.1f} runs per s")
    print(f"  curve pushes per s: {pushes:.2f}")
    for label, calls in parts.items():
        cpus, walls = [c for c, _ in calls], [w for _, w in calls]
        print(
            f"  {label:16s} {len(calls) / wall_s:5.2f} per s, CPU median {statistics.median(cpus) * 1e6:7.0f} us, "
            f"wall median {statistics.median(walls) * 1e6:8.0f} us, {sum(cpus) / wall_s * 1e3:6.3f} ms CPU per s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
