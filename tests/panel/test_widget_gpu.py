"""The live panel on a real CUDA GPU: its curve follows a training loop while the loop runs, and Free
returns cached memory (also when clicked in the middle of the loop).

Each test runs in a child interpreter, so the test process never initializes CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

SRC = str(Path(__file__).resolve().parents[2] / "src")
TESTS = str(Path(__file__).resolve().parents[1])  # the scripts' _harness (the test-only CommRecorder)
MIB = 1 << 20


def _run(script: str, timeout: float = 300) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC, TESTS, env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True, text=True, timeout=timeout, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


_TRAINING = """
import json, threading, time
import torch
from gpumem.panel.widget import Panel, close_all
from _harness.traffic import CommRecorder
from gpumem.core.monitoring.monitor import Monitor

MIB = 1 << 20
with CommRecorder() as recorder:
    monitor = Monitor(rate_hz=20)
    panel = Panel(monitor, window="1min")
    panel.set_state({"_view_count": 1})  # the front end reports a view: sampling and pushing start
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048)).to("cuda:0")
    optimizer = torch.optim.Adam(model.parameters())
    keep = []
    pushed = []  # (step, allocated curve's last value in bytes, torch's allocated at that moment)
    clicked_at = None
    loop_began = time.monotonic()
    for step in range(60):
        x = torch.randn(4096, 2048, device="cuda:0")
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        keep.append(torch.empty(64 * MIB, dtype=torch.uint8, device="cuda:0"))
        torch.cuda.synchronize(0)
        if step == 30:  # the Free button, clicked from another thread while the loop runs
            clicked_at = time.monotonic()
            threading.Thread(target=panel._free_button.click, name="comm-thread").start()
        time.sleep(0.08)
        frame = panel._last_frame  # the writer's latest push: curves and their unit, consistent
        if frame is not None and frame.points_per_line and frame.curves[0].channel == "cuda:0/allocated":
            pushed.append((step, float(frame.y[0, -1]) * frame.unit_bytes, torch.cuda.memory_allocated(0)))
    loop_ended = time.monotonic()
    deadline = time.monotonic() + 30
    while panel._last_free is None and time.monotonic() < deadline:
        time.sleep(0.05)
    mid_loop_free = panel._last_free
    free_updates = [m for m in recorder.updates() if m.at_s >= (clicked_at or 0)]

    allocated_before_del = torch.cuda.memory_allocated(0)
    del keep
    torch.cuda.synchronize(0)
    reserved_before = torch.cuda.memory_reserved(0)
    outcome = panel.free()
    reserved_after = torch.cuda.memory_reserved(0)
    time.sleep(0.3)
    panel.refresh()
    message = panel._message.value
    header = panel._header.value
    stats = panel.stats()
    close_all()
    monitor.stop()
    device = outcome.result.devices[0]
    print(json.dumps({
        "pushed": pushed,
        "loop_s": loop_ended - loop_began,
        "mid_loop_free_error": mid_loop_free.error if mid_loop_free else "no result",
        "mid_loop_free_devices": len(mid_loop_free.result.devices) if mid_loop_free and mid_loop_free.result else 0,
        "allocated_before_del": allocated_before_del,
        "reserved_before": reserved_before,
        "reserved_after": reserved_after,
        "result_reserved_reclaimed": device.reserved_reclaimed_bytes,
        "message": message,
        "header": header,
        "points_per_line": stats.points_per_line,
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("gpumem-")),
    }))
"""


def test_allocated_curve_follows_a_training_loop_and_free_reclaims_the_cache() -> None:
    result = _run(_TRAINING)
    pushed = result["pushed"]
    # While the loop ran, the panel's allocated curve moved with it: many distinct values, rising.
    values = [value for _step, value, _actual in pushed]
    distinct = sorted(set(values))
    assert len(distinct) >= 8, pushed
    assert values[-1] > values[0] + 20 * 64 * MIB
    # Each pushed value is a real reading: never above what torch had allocated by then (plus one
    # step's worth, the sample may be newer than our read), never far behind it (about a second).
    for step, value, actual in pushed:
        if value:
            assert value <= actual + 512 * MIB, (step, value, actual)  # a sample inside a step sees activations
            assert value >= actual - 40 * 64 * MIB, (step, value, actual)
    # Free clicked mid-loop worked and did not disturb the loop.
    assert result["mid_loop_free_error"] is None
    assert result["mid_loop_free_devices"] == 1
    # After the tensors are deleted, Free gives the cached blocks back: reserved drops.
    assert result["reserved_before"] - result["reserved_after"] >= 50 * 64 * MIB
    assert result["result_reserved_reclaimed"] >= 50 * 64 * MIB
    assert "Freed" in result["message"] and "of GPU memory" in result["message"]
    assert "gm-c-a" in result["header"]
    assert 2 <= result["points_per_line"] <= 2000
    assert result["threads"] == []


_PEAK_BETWEEN_SAMPLES = """
import json, re
import torch
from gpumem.core.monitoring.monitor import Monitor
from gpumem.core.monitoring.peaks import reset_raised_peaks
from gpumem.panel.widget import Panel, close_all

GIB = 1 << 30
monitor = Monitor()
keep = torch.empty(GIB // 2, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize(0)
monitor.sampler.sample_once()
panel = Panel(monitor, autostart=False)
big = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda:0")  # 2.5 GiB for an instant no sample sees
del big
torch.cuda.synchronize(0)
monitor.sampler.sample_once()
panel.refresh()
text = lambda: re.sub(r"\\s+", " ", re.sub(r"<[^>]+>", " ", panel._header.value))
exact = text()
true_peak = torch.cuda.max_memory_allocated(0)
# A measured cell resets the counter at its start (what %gpumem auto does): the panel's figure stays a
# true peak since it opened, now a lower bound.
reset_raised_peaks(monitor.source, monitor.snapshot().allocator)
monitor.sampler.sample_once()
panel.refresh()
bound = text()
frame = panel._last_frame
curve_top = float(frame.y[0][frame.y[0] == frame.y[0]].max()) * frame.unit_bytes
close_all()
print(json.dumps({"exact": exact, "bound": bound, "true_peak": true_peak, "curve_top": curve_top}))
"""


def test_a_peak_between_samples_is_exact_and_explained_on_a_gpu() -> None:
    """The card above the curve: 2.5 GiB from PyTorch's counter over a curve that stays at 0.5 GiB, and
    it says so; after a measured cell resets the counter, the same figure as a lower bound."""
    result = _run(_PEAK_BETWEEN_SAMPLES)
    assert "peak since open 2.5 GiB" in result["exact"], result
    assert "curve: 512.0 MiB, the peak fell between samples" in result["exact"], result
    assert result["true_peak"] >= 2.5 * (1 << 30)
    assert "peak since open ≥ 2.5 GiB" in result["bound"], result
    assert result["curve_top"] < 0.6 * (1 << 30), result
