"""What gpumem's background threads take from the user's main thread, and why.

With the panel shown (a view emulated: no browser on the GPU box, so widgets and the status comm
publish into :class:`gpumem.panel.traffic.CommRecorder`, which serializes every message as the kernel
would), three threads run at default settings: the sampler (``gpumem-sampler``), the panel writer
(``gpumem-panel-writer``) and the status comm publisher (``gpumem-status``). Measured:

1. Wall ratio: a pure-Python main-thread loop (which needs the GIL all the time, so it loses exactly
   the time the threads hold it) timed with the threads off (A) and on (B), paired in ABBA rounds with
   an A/A control (``benchmarks/_paired.py``).
2. Cause, per thread: CPU seconds per second of wall time, from the kernel's per-thread CPU clock
   (``time.pthread_getcpuclockid``; ``/proc/self/task/<tid>/stat`` ticks as a cross-check).
3. GIL held by others, per second: the same loop is a probe, summing every gap between two of its
   iterations longer than ``--gap-us``; the A windows' gaps (preemption by other processes) are
   subtracted from the B windows'.
4. Panel traffic in KB/s, and one snapshot's cost (median, p99, warm) read on the main thread.

Floors: all threads together <= 0.2% of one core and <= 0.2% GIL time; traffic <= 50 KB/s.

    python benchmarks/bench_threads.py --out DIR [--budget 60] [--iterations 2000000]
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
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _paired

FLOOR_FRACTION = 0.002
FLOOR_BYTES_PER_S = 50_000
CPU_LABEL = "CPU, 2-core CI-class machine, not the goal machine (fake allocator)"
THREAD_NAMES = ("gpumem-sampler", "gpumem-panel-writer", "gpumem-status")


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds so far of each live gpumem thread, by name, from the kernel's per-thread clocks."""
    seconds: dict[str, float] = {}
    for thread in threading.enumerate():
        if thread.name in THREAD_NAMES and thread.ident is not None:
            with contextlib.suppress(OSError, ProcessLookupError):
                clock = time.pthread_getcpuclockid(thread.ident)
                seconds[thread.name] = seconds.get(thread.name, 0.0) + time.clock_gettime(clock)
    return seconds


def thread_ticks_s() -> dict[str, float]:
    """The same from /proc/self/task/<tid>/stat (utime + stime, in clock ticks: coarse, a cross-check)."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    seconds: dict[str, float] = {}
    for thread in threading.enumerate():
        if thread.name in THREAD_NAMES and thread.native_id is not None:
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
                seconds[thread.name] = seconds.get(thread.name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return seconds


class Probe:
    """The main-thread workload: a tight loop that notes every gap between iterations above ``gap_s``."""

    def __init__(self, gap_s: float) -> None:
        self.gap_s = gap_s
        self.label = "A"
        self.wall: dict[str, float] = {"A": 0.0, "B": 0.0}
        self.gaps: dict[str, float] = {"A": 0.0, "B": 0.0}
        self.gap_count: dict[str, int] = {"A": 0, "B": 0}
        self.cpu: dict[str, float] = {}
        self.ticks: dict[str, float] = {}
        self.traffic_bytes = 0
        self.recorder: Any = None

    def __call__(self, iterations: int) -> float:
        clock, gap_s, gaps, count = time.perf_counter, self.gap_s, 0.0, 0
        cpu_before, ticks_before = thread_cpu_s(), thread_ticks_s()
        bytes_before = self.recorder.nbytes() if self.recorder is not None else 0
        began = previous = clock()
        for _ in range(iterations):
            now = clock()
            if now - previous > gap_s:
                gaps += now - previous
                count += 1
            previous = now
        elapsed = previous - began
        for store, after, before in (
            (self.cpu, thread_cpu_s(), cpu_before),
            (self.ticks, thread_ticks_s(), ticks_before),
        ):
            for name, value in after.items():
                store[name] = store.get(name, 0.0) + value - before.get(name, 0.0)
        if self.recorder is not None:
            self.traffic_bytes += self.recorder.nbytes() - bytes_before
        self.wall[self.label] += elapsed
        self.gaps[self.label] += gaps
        self.gap_count[self.label] += count
        return elapsed


def make_monitor(cuda: bool) -> Any:
    from gpumem.core.monitor import Monitor
    from gpumem.testing import GIB, FakeSource

    if cuda:
        return Monitor()
    source = FakeSource(total_bytes=80 * GIB)
    source.allocate(8 * GIB)
    return Monitor(source)


@contextlib.contextmanager
def threads_on(probe: Probe, cuda: bool, settle_s: float) -> Iterator[None]:
    """Sampler + shown panel + a status comm a front end confirmed, as with the panel visible in JupyterLab."""
    from comm.base_comm import CommManager

    from gpumem.core.monitor import set_default_monitor
    from gpumem.panel import frontend
    from gpumem.panel.widget import Panel

    monitor = make_monitor(cuda)
    set_default_monitor(monitor)
    manager = CommManager()
    frontend.register_status_target(SimpleNamespace(kernel=SimpleNamespace(comm_manager=manager)))
    message = {"content": {"comm_id": "bench-status", "target_name": frontend.STATUS_TARGET, "data": {}}}
    manager.comm_open(None, None, message)  # the front end opens its own status comm: the publisher starts
    panel = Panel(monitor)
    panel._repr_mimebundle_()  # displayed: the sampler starts
    panel.set_state({"_view_count": 1})  # the front end reports a view
    time.sleep(settle_s)  # first full pushes done: what is timed is the steady state
    probe.label = "B"
    try:
        yield
    finally:
        probe.label = "A"
        panel.close()
        frontend.unregister_status_target()
        monitor.stop()


@contextlib.contextmanager
def threads_off(settle_s: float) -> Iterator[None]:
    """The baseline waits as long before its run: after a sleep the scheduler favours a process for a
    while, which would otherwise make only the runs with threads look faster on a busy machine."""
    time.sleep(settle_s)
    yield


def snapshot_cost_us(cuda: bool, reads: int = 2_000) -> dict[str, dict[str, float]]:
    """One snapshot, and one allocator read of device 0, timed call by call on a warm source."""
    from gpumem.core.sources import SystemSource

    source = SystemSource()  # without CUDA: the host reading only (what a CPU machine's snapshot is)
    calls: dict[str, Any] = {"whole snapshot" if cuda else "whole snapshot (host only, no CUDA)": source.snapshot}
    if cuda:
        from gpumem.core.sources import TorchAllocatorSource

        allocator = TorchAllocatorSource()
        calls["allocator read, one device"] = lambda: allocator.read(0)
        # What automatic mode reads at every cell's end: the device split by process (NVML).
        calls["whole snapshot with process memory (cell end)"] = lambda: source.snapshot(process_memory=True)
    costs = {}
    for name, call in calls.items():
        for _ in range(200):
            call()
        times = []
        for _ in range(reads):
            began = time.perf_counter()
            call()
            times.append((time.perf_counter() - began) * 1e6)
        times.sort()
        costs[name] = {"median_us": statistics.median(times), "p99_us": times[int(0.99 * len(times))]}
    return costs


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path())
    parser.add_argument("--budget", type=float, default=None, help="seconds for the paired rounds (GPU 60, CPU 40)")
    parser.add_argument("--iterations", type=int, default=None, help="probe iterations per run (~0.2 us each)")
    parser.add_argument("--gap-us", type=float, default=2.0, help="a probe gap longer than this is time lost")
    parser.add_argument("--settle", type=float, default=0.5, help="seconds after the threads start, untimed")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if cuda:
        torch.zeros(1, device="cuda")
    budget = args.budget or (60.0 if cuda else 40.0)
    iterations = args.iterations or (4_000_000 if cuda else 2_000_000)
    from gpumem.panel.traffic import CommRecorder

    probe = Probe(args.gap_us * 1e-6)
    with CommRecorder() as recorder:
        probe.recorder = recorder
        result = _paired.paired_ratio(
            lambda: threads_off(args.settle),
            lambda: threads_on(probe, cuda, args.settle),
            probe,
            size=iterations,
            budget_s=budget,
        )
    wall_b = probe.wall["B"]
    lost_a = probe.gaps["A"] / probe.wall["A"]
    lost_b = probe.gaps["B"] / wall_b
    per_thread = {name: probe.cpu.get(name, 0.0) / wall_b for name in THREAD_NAMES}
    per_thread_ticks = {name: probe.ticks.get(name, 0.0) / wall_b for name in THREAD_NAMES}
    total_cpu = sum(per_thread.values())
    gil = lost_b - lost_a
    traffic = probe.traffic_bytes / wall_b
    report = {
        "benchmark": "threads",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": torch.cuda.get_device_name(0) if cuda else CPU_LABEL,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "paired": result,
        "thread_cpu_per_wall": per_thread,
        "thread_cpu_per_wall_proc_ticks": per_thread_ticks,
        "threads_cpu_fraction_of_one_core": total_cpu,
        "probe_gap_fraction": {"A": lost_a, "B": lost_b},
        "probe_gaps": {"A": probe.gap_count["A"], "B": probe.gap_count["B"]},
        "gil_held_by_others_fraction": gil,
        "traffic_bytes_per_s": traffic,
        "snapshot_cost_us": snapshot_cost_us(cuda),
        "floors": {"cpu_fraction": FLOOR_FRACTION, "gil_fraction": FLOOR_FRACTION, "bytes_per_s": FLOOR_BYTES_PER_S},
        "met": {
            "cpu": total_cpu <= FLOOR_FRACTION,
            "gil": gil <= FLOOR_FRACTION,
            "traffic": traffic <= FLOOR_BYTES_PER_S,
        },
    }
    (args.out / "bench_threads.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = markdown(report)
    (args.out / "bench_threads.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def markdown(report: dict[str, Any]) -> list[str]:
    met = {True: "met", False: "MISSED"}
    lines = [
        f"### gpumem threads with the panel shown ({report['machine']}, {report['date']})",
        "",
        (
            "View emulated with CommRecorder (no browser): every widget and status message is serialized as the "
            "kernel would."
        ),
        "",
        *_paired.MARKDOWN_HEADER,
        _paired.markdown_row("main-thread Python loop, threads on / off", report["paired"]),
        "",
        "| thread | CPU ms per s of wall (thread clock) | same from /proc ticks (10 ms resolution) |",
        "| --- | ---: | ---: |",
    ]
    lines += [
        f"| {name} | {report['thread_cpu_per_wall'][name] * 1e3:.3f} | "
        f"{report['thread_cpu_per_wall_proc_ticks'][name] * 1e3:.1f} |"
        for name in THREAD_NAMES
    ]
    gaps = report["probe_gap_fraction"]
    total = report["threads_cpu_fraction_of_one_core"]
    lines += [
        f"| all together | {total * 1e3:.3f} ({total:.3%} of one core; floor 0.2%: {met[report['met']['cpu']]}) | |",
        "",
        (
            f"GIL held by others (probe gaps, threads on minus off): {report['gil_held_by_others_fraction']:.3%} "
            f"of wall time ({gaps['B']:.3%} on, {gaps['A']:.3%} off; floor 0.2%: {met[report['met']['gil']]})."
        ),
        (
            f"Panel + status traffic: {report['traffic_bytes_per_s'] / 1000:.1f} KB/s "
            f"(floor 50 KB/s: {met[report['met']['traffic']]})."
        ),
        "",
        "| one read, warm | median us | p99 us |",
        "| --- | ---: | ---: |",
    ]
    lines += [
        f"| {name} | {cost['median_us']:.1f} | {cost['p99_us']:.1f} |"
        for name, cost in report["snapshot_cost_us"].items()
    ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
