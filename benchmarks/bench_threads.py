"""What gpumem's background threads take from the user's main thread, and why.

With the panel shown (a view emulated: no browser on the GPU box, so widgets and the status comm
publish into :class:`_harness.traffic.CommRecorder`, which serializes every message as the kernel
would), three threads run at default settings: the sampler (``gpumem-sampler``), the panel writer
(``gpumem-panel-writer``) and the status comm publisher (``gpumem-status``). Measured:

1. Wall ratio: a pure-Python main-thread loop (which needs the GIL all the time, so it loses exactly
   the time the threads hold it) timed with the threads off (A) and on (B), paired in ABBA rounds with
   an A/A control (``benchmarks/_paired.py``).
2. Cause, per thread: CPU seconds per second of wall time, from the kernel's per-thread CPU clock
   (``time.pthread_getcpuclockid``), cross-checked through /proc (``/proc/self/task/<tid>/schedstat``,
   exact; ``.../stat`` ticks, sampled by the scheduler tick, shown but not trusted for short bursts). A method
   check first runs a thread that burns a known 50 ms of CPU per second and one that only sleeps, and
   prints what each method reads for them. Measured in a steady phase after the paired rounds: the
   probe loop runs back to back for ``--steady`` seconds with the panel shown (see ``steady_phase``).
3. GIL held by others, per second: the same loop is a probe, summing every gap between two of its
   iterations longer than ``--gap-us``; the paired A windows' gaps (preemption by other processes) are
   subtracted from the steady phase's.
4. Panel traffic in KB/s (steady phase), and one snapshot's cost (median, p99, warm) on the main thread.

Floors: all threads together <= 0.2% of one core and <= 0.2% GIL time; traffic <= 50 KB/s.

Case ``--case holders``: what the panel's holders view costs while no cell ends and no one looks at it.
One panel is shown (an IPython shell with tensors in its namespace, walked once before timing); A hides
its holders view (out of the panel's children, no walk after cells), B shows it. Paired in ABBA rounds
with the A/A control, the measure being the threads' share of a core during each probe run: the
process's CPU time minus the main thread's, per second of wall (every thread counted, short-lived
walkers included). Goal: the A/B ratio inside the A/A noise.

    python benchmarks/bench_threads.py --out DIR [--budget 60] [--iterations 2000000] [--steady 20]
    python benchmarks/bench_threads.py --case holders --out DIR [--budget 60]
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/_harness: the test-only CommRecorder
import _paired

FLOOR_FRACTION = 0.002
FLOOR_BYTES_PER_S = 50_000
CPU_LABEL = "CPU, 2-core CI-class machine, not the goal machine (fake allocator)"
THREAD_NAMES = ("gpumem-sampler", "gpumem-panel-writer", "gpumem-status")
STEADY_SETTLE_S = 3.0  # past the panel's first pushes, which build what later ones reuse


def proc_stat_ticks_s(stat_text: str, ticks_per_s: int) -> float:
    """utime + stime of a /proc/<pid>/task/<tid>/stat line, in seconds (the scheduler tick's sampling:
    a thread that runs in bursts shorter than a tick, while its core is otherwise idle, is mostly missed)."""
    fields = stat_text.rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    return (int(fields[11]) + int(fields[12])) / ticks_per_s


def proc_schedstat_s(schedstat_text: str) -> float:
    """The first field of /proc/<pid>/task/<tid>/schedstat: the scheduler's exact run time, in nanoseconds."""
    return int(schedstat_text.split(maxsplit=1)[0]) / 1e9


def proc_schedstat_runs(schedstat_text: str) -> float:
    """The third field of the same line: how many times the thread was put on a core (its wake-ups, roughly)."""
    return float(schedstat_text.split()[2])


ThreadKey = tuple[str, int]  # (name, kernel thread id): a thread replaced by a namesake is another thread


def per_second(after: dict[ThreadKey, float], before: dict[ThreadKey, float], wall_s: float) -> dict[str, float]:
    """Per name, the increase per second of wall time of each thread alive at the end (one that started
    in between counts from 0, as its clocks do; one that ended in between is not counted)."""
    rates: dict[str, float] = {}
    for (name, tid), value in after.items():
        rates[name] = rates.get(name, 0.0) + (value - before.get((name, tid), 0.0)) / wall_s
    return rates


def thread_cpu_s(names: tuple[str, ...] = THREAD_NAMES) -> dict[ThreadKey, float]:
    """CPU seconds so far of each live thread named in ``names``, from the kernel's per-thread clocks
    (``pthread_getcpuclockid`` takes the pthread_t, which is ``thread.ident``)."""
    seconds: dict[ThreadKey, float] = {}
    for thread in threading.enumerate():
        if thread.name in names and thread.ident is not None and thread.native_id is not None:
            with contextlib.suppress(OSError, ProcessLookupError):
                clock = time.pthread_getcpuclockid(thread.ident)
                seconds[thread.name, thread.native_id] = time.clock_gettime(clock)
    return seconds


def _proc_task(names: tuple[str, ...], file: str, parse: Any) -> dict[ThreadKey, float]:
    seconds: dict[ThreadKey, float] = {}
    for thread in threading.enumerate():
        if thread.name in names and thread.native_id is not None:  # /proc names the kernel's tid
            with contextlib.suppress(OSError):
                text = Path(f"/proc/self/task/{thread.native_id}/{file}").read_text()
                seconds[thread.name, thread.native_id] = parse(text)
    return seconds


def thread_ticks_s(names: tuple[str, ...] = THREAD_NAMES) -> dict[ThreadKey, float]:
    """The same from /proc/self/task/<tid>/stat (utime + stime, in clock ticks: coarse and sampled)."""
    import os

    ticks_per_s = os.sysconf("SC_CLK_TCK")
    return _proc_task(names, "stat", lambda text: proc_stat_ticks_s(text, ticks_per_s))


def thread_schedstat_s(names: tuple[str, ...] = THREAD_NAMES) -> dict[ThreadKey, float]:
    """The same from /proc/self/task/<tid>/schedstat: exact, read through /proc rather than the clock."""
    return _proc_task(names, "schedstat", proc_schedstat_s)


def thread_runs(names: tuple[str, ...] = THREAD_NAMES) -> dict[ThreadKey, float]:
    """Times each thread was scheduled so far: CPU per run tells a costly read from costly wake-ups."""
    return _proc_task(names, "schedstat", proc_schedstat_runs)


METHOD_CHECK_NAMES = ("gpumem-bench-burner", "gpumem-bench-sleeper")


def _burner(stop: threading.Event, burn_s: float, period_s: float, burned: list[float]) -> None:
    """Burn ``burn_s`` of this thread's own CPU time every ``period_s``, adding what it burned to ``burned``."""
    while not stop.is_set():
        began = time.thread_time()
        while time.thread_time() - began < burn_s:
            pass
        burned[0] += time.thread_time() - began
        stop.wait(max(0.0, period_s - burn_s))


def method_check(burn_ms_per_s: float = 50.0, seconds: float = 3.0) -> dict[str, Any]:
    """Both readings on threads of known cost: one that burns ``burn_ms_per_s`` of CPU per second (in 5 ms
    bursts, every 100 ms) and one that only sleeps (wakes at 10 Hz), while the main thread sleeps; also what
    reading another thread's clock costs."""
    stop, burned = threading.Event(), [0.0]
    period_s = 0.1
    threads = [
        threading.Thread(
            target=_burner, args=(stop, burn_ms_per_s / 1e3 * period_s, period_s, burned), name=METHOD_CHECK_NAMES[0]
        ),
        threading.Thread(target=_burner, args=(stop, 0.0, period_s, [0.0]), name=METHOD_CHECK_NAMES[1]),
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    readers = {"clock": thread_cpu_s, "proc_schedstat": thread_schedstat_s, "proc_ticks": thread_ticks_s}
    before = {method: read(METHOD_CHECK_NAMES) for method, read in readers.items()}
    burned_before, began = burned[0], time.perf_counter()
    time.sleep(seconds)
    wall_s = time.perf_counter() - began
    after = {method: read(METHOD_CHECK_NAMES) for method, read in readers.items()}
    burned_s = burned[0] - burned_before
    read_cost_us = _clock_read_cost_us(threads[0])
    stop.set()
    for thread in threads:
        thread.join()
    measured = {method: per_second(after[method], before[method], wall_s) for method in readers}
    return {
        "burn_ms_per_s": burn_ms_per_s,
        "burner_self_metered_ms_per_s": burned_s / wall_s * 1e3,
        "measured_ms_per_s": {
            method: {name: value * 1e3 for name, value in rates.items()} for method, rates in measured.items()
        },
        "clock_read_other_thread_us": read_cost_us,
    }


def _clock_read_cost_us(thread: threading.Thread, reads: int = 2_000) -> float:
    assert thread.ident is not None
    clock = time.pthread_getcpuclockid(thread.ident)
    began = time.perf_counter()
    for _ in range(reads):
        time.clock_gettime(clock)
    return (time.perf_counter() - began) / reads * 1e6


def method_check_line(check: dict[str, Any]) -> str:
    """``method check: burner 50.0 ms/s measured 49.8 (clock) / 49.8 (proc schedstat) / 50 (proc ticks)``."""
    rates = check["measured_ms_per_s"]
    burner, sleeper = METHOD_CHECK_NAMES
    return (
        f"method check: burner {check['burn_ms_per_s']:.1f} ms/s (self-metered "
        f"{check['burner_self_metered_ms_per_s']:.1f}) measured {rates['clock'].get(burner, 0.0):.1f} (clock) / "
        f"{rates['proc_schedstat'].get(burner, 0.0):.1f} (proc schedstat) / "
        f"{rates['proc_ticks'].get(burner, 0.0):.0f} (proc ticks); sleeper at 10 Hz "
        f"{rates['clock'].get(sleeper, 0.0):.2f} / {rates['proc_schedstat'].get(sleeper, 0.0):.2f} / "
        f"{rates['proc_ticks'].get(sleeper, 0.0):.0f}; reading another thread's clock costs "
        f"{check['clock_read_other_thread_us']:.2f} us"
    )


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
        self.schedstat: dict[str, float] = {}
        self.runs: dict[str, float] = {}
        self.traffic_bytes = 0
        self.recorder: Any = None

    def __call__(self, iterations: int) -> float:
        clock, gap_s, gaps, count = time.perf_counter, self.gap_s, 0.0, 0
        cpu_before, ticks_before, schedstat_before = thread_cpu_s(), thread_ticks_s(), thread_schedstat_s()
        runs_before = thread_runs()
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
            (self.schedstat, thread_schedstat_s(), schedstat_before),
            (self.runs, thread_runs(), runs_before),
        ):
            for name, rate in per_second(after, before, 1.0).items():  # per second of 1 s: the increase itself
                store[name] = store.get(name, 0.0) + rate
        if self.recorder is not None:
            self.traffic_bytes += self.recorder.nbytes() - bytes_before
        self.wall[self.label] += elapsed
        self.gaps[self.label] += gaps
        self.gap_count[self.label] += count
        return elapsed


def make_monitor(cuda: bool) -> Any:
    from gpumem.core.monitoring.monitor import Monitor
    from gpumem.testing import GIB, FakeSource

    if cuda:
        return Monitor()
    source = FakeSource(total_bytes=80 * GIB)
    source.allocate(8 * GIB)
    return Monitor(source)


@contextlib.contextmanager
def threads_on(probe: Probe, cuda: bool, settle_s: float, shell: Any = None, panels: list[Any] | None = None
               ) -> Iterator[None]:  # fmt: skip
    """Sampler + shown panel + a status comm a front end confirmed, as with the panel visible in JupyterLab
    (``shell``: the panel's IPython shell; ``panels`` receives the panel)."""
    from comm.base_comm import CommManager

    from gpumem.core.monitoring.monitor import set_default_monitor
    from gpumem.panel import frontend
    from gpumem.panel.widget import Panel

    monitor = make_monitor(cuda)
    set_default_monitor(monitor)
    manager = CommManager()
    frontend.register_status_target(SimpleNamespace(kernel=SimpleNamespace(comm_manager=manager)))
    message = {"content": {"comm_id": "bench-status", "target_name": frontend.STATUS_TARGET, "data": {}}}
    manager.comm_open(None, None, message)  # the front end opens its own status comm: the publisher starts
    panel = Panel(monitor, shell=shell)
    if panels is not None:
        panels.append(panel)
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
    from gpumem.core.readers.sources import SystemSource

    source = SystemSource()  # without CUDA: the host reading only (what a CPU machine's snapshot is)
    calls: dict[str, Any] = {"whole snapshot" if cuda else "whole snapshot (host only, no CUDA)": source.snapshot}
    if cuda:
        from gpumem.core.readers.sources import TorchAllocatorSource

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
    parser.add_argument("--steady", type=float, default=None, help="seconds of the steady phase (GPU 20, CPU 15)")
    parser.add_argument("--case", choices=("threads", "holders"), default="threads", help="what is paired")
    return parser.parse_args()


def bench_shell(cuda: bool) -> Any:
    """An IPython shell with a few tensors bound (as after some cells), its execution count fixed: no cell ends."""
    import torch
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    device = "cuda" if cuda else "cpu"
    shell.user_ns.update({f"t{i}": torch.ones(1 << 18, device=device) for i in range(8)})
    shell.user_ns["model"] = torch.nn.Linear(256, 256).to(device)
    shell.execution_count = 9
    return shell


@contextlib.contextmanager
def holders_shown(panel: Any, shown: bool) -> Iterator[None]:
    """B: the panel as it is, its holders view shown; A: that view out of the panel and never walked."""
    if shown:
        yield
        return
    children = panel.children
    panel.children = tuple(child for child in children if child is not panel._holders)
    panel._control.after_cells = lambda _visible: False
    try:
        yield
    finally:
        del panel._control.after_cells
        panel.children = children


def threads_share(probe: Probe, shares: dict[bool, list[float]], state: list[bool]) -> Any:
    """The workload: one probe run; returns the other threads' CPU seconds per second of its wall time."""

    def run(iterations: int) -> float:
        process, main = time.process_time(), time.thread_time()
        elapsed = probe(iterations)
        share = max(0.0, (time.process_time() - process) - (time.thread_time() - main)) / elapsed
        shares[state[0]].append(share)
        return share

    return run


def holders_case(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """Threads' share of a core with the holders view shown (B) and hidden (A), paired, with the A/A control."""
    probe = Probe(args.gap_us * 1e-6)
    panels: list[Any] = []
    shares: dict[bool, list[float]] = {False: [], True: []}
    state = [False]

    @contextlib.contextmanager
    def variant(shown: bool) -> Iterator[None]:
        state[0] = shown
        with holders_shown(panels[0], shown):
            yield

    with threads_on(probe, cuda, STEADY_SETTLE_S, shell=bench_shell(cuda), panels=panels):
        panels[0].refresh_holders(wait=True)  # the walk a shown panel makes once: then no cell ends
        walked = panels[0]._holders.model
        result = _paired.paired_ratio(
            lambda: variant(False), lambda: variant(True), threads_share(probe, shares, state),
            size=args.iterations or 10_000_000, budget_s=args.budget or 90.0,
        )  # fmt: skip
    return {
        "benchmark": "threads, holders view shown / hidden",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": CPU_LABEL if not cuda else "cuda",
        "paired": result,
        "threads_share_hidden": statistics.median(shares[False]),
        "threads_share_shown": statistics.median(shares[True]),
        "runs": {"hidden": len(shares[False]), "shown": len(shares[True])},
        "holders_walked": len(walked.rows) if walked is not None else 0,
    }


def holders_main(args: argparse.Namespace, cuda: bool) -> int:
    report = holders_case(args, cuda)
    (args.out / "bench_threads_holders.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        f"### gpumem threads, the holders view shown / hidden ({report['machine']}, {report['date']})",
        "",
        *_paired.MARKDOWN_HEADER,
        _paired.markdown_row("threads' share of a core, holders view shown / hidden", report["paired"]),
        "",
        (
            f"Threads' share of a core (median run): {report['threads_share_shown']:.3%} shown, "
            f"{report['threads_share_hidden']:.3%} hidden; {report['holders_walked']} holders walked once before."
        ),
    ]
    (args.out / "bench_threads_holders.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def steady_phase(recorder: Any, cuda: bool, seconds: float, iterations: int, gap_s: float) -> Probe:
    """The threads' own cost, measured over one long stretch with the panel shown and the probe loop running.

    A paired round's B run starts its window a fixed settle time after the threads start, so a thread
    that wakes every 0.5 s (the sampler's default rate) or every second (the status publisher) can fall
    between the windows every time, and the panel's first pushes fall inside them: per-thread figures
    from those windows are biased both ways. Here the probe runs back to back for ``seconds`` after a
    settle of a few seconds, so every thread is counted over many of its periods.
    """
    probe = Probe(gap_s)
    probe.recorder = recorder
    with threads_on(probe, cuda, STEADY_SETTLE_S):
        began = time.monotonic()
        while time.monotonic() - began < seconds:
            probe(iterations)
    return probe


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
    if args.case == "holders":
        return holders_main(args, cuda)
    budget = args.budget or (60.0 if cuda else 40.0)
    iterations = args.iterations or (4_000_000 if cuda else 2_000_000)
    from _harness.traffic import CommRecorder

    check = method_check()
    print(method_check_line(check))
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
        steady_s = args.steady or (20.0 if cuda else 15.0)
        paired_probe, probe = probe, steady_phase(recorder, cuda, steady_s, iterations, args.gap_us * 1e-6)
    wall_b = probe.wall["B"]
    lost_a = paired_probe.gaps["A"] / paired_probe.wall["A"]
    lost_b = probe.gaps["B"] / wall_b
    per_thread = {name: probe.cpu.get(name, 0.0) / wall_b for name in THREAD_NAMES}
    per_thread_ticks = {name: probe.ticks.get(name, 0.0) / wall_b for name in THREAD_NAMES}
    per_thread_schedstat = {name: probe.schedstat.get(name, 0.0) / wall_b for name in THREAD_NAMES}
    runs_per_s = {name: probe.runs.get(name, 0.0) / wall_b for name in THREAD_NAMES}
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
        "thread_cpu_per_wall_proc_schedstat": per_thread_schedstat,
        "thread_runs_per_s": runs_per_s,
        "method_check": check,
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
        method_check_line(report["method_check"]),
        "",
        (
            "| thread | CPU ms per s of wall (thread clock) | /proc schedstat (exact) | /proc stat ticks (sampled) "
            "| runs per s | CPU per run |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {name} | {report['thread_cpu_per_wall'][name] * 1e3:.3f} | "
        f"{report['thread_cpu_per_wall_proc_schedstat'][name] * 1e3:.3f} | "
        f"{report['thread_cpu_per_wall_proc_ticks'][name] * 1e3:.1f} | {report['thread_runs_per_s'][name]:.1f} | "
        f"{_per_run_us(report['thread_cpu_per_wall'][name], report['thread_runs_per_s'][name])} |"
        for name in THREAD_NAMES
    ]
    gaps = report["probe_gap_fraction"]
    total = report["threads_cpu_fraction_of_one_core"]
    verdict, empty = met[report["met"]["cpu"]], "| | | | |"
    lines += [
        f"| all together | {total * 1e3:.3f} ({total:.3%} of one core; floor 0.2%: {verdict}) {empty}",
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


def _per_run_us(cpu_per_s: float, runs_per_s: float) -> str:
    return f"{cpu_per_s / runs_per_s * 1e6:.0f} us" if runs_per_s else "n/a"


if __name__ == "__main__":
    sys.exit(main())
