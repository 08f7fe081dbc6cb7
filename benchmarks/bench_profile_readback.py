"""``%%gpumem --profile``'s read-back of PyTorch's CPU-side records: this tree's reader against an earlier one.

One recording of ``bench_sampler``'s training step (on CUDA: 8 x Linear(1024), AdamW, batch 256, 100 steps,
about 50,800 calls; on the CPU its small stand-in, width 128, batch 32, one thread, 57 steps for about as many
calls) under ``--profile``'s recorder (``profile_records.RecordsProfiler``), then read again and again by
two readers in paired, interleaved quads (``_paired``: A B B A, with an A/A control): A the baseline reader
(``profile_records.py`` of an earlier commit, ``--baseline-rev``, through ``git show``; or a file, ``--baseline``
or ``benchmarks/baseline_profile_records_<rev>.py``, for a machine without git), B this tree's.
Both must give the same table (every row with a figure that is not 0, in order, and the number of calls), else
the benchmark fails.
Reported: the median of the per-round ratios B/A with the A/A control's, and each reader's median seconds
a read (``--clock cpu``: the process's CPU time, less disturbed by other jobs on a shared machine).

    python benchmarks/bench_profile_readback.py [--out DIR] [--budget 60] [--steps N]
        [--baseline-rev a0d7173 | --baseline FILE] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import _paired
from bench_sampler import make_step
from gpumem.core.diagnoses import profile_records
from gpumem.core.diagnoses.profile_records import RecordsProfiler

READER = "src/gpumem/core/diagnoses/profile_records.py"
ROOT = Path(__file__).resolve().parents[1]


def baseline(rev: str, path: Path | None) -> ModuleType:
    """The reader of an earlier commit, as a module of its own: from a file (``--baseline``, else
    ``benchmarks/baseline_profile_records_<rev>.py`` where it exists: a copy without git), or ``git show``."""
    if path is None and (here := Path(__file__).with_name(f"baseline_profile_records_{rev}.py")).exists():
        path = here
    if path is None:
        path = Path("/tmp") / f"gpumem_profile_records_{rev}.py"
        source = subprocess.run(["git", "show", f"{rev}:{READER}"], cwd=ROOT, capture_output=True, check=True)
        path.write_bytes(source.stdout)
    spec = importlib.util.spec_from_file_location(f"baseline_profile_records_{rev}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(steps: int, device: str) -> Any:
    """The records of one ``--profile``d run of the training loop (warmed up first, outside the recording)."""
    step, sync = make_step(device)
    for _ in range(3):
        step()
    sync()
    recorder = RecordsProfiler(torch)
    recorder.start()
    try:
        for _ in range(steps):
            step()
        sync()
    finally:
        records = recorder.stop()
    return records


def _moving(rows: list[Any]) -> list[Any]:
    """The rows of a table with a figure that is not 0, in its order (an earlier reader kept the others too)."""
    return [row for row in rows if row.moved_memory()]


class _Readers:
    """The paired method's variants (which reader reads) and its workload (reading the records ``size``
    times), with each reader's seconds a read kept apart."""

    def __init__(
        self, threads: list[Any], clock: Callable[[], float], readers: dict[str, Callable[[Any], Any]]
    ) -> None:
        self.threads = threads
        self.clock = clock
        self.readers = readers
        self.current = next(iter(readers))
        self.seconds: dict[str, list[float]] = {name: [] for name in readers}

    def variant(self, name: str) -> Callable[[], contextlib.AbstractContextManager[None]]:
        @contextlib.contextmanager
        def entered() -> Iterator[None]:
            self.current = name
            yield

        return entered

    def workload(self, size: int) -> float:
        read = self.readers[self.current]
        began = self.clock()
        for _ in range(size):
            read(self.threads)
        took = self.clock() - began
        self.seconds[self.current].append(took / size)
        return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write bench_profile_readback.json/.md there")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds for the paired rounds")
    parser.add_argument("--steps", type=int, default=None, help="training steps recorded (CUDA 100, CPU 57)")
    parser.add_argument("--baseline-rev", default="a0d7173", help="the commit whose reader is A")
    parser.add_argument("--baseline", type=Path, default=None, help="a file holding reader A (instead of git)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    steps = args.steps or (100 if device == "cuda" else 57)
    old = baseline(args.baseline_rev, args.baseline)
    threads = record(steps, device)
    ours, theirs = profile_records.read_records(threads), old.read_records(threads)
    if ours is None or theirs is None or (ours.rows, ours.calls) != (_moving(theirs.rows), theirs.calls):
        raise SystemExit(f"the readers disagree on the same records: {ours!r} against {theirs!r}")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    readers = _Readers(threads, clock, {"A": old.read_records, "B": profile_records.read_records})
    result = _paired.paired_ratio(
        readers.variant("A"), readers.variant("B"), readers.workload,
        size=1, budget_s=args.budget, quads=2, grow="quads", min_rounds=6,
    )  # fmt: skip
    median = {name: statistics.median(readers.seconds[name]) for name in ("A", "B")}
    records = sum(len(one) for one in threads)
    line = (f"--profile read-back of the records recorder, {steps}-step training loop on {device}, "
            f"{ours.calls:,} calls, {records:,} records in {len(threads)} thread lists, {args.clock} clock: "
            f"{args.baseline_rev if args.baseline is None else args.baseline.name} {median['A'] * 1e3:.1f} ms, "
            f"this tree {median['B'] * 1e3:.1f} ms a read (medians); B/A {result['paired']['median']:.3f} "
            f"(IQR {result['paired']['q1']:.3f}-{result['paired']['q3']:.3f}, {result['paired']['rounds']} rounds), "
            f"A/A {result['control']['median']:.3f} (IQR {result['control']['q1']:.3f}-{result['control']['q3']:.3f}); "
            f"the same rows with a figure not 0 (in order) and calls from both")  # fmt: skip
    print(line)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        summary = {"when": dt.datetime.now(dt.timezone.utc).isoformat(), "python": platform.python_version(),
                   "torch": torch.__version__, "device": device, "steps": steps, "calls": ours.calls,
                   "records": records, "clock": args.clock, "baseline": args.baseline_rev, "median_s": median,
                   "paired": result}  # fmt: skip
        (args.out / "bench_profile_readback.json").write_text(json.dumps(summary, indent=1))
        table = "\n".join([*_paired.MARKDOWN_HEADER, _paired.markdown_row("records read-back, this tree / A", result)])
        (args.out / "bench_profile_readback.md").write_text(
            f"## bench_profile_readback ({torch.__version__})\n\n{line}\n\n{table}\n"
        )


if __name__ == "__main__":
    sys.exit(main())
