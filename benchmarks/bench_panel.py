"""What the live panel costs: bytes sent to the browser, messages, pushes, and the writer thread's CPU.

Each scenario opens a panel on a monitor sampling at the default rate (1 Hz), reports a view as the front
end would, and lets the real writer thread run for ``--seconds``. Every comm message is recorded
and sized as the kernel serializes it (Jupyter envelope included). A full window of history is
recorded first, so every line carries as many points as it ever will. Without ``--gpu`` the source
is gpumem's fake allocator, with one allocation that changes every sample; with ``--gpu`` a real
training loop runs on cuda:0 and its step time is compared with and without a shown panel.

    python benchmarks/bench_panel.py --out DIR [--seconds 20] [--gpu]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from gpumem.core.monitoring.monitor import Monitor
from gpumem.core.sampling.sampler import DEFAULT_RATE_HZ
from gpumem.panel.widget import Panel, close_all
from gpumem.testing import GIB, MIB, FakeSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/_harness: the test-only CommRecorder
from _harness.traffic import CommRecorder

BUDGET_BYTES_PER_S = 50_000


def _thread_cpu_s(name: str) -> float:
    """CPU seconds used so far by the live thread called ``name`` (0 when it is not running).

    Read from the thread's own CPU clock (nanoseconds) where there is one: the kernel's per-thread
    counters that psutil reads tick every 10 ms, which over a few seconds is as coarse as the budget.
    """
    threads = [t for t in threading.enumerate() if t.name == name and t.is_alive()]
    if hasattr(time, "pthread_getcpuclockid"):
        return sum(time.clock_gettime(time.pthread_getcpuclockid(t.ident)) for t in threads if t.ident is not None)
    ids = {t.native_id for t in threads}
    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id in ids)


def _prefill(monitor: Monitor, seconds: float, rate_hz: float = DEFAULT_RATE_HZ) -> None:
    """Record ``seconds`` of history at ``rate_hz`` (the sampler's), as if the panel had been open that long."""
    now = time.monotonic()
    count = int(seconds * rate_hz)
    snapshot = monitor.source.snapshot()
    for i in range(count):
        values: dict[str, float] = {}
        wobble = float((i * 7919) % 997) * MIB
        for reading in snapshot.allocator:
            values[f"cuda:{reading.device}/allocated"] = reading.allocated_bytes + wobble
            values[f"cuda:{reading.device}/reserved"] = reading.reserved_bytes + 2 * wobble
        for device in snapshot.devices:
            values[f"cuda:{device.device}/used"] = device.used_bytes + 2 * wobble
        if snapshot.host is not None:
            values["host/rss"] = snapshot.host.rss_bytes + wobble
        monitor.timeline.append(now - (count - i) / rate_hz, values)


def _fake_driver(source: FakeSource, devices: int, stop: threading.Event) -> None:
    """Allocations that change at every sample, like a training loop's."""
    handles: list[tuple[int, int]] = []
    step = 0
    while not stop.is_set():
        step += 1
        handles.extend((source.allocate((step % 13 + 1) * 64 * MIB, device), device) for device in range(devices))
        while len(handles) > 6 * devices:
            handle, device = handles.pop(0)
            source.free(handle, device)
        stop.wait(0.05)


def measure(
    name: str,
    monitor: Monitor,
    seconds: float,
    *,
    view: bool = True,
    history_s: float = 600,
    drive: Callable[[threading.Event], None] | None = None,
    **panel_options: Any,
) -> dict[str, Any]:
    _prefill(monitor, history_s)
    stop = threading.Event()
    driver = threading.Thread(target=drive, args=(stop,), daemon=True) if drive is not None else None
    with CommRecorder() as recorder:
        panel = Panel(monitor, **panel_options)
        panel._repr_mimebundle_()  # displayed: the sampler starts
        panel.set_state({"_view_count": 1})  # the front end reports a view
        if not view:
            panel.set_state({"_view_count": 0})  # ... and its removal (output cleared, tab closed)
        if driver is not None:
            driver.start()
        time.sleep(2.0)  # first pushes, caches warm
        began = time.monotonic()
        cpu_before = _thread_cpu_s("gpumem-panel-writer")
        pushes_before = panel.stats().curve_pushes
        time.sleep(seconds)
        elapsed = time.monotonic() - began
        cpu = _thread_cpu_s("gpumem-panel-writer") - cpu_before
        messages = [m for m in recorder.snapshot() if began <= m.at_s <= began + elapsed]
        stats = panel.stats()
        pushes = stats.curve_pushes - pushes_before
        stop.set()
        if driver is not None:
            driver.join()
        panel.close()
    monitor.stop()
    sent = sum(m.nbytes for m in messages)
    return {
        "scenario": name,
        "seconds": round(elapsed, 2),
        "bytes_per_s": round(sent / elapsed),
        "messages_per_s": round(len(messages) / elapsed, 2),
        "curve_pushes_per_s": round(pushes / elapsed, 2),
        "points_per_line": stats.points_per_line,
        "lines": stats.curves,
        "largest_message_bytes": max((m.nbytes for m in messages), default=0),
        "writer_cpu_ms_per_s": round(1000 * cpu / elapsed, 2),
        "within_50_kb_s": sent / elapsed <= BUDGET_BYTES_PER_S,
    }


def fake_scenarios(seconds: float) -> list[dict[str, Any]]:
    results = []

    def one(devices: int, name: str, view: bool = True, history_s: float = 600, **options: Any) -> None:
        source = FakeSource(devices=devices, total_bytes=80 * GIB)
        for device in range(devices):
            source.allocate(8 * GIB, device)
        monitor = Monitor(source)
        drive = lambda stop: _fake_driver(source, devices, stop)  # noqa: E731
        results.append(measure(name, monitor, seconds, view=view, history_s=history_s, drive=drive, **options))

    one(1, "default settings (10 min window, 1 GPU)")
    one(1, "1 min window, 1 GPU, host RSS shown", window="1min", host=True, history_s=60)
    one(1, "1 h window, 1 GPU", window="1h", history_s=3600)
    one(8, "8 GPUs, all devices, 10 min window")
    one(1, "no view shown (output cleared / tab closed)", view=False)
    return results


def _steps_per_s(
    view: bool | None, seconds: float, train: Callable[[threading.Event], None], count: Callable[[], int]
) -> float:
    """Training steps per second: no panel (None), a panel not shown (False), a shown one (True)."""
    monitor = Monitor()
    panel = None
    if view is not None:
        panel = Panel(monitor, window="10min")
        panel._repr_mimebundle_()
        panel.set_state({"_view_count": 1})
        if not view:
            panel.set_state({"_view_count": 0})
    else:
        monitor.start()
    stop = threading.Event()
    worker = threading.Thread(target=train, args=(stop,))
    began = time.perf_counter()
    worker.start()
    time.sleep(seconds)
    stop.set()
    worker.join()
    result = count() / (time.perf_counter() - began)
    if panel is not None:
        panel.close()
    monitor.stop()
    return result


def gpu_scenarios(seconds: float) -> list[dict[str, Any]]:
    import torch

    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).to("cuda:0")
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(256, 1024, device="cuda:0")
    steps = {"count": 0}

    def train(stop: threading.Event) -> None:
        while not stop.is_set():
            loss = model(batch).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps["count"] += 1
        torch.cuda.synchronize(0)

    def rate(view: bool | None) -> float:
        steps["count"] = 0
        return _steps_per_s(view, seconds / 2, train, lambda: steps["count"])

    with CommRecorder():
        rates = {"sampler only": [], "panel not shown": [], "panel shown": []}
        for _ in range(3):
            rates["sampler only"].append(rate(None))
            rates["panel not shown"].append(rate(False))
            rates["panel shown"].append(rate(True))
    best = {name: max(values) for name, values in rates.items()}
    results = [
        {
            "scenario": f"training steps/s on cuda:0, {name} (best of 3)",
            "steps_per_s": round(value, 1),
            "slowdown_vs_sampler_only": round(best["sampler only"] / value, 4) if value else math.nan,
        }
        for name, value in best.items()
    ]
    results.append(measure("real GPU, default settings, training loop", Monitor(), seconds, drive=train))
    close_all()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path())
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--gpu", action="store_true", help="also measure on cuda:0 with a training loop")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = fake_scenarios(args.seconds)
    if args.gpu:
        results += gpu_scenarios(args.seconds)
    report = {
        "benchmark": "panel",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "sampler_rate_hz": DEFAULT_RATE_HZ,
        "budget_bytes_per_s": BUDGET_BYTES_PER_S,
        "results": results,
    }
    (args.out / "bench_panel.json").write_text(json.dumps(report, indent=2))
    lines = [
        "### Live panel: browser traffic and writer cost",
        "",
        (
            f"Sampler at {DEFAULT_RATE_HZ:g} Hz, a full window of history, a view reported by the front end; "
            "bytes are comm messages as the kernel serializes them (Jupyter envelope included)."
        ),
        "",
        "| scenario | KB/s | messages/s | curve pushes/s | points/line | lines | writer CPU ms/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines.extend(
        f"| {r['scenario']} | {r['bytes_per_s'] / 1000:.1f} | {r['messages_per_s']:.1f} | "
        f"{r['curve_pushes_per_s']:.2f} | {r['points_per_line']} | {r['lines']} | "
        f"{r['writer_cpu_ms_per_s']:.1f} |"
        for r in results
        if "bytes_per_s" in r
    )
    steps = [r for r in results if "steps_per_s" in r]
    if steps:
        lines += ["", "| training loop on cuda:0 | steps/s | slowdown |", "| --- | ---: | ---: |"]
        lines += [f"| {r['scenario']} | {r['steps_per_s']:.1f} | {r['slowdown_vs_sampler_only']:.3f}x |" for r in steps]
    (args.out / "bench_panel.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
