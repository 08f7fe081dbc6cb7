"""Where the panel writer's and the status publisher's CPU goes, with the panel shown (one emulated view).

The set-up is ``bench_threads.py``'s (fake allocator, CommRecorder serializing every message as the
kernel would, a status comm a front end confirmed). Prints each thread's CPU per second of wall time
(its own thread clock), the writer's services per second and CPU per service (with and without a
curve push), the messages sent per second by the state keys they carry, and with ``--profile`` the
writer's hottest functions (cProfile around ``Panel._service``, which inflates the absolute figures:
read it for shares, not for cost). ``--history 600`` records a full 10-minute window first, so every
line carries as many points as it ever will. The main thread only sleeps: no GIL contention, unlike
``bench_threads.py``, so the figures are each thread's own work.

    python benchmarks/profile_writer.py [--seconds 20] [--history 600] [--history-rate 2] [--profile]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_threads


def _writer_services(panel_class: Any, profiler: cProfile.Profile | None) -> list[tuple[float, bool]]:
    """Wrap ``Panel._service`` to record the CPU of each call and whether it pushed curves (and profile it);
    returns the list it fills."""
    original = panel_class._service
    costs: list[tuple[float, bool]] = []

    def timed(self: Any, force: bool = False) -> float:
        pushes, began = self._stats.curve_pushes, time.thread_time()
        if profiler is not None:
            profiler.enable()
        try:
            return original(self, force)
        finally:
            if profiler is not None:
                profiler.disable()
            costs.append((time.thread_time() - began, self._stats.curve_pushes > pushes))

    panel_class._service = timed
    return costs


def _prefill_monitors(history_s: float, rate_hz: float) -> None:
    """Have bench_threads' monitor start with ``history_s`` of varying samples at ``rate_hz`` (a full window's
    points; 10 Hz is the rate while a measured cell runs, whose window is read from 1 s buckets)."""
    import bench_panel

    make = bench_threads.make_monitor

    def make_prefilled(cuda: bool) -> Any:
        monitor = make(cuda)
        bench_panel._prefill(monitor, history_s, rate_hz)
        return monitor

    bench_threads.make_monitor = make_prefilled


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--settle", type=float, default=2.0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--history", type=float, default=0.0, help="seconds of samples recorded before opening")
    parser.add_argument("--history-rate", type=float, default=2.0, help="samples per second in that history")
    args = parser.parse_args()
    from _harness.traffic import CommRecorder
    from gpumem.panel.widget import Panel

    profiler = cProfile.Profile() if args.profile else None
    costs = _writer_services(Panel, profiler)
    probe = bench_threads.Probe(1.0)
    if args.history:
        _prefill_monitors(args.history, args.history_rate)
    with CommRecorder() as recorder, bench_threads.threads_on(probe, cuda=False, settle_s=args.settle):
        skipped = len(costs)
        before, began = bench_threads.thread_cpu_s(), time.monotonic()
        threading.Event().wait(args.seconds)
        after, wall_s = bench_threads.thread_cpu_s(), time.monotonic() - began
        window = costs[skipped:]
        messages = [m for m in recorder.snapshot() if m.at_s >= began]
    rates = bench_threads.per_second(after, before, wall_s)
    for name in bench_threads.THREAD_NAMES:
        print(f"{name}: {rates.get(name, 0.0) * 1e3:.3f} ms CPU per s")
    for label, pushed in (("with a curve push", True), ("without", False)):
        chosen = [cost for cost, curves in window if curves is pushed]
        if chosen:
            print(
                f"writer services {label}: {len(chosen) / wall_s:.2f} per s, "
                f"{sum(chosen) / len(chosen) * 1e6:.0f} us CPU each (mean)"
            )
    by_keys: collections.Counter[tuple[str, ...]] = collections.Counter()
    sizes: collections.Counter[tuple[str, ...]] = collections.Counter()
    for message in messages:
        key = (message.thread, message.msg_type, *message.keys)
        by_keys[key] += 1
        sizes[key] += message.nbytes
    print(f"messages: {len(messages) / wall_s:.2f} per s, {sum(m.nbytes for m in messages) / wall_s / 1e3:.1f} KB/s")
    for key, count in by_keys.most_common():
        print(f"  {count / wall_s:6.2f}/s {sizes[key] / count:8.0f} B  {' '.join(key)}")
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(45)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
