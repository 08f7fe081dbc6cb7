"""What the timeline costs: one sample appended, and one window read as the live panel reads it.

1. ``append``: microseconds per sample in steady state (buckets closing as they do at 10 Hz), for 4
   channels (one GPU: allocated, reserved, device used, host RSS) and 25 (eight GPUs and the host).
2. ``window``: milliseconds per read of the last 10 minutes, the last hour and the whole day from a
   timeline holding a full day at 10 Hz, decimated to 1,000 points per line, for 4, 7 and 25 channels:
   ``window()`` of every channel (lists), and ``window_arrays()`` of only the lines the panel draws
   (allocated, reserved and device used for one GPU; allocated and reserved per device for several),
   which is the panel's read.

Each figure is the median of several rounds after a warm-up, in CPU time of the measuring thread (what
the budget for gpumem's threads counts; it leaves out time spent waiting on a busy machine). Reads run
on a worker thread, as the panel's writer does. No device is read.

    python benchmarks/bench_timeline.py --out DIR [--rounds 7]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpumem.core.sampling.timeline import Timeline

RATE_HZ = 10.0
DAY_S = 24 * 3600
MAX_POINTS = 1_000
WINDOWS = {"10 min": 600.0, "1 h": 3_600.0, "whole day": math.inf}


def channel_names(devices: int) -> list[str]:
    """The sampler's channels for ``devices`` GPUs: allocated, reserved and used per device, host RSS."""
    names = [f"cuda:{device}/{kind}" for device in range(devices) for kind in ("allocated", "reserved", "used")]
    return [*names, "host/rss"]


def drawn(names: list[str]) -> list[str]:
    """The lines the panel draws: every device line for one GPU, allocated and reserved for several."""
    devices = {name.split("/")[0] for name in names if name.startswith("cuda:")}
    if len(devices) == 1:
        return [name for name in names if name != "host/rss"]
    return [name for name in names if name.endswith(("/allocated", "/reserved"))]


def _rows(names: list[str], count: int = 997) -> list[dict[str, float]]:
    return [{name: float((i * 7919 + k * 31) % 997) * 2**20 for k, name in enumerate(names)} for i in range(count)]


def _median_s(call: Callable[[], object], rounds: int, repeat: int) -> float:
    call()
    times = []
    for _ in range(rounds):
        began = time.thread_time()
        for _ in range(repeat):
            call()
        times.append((time.thread_time() - began) / repeat)
    return statistics.median(times)


def append_us(names: list[str], rounds: int, samples: int = 20_000) -> float:
    """Per sample, over runs that cross many bucket edges of every level."""
    rows = _rows(names)
    timeline = Timeline()
    state = {"i": 0}

    def run() -> None:
        i = state["i"]
        append = timeline.append
        for j in range(i, i + samples):
            append(j / RATE_HZ, rows[j % len(rows)])
        state["i"] = i + samples

    return _median_s(run, rounds, 1) / samples * 1e6


def full_day(names: list[str]) -> Timeline:
    rows = _rows(names)
    timeline = Timeline()
    for i in range(int(DAY_S * RATE_HZ)):
        timeline.append(i / RATE_HZ, rows[i % len(rows)])
    return timeline


def window_ms(timeline: Timeline, span_s: float, rounds: int, drawn_lines: list[str] | None = None) -> float:
    """``window()`` of every channel, or (given the lines) ``window_arrays()`` of those lines."""
    latest = timeline.latest()
    assert latest is not None
    end = latest[0]
    if drawn_lines is None:
        return _median_s(lambda: timeline.window(end - span_s, end, MAX_POINTS), rounds, 5) * 1e3
    return _median_s(lambda: timeline.window_arrays(end - span_s, end, MAX_POINTS, drawn_lines), rounds, 5) * 1e3


def window_rows(rounds: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for devices in (1, 2, 8):
        names = channel_names(devices)
        timeline = full_day(names)
        for label, span_s in WINDOWS.items():
            rows.append(
                {
                    "channels": len(names),
                    "window": label,
                    "all_channels_ms": round(window_ms(timeline, span_s, rounds), 3),
                    "drawn_lines": len(drawn(names)),
                    "drawn_lines_ms": round(window_ms(timeline, span_s, rounds, drawn(names)), 3),
                }
            )
    return rows


def _on_a_worker_thread(work: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    result: list[list[dict[str, Any]]] = []
    worker = threading.Thread(target=lambda: result.append(work()), name="bench-timeline-reader")
    worker.start()
    worker.join()
    return result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path())
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    appends = {count: append_us(channel_names(devices), args.rounds) for count, devices in ((4, 1), (25, 8))}
    windows = _on_a_worker_thread(lambda: window_rows(args.rounds))
    report = {
        "benchmark": "timeline",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "rate_hz": RATE_HZ,
        "max_points": MAX_POINTS,
        "append_us": {str(count): round(us, 3) for count, us in appends.items()},
        "windows": windows,
    }
    (args.out / "bench_timeline.json").write_text(json.dumps(report, indent=2))
    lines = [
        "### Timeline: append and window cost",
        "",
        " ".join(f"append, {count} channels: {us:.2f} us per sample." for count, us in appends.items()),
        "",
        f"Window reads from a full day at {RATE_HZ:g} Hz, {MAX_POINTS} points per line:",
        "",
        "| channels | window | window(), every channel: ms | lines drawn | window_arrays(), those lines: ms |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {w['channels']} | {w['window']} | {w['all_channels_ms']:.2f} | "
        f"{w['drawn_lines']} | {w['drawn_lines_ms']:.2f} |"
        for w in windows
    ]
    (args.out / "bench_timeline.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
