"""One panel push, counted in Python calls, and what the pushes of a fixed scenario send, as one digest.

The panel's writer costs, next to a busy main thread, about what the Python code and objects one push
touches cost with cold caches (a warm tight loop sends the same curve message 5-7 times cheaper), so
the calls a push makes are the figure to cut; unlike CPU time on a shared machine they are exact and
repeat. The digest covers every message of a deterministic scenario (marks, the host box, full scale,
windows, a new allocation, Reset peak), buffers included: a change meant to make a push cheaper must
leave it as it was. The clock is the scenario's own and the writer thread is left out: pushes are
made by hand, as the writer would make them.

    python benchmarks/probe_push.py [--devices 8] [--pushes 60] [--list]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/_harness: the test-only CommRecorder

T0_S = 1000.0
HISTORY_S = 600.0
HISTORY_RATE_HZ = 2.0


def _values(step: int, devices: int) -> dict[str, float]:
    from gpumem.testing import GIB, MIB

    out: dict[str, float] = {}
    wobble = 0.0
    for device in range(devices):
        wobble = float((step * 7919 + device * 13) % 997) * MIB
        out[f"cuda:{device}/allocated"] = 8 * GIB + wobble
        out[f"cuda:{device}/reserved"] = 9 * GIB + 2 * wobble
        out[f"cuda:{device}/used"] = 10 * GIB + 2 * wobble
    out["host/rss"] = 3 * GIB + wobble
    return out


class _Wire:
    """Every message, as a digest of its data and buffers (comm ids and buffer order made canonical)."""

    def __init__(self) -> None:
        self.digests: list[str] = []
        self._ids: dict[str, int] = {}

    def record(self, comm_id: str, msg_type: str, data: dict[str, Any], buffers: Sequence[Any]) -> None:
        number = self._ids.setdefault(comm_id, len(self._ids))
        paths = [repr(path) for path in data.get("buffer_paths") or []]
        pairs = sorted(zip(paths, (bytes(memoryview(b)) for b in buffers), strict=True))
        content = {key: value for key, value in data.items() if key != "buffer_paths"}
        text = json.dumps(content, sort_keys=True, default=str) + repr([path for path, _ in pairs])
        text = re.sub(r"IPY_MODEL_([0-9a-f]+)", lambda m: f"M{self._ids.setdefault(m.group(1), len(self._ids))}", text)
        blob = text.encode() + b"".join(buffer for _, buffer in pairs)
        self.digests.append(f"{number} {msg_type} {hashlib.sha1(blob).hexdigest()[:12]}")


def _calls(function: Callable[[], object]) -> int:
    count = 0

    def profile(_frame: Any, event: str, _arg: Any) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        function()
    finally:
        sys.setprofile(None)
    return count


def run(devices: int, pushes: int) -> tuple[list[int], list[int], list[str]]:
    """Header and curve calls per push, and the scenario's message digests."""
    from _harness.traffic import CommRecorder
    from gpumem.core.monitoring.monitor import Monitor
    from gpumem.panel import commands, widget
    from gpumem.panel.writer import shared_writer
    from gpumem.testing import GIB, MIB, FakeSource

    clock = {"now": T0_S}
    fixed = types.SimpleNamespace(monotonic=lambda: clock["now"], time=lambda: clock["now"] + 1.7e9)
    widget.time = fixed  # type: ignore[assignment]
    sys.modules["gpumem.testing"].time = fixed  # type: ignore[attr-defined]
    wire = _Wire()
    header_calls: list[int] = []
    curve_calls: list[int] = []
    CommRecorder._record = lambda _self, comm_id, msg_type, data, _meta, buffers, _keys: wire.record(  # type: ignore[method-assign]
        comm_id, msg_type, data, buffers
    )
    with CommRecorder():
        source = FakeSource(devices=devices, total_bytes=80 * GIB, context_bytes=500 * MIB)
        monitor = Monitor(source)
        count = int(HISTORY_S * HISTORY_RATE_HZ)
        for i in range(count):
            monitor.timeline.append(T0_S - (count - i) / HISTORY_RATE_HZ, _values(i, devices))
        panel = widget.Panel(monitor, autostart=False)
        shared_writer.remove(panel._service)  # pushed by hand, on this clock

        def step() -> None:
            clock["now"] += 1.0 / HISTORY_RATE_HZ
            monitor.timeline.append(clock["now"], _values(int(clock["now"] * 2), devices))
            panel._on_sample(monitor.snapshot())
            header_calls.append(_calls(panel._push_header))
            curve_calls.append(_calls(lambda: panel._push_curves(clock["now"])))

        def control(apply: Callable[[], object]) -> None:
            apply()
            panel._service(force=True)
            step()

        for _ in range(pushes):
            step()
        monitor.timeline.add_mark(clock["now"] - 5, "12")
        step()
        control(lambda: setattr(panel._host, "value", True))
        control(lambda: setattr(panel._full_scale, "value", True))
        control(lambda: setattr(panel._window, "value", panel._window.options[0]))
        control(lambda: setattr(panel._window, "value", panel._window.options[-1]))
        source.allocate(20 * GIB, devices - 1)
        step()
        control(lambda: panel._post(commands.ResetPeak()))
        control(lambda: setattr(panel._host, "value", False))
        panel.close()
        monitor.stop()
    return header_calls[3:pushes], curve_calls[3:pushes], wire.digests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--pushes", type=int, default=60, help="steady pushes before the scenario's changes")
    parser.add_argument("--list", action="store_true", help="print every message's digest")
    args = parser.parse_args()
    header, curves, digests = run(args.devices, args.pushes)
    print(f"{args.devices} device(s), 10-minute window full:")
    print(f"  Python calls per header push: median {statistics.median(header):.0f}")
    print(f"  Python calls per curve push:  median {statistics.median(curves):.0f}")
    whole = hashlib.sha1("\n".join(digests).encode()).hexdigest()
    print(f"  wire: {len(digests)} messages, digest {whole}")
    if args.list:
        print("\n".join(digests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
