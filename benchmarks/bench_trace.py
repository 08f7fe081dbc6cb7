"""Cost of ``%%gpumem --trace`` and ``--profile``, side by side with no gpumem.

GPU half (skipped, exit 0, where CUDA is absent): the training cell (8 x Linear(1024), AdamW, batch 256,
300 steps) run in a real IPython shell as six variants, in paired, interleaved rounds (the order
rotates): ``bare`` (no magic: no gpumem in the cell), ``plain`` (``%%gpumem -q``), ``record`` (the same,
with the body between gpumem's own TraceRecorder start and a stop that reads no snapshot: the cost of
PyTorch recording alone), ``snapshot`` (the same, stopped by taking PyTorch's snapshot: the floor of a
``--trace`` on PyTorch's history, before any analysis), ``trace`` (``%%gpumem --trace``) and ``profile``
(``%%gpumem --profile``).
Reported: each variant's median wall time, the medians of the per-round ratios to ``plain`` (goal for
``trace``: at most 1.15x) and to ``bare``, and for the trace runs the end of the cell by phase: the
snapshot (``torch.cuda.memory._snapshot()`` and switching recording off), our analysis and our
rendering (text and HTML), with the number of trace entries and the HTML's bytes; for the profile
runs, what its report says it cost after the cell (stopping the profiler, reading its calls back) and
the calls read, so what is left of its overhead is the recording while the cell ran. The goal is per
cell: the snapshot, analysis and rendering are paid once per cell, so their share of the overhead is
printed too (a longer cell pays them once over more work).
CPU half: analysing and rendering, timed apart (wall and CPU time), a synthesized training loop shaped
as torch records one (112 entries a step, 10 sites, 30-frame stacks, frame dicts shared, allocations
freed within the step but one result in ten kept; 33,600 entries like the 300-step cell, and 100,000);
analysing and rendering a synthesized trace (60,000 entries, about what the 300-step cell
records, and 100,000) to HTML, with every entry's frame dicts its own (the analysis's worst case) and
shared between entries as torch's snapshot shares them. Goals at 100,000: at most 1 s, 2 MB.

    python benchmarks/bench_trace.py [--out DIR] [--rounds 5] [--steps 300] [--entries 100000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumem.core.gc_pause import collector_paused
from gpumem.core.trace import CellSnapshot, build_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/_harness: the test-only snapshots
from _harness.synthetic_trace import synthetic_snapshot, training_snapshot

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is Python 3.11+

GOAL_RATIO = 1.15
GOAL_RENDER_S = 1.0
GOAL_BYTES = 2_000_000

SETUP = """\
import torch
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
data = torch.randn(256, 1024, device='cuda')
"""
TRAIN = """\
for _ in range({steps}):
    optimizer.zero_grad(set_to_none=True)
    loss = model(data).square().mean()
    loss.backward()
    optimizer.step()
torch.cuda.synchronize()
"""


def render_half(entries: int, runs: int = 7, *, shared_frames: bool = False) -> dict[str, Any]:
    snapshot = synthetic_snapshot(entries, shared_frames=shared_frames)
    analysis, render, cpu_times, size = [], [], [], 0
    for _ in range(runs):
        start, cpu = time.perf_counter(), time.process_time()
        report = build_report(CellSnapshot(snapshot, {}, False, [], 2 * entries))
        analysed = time.perf_counter()
        with collector_paused():  # as cell_recorders.show_trace renders it
            page = report._repr_html_() + repr(report)
        render.append(time.perf_counter() - analysed)
        analysis.append(analysed - start)
        cpu_times.append(time.process_time() - cpu)
        size = len(page.encode())
    median = statistics.median([a + r for a, r in zip(analysis, render, strict=True)])
    # CPU time beside wall time: on a shared machine the wall time includes other processes' turns.
    frames = "shared frame dicts" if shared_frames else "own frame dicts"
    print(f"render {entries:,} entries ({frames}): median {median * 1000:.0f} ms wall (analysis "
          f"{statistics.median(analysis) * 1000:.0f} ms, rendering {statistics.median(render) * 1000:.0f} ms), "
          f"{statistics.median(cpu_times) * 1000:.0f} ms CPU (goal <= {GOAL_RENDER_S * 1000:.0f} ms), "
          f"{size:,} bytes (goal <= {GOAL_BYTES:,})")  # fmt: skip
    return {"entries": entries, "shared_frames": shared_frames, "median_s": median, "analysis_s": analysis,
            "render_s": render, "cpu_s": cpu_times, "html_bytes": size,
            "ok": median <= GOAL_RENDER_S and size <= GOAL_BYTES}  # fmt: skip


STEP_ENTRIES = 112  # a training step's trace entries (56 allocs and their frees; free_completed is skipped)


def training_half(entries: int, runs: int = 9) -> dict[str, Any]:
    """Analysis and rendering, timed apart, of a synthesized training loop as torch records it."""
    steps = max(entries // STEP_ENTRIES, 1)
    snapshot = training_snapshot(steps)
    count = len(snapshot["device_traces"][0])
    build_report(CellSnapshot(snapshot, {}, False, [], None))  # imports (numpy) and warms up
    phases: dict[str, list[float]] = {"analysis_s": [], "analysis_cpu_s": [], "render_s": [], "render_cpu_s": []}
    for _ in range(runs):
        start, cpu = time.perf_counter(), time.process_time()
        report = build_report(CellSnapshot(snapshot, {}, False, [], None))
        analysed, analysed_cpu = time.perf_counter(), time.process_time()
        with collector_paused():  # as cell_recorders.show_trace renders it
            report._repr_html_()
            repr(report)
        phases["render_s"].append(time.perf_counter() - analysed)
        phases["render_cpu_s"].append(time.process_time() - analysed_cpu)
        phases["analysis_s"].append(analysed - start)
        phases["analysis_cpu_s"].append(analysed_cpu - cpu)
    median = {name: statistics.median(values) * 1000 for name, values in phases.items()}
    print(f"training loop, {count:,} entries ({steps} steps of {STEP_ENTRIES}, 10 sites, 30-frame stacks, shared "
          f"frame dicts): analysis median {median['analysis_s']:.1f} ms wall ({median['analysis_cpu_s']:.1f} ms "
          f"CPU), rendering median {median['render_s']:.1f} ms wall ({median['render_cpu_s']:.1f} ms CPU)")  # fmt: skip
    return {"entries": count, **phases}


RECORD_ONLY = """\
_gpumem_recorder = _GpumemTraceRecorder()
assert _gpumem_recorder.start() is None
{body}_gpumem_recorder.abandon()
"""
# PyTorch's recording and its snapshot, nothing of gpumem's analysis or drawing: the floor of any
# --trace built on PyTorch's allocation history (were it above the goal, no analysis could meet it).
RECORD_SNAPSHOT = """\
_gpumem_recorder = _GpumemTraceRecorder()
assert _gpumem_recorder.start() is None
{body}assert _gpumem_recorder.stop() is not None
"""
PHASES = ("snapshot_s", "analysis_s", "render_s")
PROFILE_PHASES = ("stop_s", "group_s", "operator_calls")  # ProfileCost's fields: after the cell, and calls read
RATIOS_TO_PLAIN = ("record", "snapshot", "trace", "profile")  # to %%gpumem -q: what the option adds
RATIOS_TO_BARE = {"plain/bare": "plain", "trace/bare": "trace", "profile/bare": "profile"}  # to no gpumem


def gpu_half(rounds: int, steps: int) -> dict[str, Any] | None:
    try:
        import torch
    except ImportError:
        print("GPU half skipped: torch is not installed")
        return None
    if not torch.cuda.is_available():
        print("GPU half skipped: no CUDA device (torch.cuda.is_available() is False)")
        return None
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from gpumem.ipython import cell_recorders

    shell = InteractiveShell.instance()
    assert shell.run_cell(SETUP + "from gpumem.core.trace import TraceRecorder as _GpumemTraceRecorder\n").success
    assert shell.run_cell("%load_ext gpumem").success
    body = TRAIN.format(steps=steps)
    variants = {
        "bare": body,  # no gpumem in the cell (the extension loaded, automatic mode off)
        "plain": "%%gpumem -q\n" + body,
        "record": "%%gpumem -q\n" + RECORD_ONLY.format(body=body),
        "snapshot": "%%gpumem -q\n" + RECORD_SNAPSHOT.format(body=body),
        "trace": "%%gpumem --trace\n" + body,
        "profile": "%%gpumem --profile\n" + body,
    }
    phases: dict[str, list[float]] = {name: [] for name in (*PHASES, "entries", "html_bytes")}
    phases.update({f"profile_{name}": [] for name in PROFILE_PHASES})

    def run(name: str) -> float:
        gc.collect()  # untimed: what the previous run left (a profile's events) is not this run's cost
        start = time.perf_counter()
        with capture_output(display=True):
            result = shell.run_cell(variants[name], store_history=True)
        elapsed = time.perf_counter() - start
        assert result.success, result.error_in_exec
        return elapsed

    for name in variants:  # warm-up: cuBLAS workspaces, the optimizer's state, the first snapshot
        run(name)
    times: dict[str, list[float]] = {name: [] for name in variants}
    ratios: dict[str, list[float]] = {name: [] for name in (*RATIOS_TO_PLAIN, *RATIOS_TO_BARE)}
    names = list(variants)
    with ProfileCosts(cell_recorders) as profile_costs:
        for round_number in range(rounds):
            order = names[round_number % len(names) :] + names[: round_number % len(names)]
            got = {}
            for name in order:
                got[name] = run(name)
                keep_phases(name, phases, cell_recorders.LAST_COSTS, profile_costs)
            for name, seconds in got.items():
                times[name].append(seconds)
            for name in RATIOS_TO_PLAIN:
                ratios[name].append(got[name] / got["plain"])
            for name, variant in RATIOS_TO_BARE.items():
                ratios[name].append(got[variant] / got["bare"])
    return _gpu_report(steps, rounds, times, ratios, phases, torch)


class ProfileCosts:
    """What each profiled cell's report says it cost, kept by wrapping ``cell_recorders.stop_profile`` (which the
    hooks call through the module) inside the ``with`` block."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.stop = module.stop_profile
        self.last: Any = None

    def __enter__(self) -> Self:
        self.module.stop_profile = self._stop
        return self

    def __exit__(self, *_exc: object) -> None:
        self.module.stop_profile = self.stop

    def _stop(self, profiler: Any, cell: int | None) -> Any:
        report = self.stop(profiler, cell)
        self.last = report.cost if report is not None else None
        return report


def keep_phases(
    name: str, phases: dict[str, list[float]], trace_costs: dict[str, float], profile: ProfileCosts
) -> None:
    """After a traced run its end-of-cell phases; after a profiled run what its report says it cost."""
    if name == "trace":
        for key in (*PHASES, "entries", "html_bytes"):
            phases[key].append(float(trace_costs.get(key, float("nan"))))
    elif name == "profile":
        for key in PROFILE_PHASES:
            phases[f"profile_{key}"].append(float(getattr(profile.last, key, float("nan"))))


def _gpu_report(steps: int, rounds: int, times: dict[str, list[float]], ratios: dict[str, list[float]],
                phases: dict[str, list[float]], torch: Any) -> dict[str, Any]:  # fmt: skip
    median = {name: statistics.median(values) for name, values in times.items()}
    ratio = {name: statistics.median(values) for name, values in ratios.items()}
    phase = {name: statistics.median(values) for name, values in phases.items()}
    print(f"training cell, {steps} steps, {rounds} paired rounds: plain median {median['plain']:.3f} s, "
          f"recording only {median['record']:.3f} s ({ratio['record']:.3f}x), recording + PyTorch's snapshot "
          f"{median['snapshot']:.3f} s ({ratio['snapshot']:.3f}x: the floor), "
          f"--trace {median['trace']:.3f} s, paired ratio {ratio['trace']:.3f}x (goal <= {GOAL_RATIO}x)")  # fmt: skip
    print(f"  side by side with no gpumem (bare {median['bare']:.3f} s): %%gpumem -q {ratio['plain/bare']:.3f}x, "
          f"--trace {ratio['trace/bare']:.3f}x, --profile {ratio['profile/bare']:.3f}x "
          f"({median['profile']:.3f} s; {ratio['profile']:.3f}x %%gpumem -q)")  # fmt: skip
    end = sum(phase[name] for name in PHASES)
    overhead = median["trace"] - median["plain"]
    print(f"  end of the traced cell: snapshot {phase['snapshot_s'] * 1000:.0f} ms, analysis "
          f"{phase['analysis_s'] * 1000:.0f} ms, rendering {phase['render_s'] * 1000:.0f} ms "
          f"({phase['entries']:,.0f} trace entries, {phase['html_bytes']:,.0f} bytes of HTML)")  # fmt: skip
    after = phase["profile_stop_s"] + phase["profile_group_s"]
    print(f"  end of the profiled cell: stopping {phase['profile_stop_s']:.2f} s, reading back "
          f"{phase['profile_group_s']:.2f} s ({phase['profile_operator_calls']:,.0f} calls); the rest of its "
          f"{median['profile'] - median['plain']:.2f} s overhead, {median['profile'] - median['plain'] - after:.2f} s, "
          "is the recording while the cell ran")  # fmt: skip
    if overhead > 0:
        recording = max(median["record"] - median["plain"], 0.0)
        print(f"  of the {overhead * 1000:.0f} ms overhead: recording {recording * 1000:.0f} ms while the cell runs, "
              f"the fixed end of the cell {end * 1000:.0f} ms ({end / overhead:.0%}), paid once per cell: "
              f"without it the ratio would be {(median['trace'] - end) / median['plain']:.3f}x")  # fmt: skip
    return {"steps": steps, "rounds": rounds, "times_s": times, "ratios": ratios, "median_ratio": ratio["trace"],
            "record_ratio": ratio["record"], "snapshot_ratio": ratio["snapshot"], "phases": phases,
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__, "ok": ratio["trace"] <= GOAL_RATIO}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write bench_trace.json there")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--entries", type=int, default=100_000)
    args = parser.parse_args()
    results = {
        "when": dt.datetime.now(dt.timezone.utc).isoformat(),
        "python": platform.python_version(),
        "render": [
            render_half(entries, shared_frames=shared)
            for shared in (False, True)
            for entries in sorted({60_000, args.entries})
        ],
        "training": [training_half(entries) for entries in (33_600, 100_000)],
        "gpu": gpu_half(args.rounds, args.steps),
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_trace.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
