"""What automatic per-cell measurement costs, in a real in-process IPython shell.

1. Loading: ``%load_ext gpumem`` in a fresh interpreter (imports included), five times.
2. Per cell, in paired ABBA rounds with an A/A control (``benchmarks/_paired.py``), the extension not
   loaded (A) against automatic mode (B): a trivial cell (``x = 1``) at default settings, and a cell
   that rebinds 1,000 names, at default settings and with attribution on every cell (``--vars always``),
   with 1,000 variables in the namespace (tensors, lists of tensors, dicts, numbers, strings, arrays).
   The added time per cell is (B/A - 1) x A's time per cell; the time inside gpumem's two hooks,
   timed around them in the B runs, is shown beside it.
3. One full holders walk of that namespace, and a check cell that allocates a tensor.

With CUDA, the tensors live on cuda:0 and the real sources are read. Without CUDA the benchmark still
runs: the tensors live on the CPU, a fake allocator stands in for a device in use (attribution only
runs when one is) and the walk looks for CPU tensors, which is the same work.

    python benchmarks/bench_cells.py --out DIR [--budget 45] [--cells 10] [--quads 4] [--variables 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _paired  # noqa: E402 - the shared helper beside this script

GOAL_PLAIN_MS = 0.25  # floor goal per trivial cell (it was 1 ms)
GOAL_ATTRIBUTION_MS = 20.0
ALTERNATIVE_NOTE = (
    "For comparison, DESIGN.md records that the best-known per-cell tool (a busy NVML peak thread plus "
    "gc.collect and empty_cache at every cell) adds about 150 ms to every cell."
)

_LOAD = """
import time
from IPython.core.interactiveshell import InteractiveShell
ip = InteractiveShell.instance()
began = time.perf_counter()
ip.run_line_magic("load_ext", "gpumem")
print(time.perf_counter() - began)
"""


def load_times_s(runs: int = 5) -> list[float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    times = []
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", _LOAD], capture_output=True, text=True, env=env, timeout=300, check=False
        )
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return times


def make_namespace(torch: Any, device: str, count: int) -> dict[str, Any]:
    """``count`` variables of the kinds a training notebook holds."""
    import numpy as np

    namespace: dict[str, Any] = {}
    for i in range(count):
        kind = i % 10
        if kind == 0:
            value: Any = torch.ones(256, device=device)
        elif kind == 1:
            value = [torch.ones(16, device=device) for _ in range(3)]
        elif kind == 2:
            value = {"loss": float(i), "step": i, "name": f"run-{i}"}
        elif kind == 3:
            value = np.ones(64)
        elif kind == 4:
            value = list(range(20))
        elif kind == 5:
            value = f"string number {i}"
        elif kind == 6:
            value = (i, float(i), str(i))
        else:
            value = i
        namespace[f"var_{i:04d}"] = value
    return namespace


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--budget", type=float, default=45.0, help="seconds per paired comparison")
    parser.add_argument("--cells", type=int, default=10, help="cells per run")
    parser.add_argument("--quads", type=int, default=4, help="A/B and A/A quads per round to start with")
    parser.add_argument("--variables", type=int, default=1000)
    parser.add_argument(
        "--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES), help="which cells to compare (all)"
    )
    return parser.parse_args()


class ShellBench:
    """One in-process shell, with the extension loaded in a given mode or not, and its hooks timed."""

    def __init__(self, shell: Any, cuda: bool) -> None:
        self.shell = shell
        self.cuda = cuda
        self.hook_time = 0.0
        self._installed: list[tuple[str, Any, Any]] = []

    def _timed(self, hook: Any) -> Any:
        def wrapper(argument: Any) -> None:
            began = time.perf_counter()
            hook(argument)
            self.hook_time += time.perf_counter() - began

        return wrapper

    def load(self, vars_mode: str, incremental: bool = True) -> None:
        from gpumem.ipython import extension as _extension

        self.shell.run_line_magic("load_ext", "gpumem")
        state = _extension.get_state()
        assert state is not None
        state.tracker.incremental = incremental
        if not self.cuda:
            state.tracker.holder_finder = cpu_finder
        with contextlib.redirect_stdout(io.StringIO()):
            self.shell.run_line_magic("gpumem", "auto on" if vars_mode == "changed" else f"auto on --vars {vars_mode}")
        hooks = _extension.get_hooks()
        assert hooks is not None
        for event, hook in (("pre_run_cell", hooks.pre_run_cell), ("post_run_cell", hooks.post_run_cell)):
            wrapper = self._timed(hook)
            self.shell.events.unregister(event, hook)
            self.shell.events.register(event, wrapper)
            self._installed.append((event, hook, wrapper))

    def unload(self) -> None:
        from gpumem.ipython import extension as _extension

        while self._installed:
            event, hook, wrapper = self._installed.pop()
            self.shell.events.unregister(event, wrapper)
            self.shell.events.register(event, hook)
        if _extension.get_state() is not None:
            self.shell.run_line_magic("unload_ext", "gpumem")

    def time_cells(self, count: int, cell: str = "x = 1") -> tuple[list[float], list[float]]:
        """Wall time of each cell, and the part spent in gpumem's hooks. Between cells (untimed) a
        5 ms pause lets IPython's history thread write to its database, as it does between real cells;
        back to back, that write lands inside whichever cell next releases the GIL."""
        times, hooks = [], []
        for _ in range(count):
            time.sleep(0.005)
            self.hook_time = 0.0
            began = time.perf_counter()
            self.shell.run_cell(cell, store_history=True)
            times.append(time.perf_counter() - began)
            hooks.append(self.hook_time)
        return times, hooks

    @contextlib.contextmanager
    def not_loaded(self) -> Iterator[None]:
        self.unload()
        yield

    @contextlib.contextmanager
    def loaded(self, vars_mode: str) -> Iterator[None]:
        self.load(vars_mode)
        try:
            yield
        finally:
            self.unload()


def in_memory_history() -> Any:
    """IPython's history kept in memory: its SQLite file on a shared disk adds milliseconds of noise
    to every cell, loaded or not (the same for A and B, so it hides the difference rather than making it)."""
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    return config


def cpu_finder(namespace: Any, _device: str, names: Any) -> Any:
    """Without CUDA the walk looks for CPU tensors, which is the same work."""
    from gpumem.core.holders import find_holders

    if names is None:
        return find_holders(namespace, device="cpu")
    return find_holders(namespace, device="cpu", names=names, include_hidden=False)


CASES = {
    "trivial": ("changed", "x = 1", "trivial cell, default settings"),
    "rebinding": ("changed", "_touch_names()", "cell rebinding 1,000 names, default settings"),
    "always": ("always", "_touch_names()", "cell rebinding 1,000 names, --vars always, {variables} variables"),
}
"""The compared cells by ``--cases`` name: the ``--vars`` mode, the cell, the label."""

TOUCH_SETUP = """
_touched = [f"touched_{i:04d}" for i in range(COUNT)]
def _touch_names():
    namespace = globals()
    for name in _touched:
        namespace[name] = [name]
"""


def comparisons(bench: ShellBench, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each comparison: the extension not loaded (A) against automatic mode (B), paired."""
    bench.shell.run_cell(TOUCH_SETUP.replace("COUNT", "1000"))
    results = {}
    for case in (name for name in CASES if name in args.cases):
        vars_mode, cell, name = CASES[case]
        name = name.format(variables=args.variables)
        cell_times: dict[bool, list[float]] = {False: [], True: []}
        hook_times: list[float] = []

        def workload(
            count: int,
            cell: str = cell,
            cell_times: dict[bool, list[float]] = cell_times,
            hook_times: list[float] = hook_times,
        ) -> float:
            loaded = bool(bench._installed)
            times, hooks = bench.time_cells(count, cell)
            cell_times[loaded] += times
            if loaded:
                hook_times.extend(hooks)
            return sum(times)

        print(name)
        result = _paired.paired_ratio(
            bench.not_loaded, lambda vars_mode=vars_mode: bench.loaded(vars_mode), workload, size=args.cells,
            budget_s=args.budget, quads=args.quads, grow="quads",
        )  # fmt: skip
        base_ms = statistics.median(cell_times[False]) * 1e3
        mean_base_ms = statistics.fmean(cell_times[False]) * 1e3
        result.update(
            cell=cell,
            vars=vars_mode,
            not_loaded_median_ms=base_ms,
            added_ms_per_cell=(result["paired"]["median"] - 1) * mean_base_ms,
            added_ms_ci95=[(r - 1) * mean_base_ms for r in result["paired"]["ci95"]],
            control_ms=[(result["control"]["q1"] - 1) * mean_base_ms, (result["control"]["q3"] - 1) * mean_base_ms],
            in_hooks_median_ms=statistics.median(hook_times) * 1e3,
            in_hooks_p90_ms=statistics.quantiles(hook_times, n=10)[-1] * 1e3,
        )
        for key in ("ratios", "controls"):
            result[key] = [round(v, 5) for v in result[key]]
        results[name] = result
    return results


def check_cell(bench: ShellBench, device: str) -> tuple[list[str], str, Any]:
    """Run one cell that allocates a tensor in automatic mode: the names reported, the note, the source."""
    from gpumem.ipython import extension as _extension

    bench.load("always")
    bench.time_cells(5)
    bench.shell.run_cell(f"t = torch.ones(1 << 18, device={device!r})", store_history=True)
    state = _extension.get_state()
    assert state is not None
    last = state.tracker.history[-1]
    source = state.monitor.source
    bench.unload()
    return [variable.name for variable in last.variables], last.variables_note, source


def build_result(
    torch: Any, device: str, loads: list[float], compared: dict[str, Any], walk: Any, check: tuple[list[str], str]
) -> dict[str, Any]:
    cuda = device != "cpu"
    trivial = compared.get(CASES["trivial"][2])
    attributed = [c for name, c in compared.items() if name != CASES["trivial"][2]]
    found, last_note = check
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "device_of_tensors": device,
        "load_ext_s": loads,
        "comparisons": compared,
        "holders_walk_s": walk.elapsed_s,
        "holders_found": len(walk.holders),
        "check_cell_variables": found,
        "check_cell_note": last_note,
        "goals": {"auto_trivial_cell_ms": GOAL_PLAIN_MS, "attribution_ms": GOAL_ATTRIBUTION_MS, "load_ext_ms": 300},
        "met": {
            "auto_trivial_cell": None
            if trivial is None
            else max(trivial["added_ms_per_cell"], trivial["in_hooks_median_ms"]) <= GOAL_PLAIN_MS,
            "attribution": None
            if not attributed
            else all(max(c["added_ms_per_cell"], c["in_hooks_median_ms"]) <= GOAL_ATTRIBUTION_MS for c in attributed),
            "load_ext": statistics.median(loads) <= 0.3,
        },
    }


def markdown(result: dict[str, Any]) -> list[str]:
    where = result["gpu"] or "CPU, 2-core CI-class machine, not the goal machine (CPU tensors, fake device)"
    lines = [
        f"Per-cell overhead of automatic mode ({where}; torch {result['torch']}; {result['date']})",
        "",
        *_paired.MARKDOWN_HEADER,
    ]
    lines += [_paired.markdown_row(name, c) for name, c in result["comparisons"].items()]
    lines += [
        "",
        "| cell | not loaded, median | added per cell (95% CI) | A/A noise (IQR) | in gpumem's hooks, median / p90 |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {name} | {c['not_loaded_median_ms']:.3f} ms | {c['added_ms_per_cell']:+.3f} ms "
        f"({c['added_ms_ci95'][0]:+.3f}..{c['added_ms_ci95'][1]:+.3f}) "
        f"| {c['control_ms'][0]:+.3f}..{c['control_ms'][1]:+.3f} ms "
        f"| {c['in_hooks_median_ms']:.3f} / {c['in_hooks_p90_ms']:.3f} ms |"
        for name, c in result["comparisons"].items()
    ]
    met = {True: "met", False: "MISSED", None: "not measured"}
    loads = result["load_ext_s"]
    walk_ms = result["holders_walk_s"] * 1e3
    lines += [
        "",
        (
            f"Goals: <= {GOAL_PLAIN_MS:g} ms per trivial cell ({met[result['met']['auto_trivial_cell']]}); "
            f"<= {GOAL_ATTRIBUTION_MS:g} ms with attribution ({met[result['met']['attribution']]})."
        ),
        (
            f"One full holders walk of that namespace: {walk_ms:.1f} ms, {result['holders_found']} holders. "
            f"Check cell `t = torch.ones(...)`: reported {result['check_cell_variables']} "
            f"({result['check_cell_note']})."
        ),
        (
            f"`%load_ext gpumem` in a fresh interpreter: median {statistics.median(loads) * 1e3:.0f} ms, "
            f"max {max(loads) * 1e3:.0f} ms (goal <= 300 ms: {'met' if result['met']['load_ext'] else 'MISSED'})."
        ),
        "",
        ALTERNATIVE_NOTE,
        "",
    ]
    return lines


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch
    from IPython.core.interactiveshell import InteractiveShell

    from gpumem.core.holders import find_holders
    from gpumem.core.monitoring.monitor import Monitor, set_default_monitor
    from gpumem.testing import MIB, FakeSource

    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    loads = load_times_s()

    shell = InteractiveShell.instance(config=in_memory_history())
    shell.user_ns.update(make_namespace(torch, device, args.variables))
    shell.user_ns["torch"] = torch
    if cuda:
        set_default_monitor(Monitor())
    else:
        fake = FakeSource()
        fake.allocate(64 * MIB)
        set_default_monitor(Monitor(fake))

    bench = ShellBench(shell, cuda)
    compared = comparisons(bench, args)
    found, last_note, source = check_cell(bench, device)
    find_holders(shell.user_ns, device=device, source=source)
    walk = find_holders(shell.user_ns, device=device, source=source)

    result = build_result(torch, device, loads, compared, walk, (found, last_note))
    (args.out / "bench_cells.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = markdown(result)
    (args.out / "bench_cells.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
