"""Where automatic mode's per-cell time goes: cProfile over trivial cells in the in-process shell.

Not a benchmark (``.ci/gpu`` runs only ``bench_*.py``): a tool for finding what to make cheaper.
Without CUDA a fake allocator stands in for a device in use, as in ``bench_cells.py``.
``--hooks`` times gpumem's two hooks instead (no profiler): the median per cell, the figure to compare,
and the median per cell of each part (source reads, record building, warnings...), to show on the GPU
which share is the reads.
With CUDA it is initialized first (``--no-cuda-init`` leaves it), as in a notebook that uses the GPU:
before that, a snapshot reads no allocator.
``--variables N`` puts N names in the namespace and has every cell rebind them all; ``--namespace N``
first fills it with bench_cells.py's N variables of a training notebook (tensors on the GPU, or on the
CPU with the walk looking for CPU tensors).

    python benchmarks/profile_cells.py [--cells 2000] [--vars never] [--top 30] [--hooks] [--variables 0] [--pause-ms 5]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _fill(shell: Any, count: int) -> None:
    """bench_cells.py's namespace of ``count`` variables, and its CPU stand-in for the walk without CUDA."""
    import torch

    import bench_cells
    from gpumem.ipython import extension

    cuda = torch.cuda.is_available()
    shell.user_ns.update(bench_cells.make_namespace(torch, "cuda:0" if cuda else "cpu", count))
    state = extension.get_state()
    if state is not None and not cuda:
        state.tracker.holder_finder = bench_cells.cpu_finder


def _shell(vars_mode: str, *, cuda_init: bool = True) -> Any:
    import torch
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    from gpumem.core.monitoring.monitor import Monitor, set_default_monitor
    from gpumem.testing import MIB, FakeSource

    if torch.cuda.is_available():
        if cuda_init:
            torch.zeros(1, device="cuda")  # a notebook that uses the GPU: the allocator is read at every cell
        set_default_monitor(Monitor())
    else:
        fake = FakeSource()
        fake.allocate(64 * MIB)
        set_default_monitor(Monitor(fake))
    config = Config()
    config.HistoryManager.hist_file = ":memory:"  # as in bench_cells.py: no shared-disk noise
    shell = InteractiveShell.instance(config=config)
    shell.run_line_magic("load_ext", "gpumem")
    with contextlib.redirect_stdout(io.StringIO()):
        shell.run_line_magic("gpumem", f"auto on --vars {vars_mode}")
    return shell


def _timed_hooks(shell: Any) -> list[float]:
    """Wrap gpumem's two hooks so that each call adds its duration to the last entry of the returned list."""
    from gpumem.ipython import extension

    hooks = extension.get_hooks()
    assert hooks is not None
    spent = [0.0]

    def timed(hook: Any) -> Any:
        def wrapper(argument: Any) -> None:
            began = time.perf_counter()
            hook(argument)
            spent[-1] += time.perf_counter() - began

        return wrapper

    for event, hook in (("pre_run_cell", hooks.pre_run_cell), ("post_run_cell", hooks.post_run_cell)):
        shell.events.unregister(event, hook)
        shell.events.register(event, timed(hook))
    return spent


def _parts() -> dict[str, float]:
    """Time the main parts of a measured cell; each call adds its duration to the returned dict by name."""
    from gpumem.core.cells import tracker as tracker_module
    from gpumem.core.monitoring.spans import Stretch
    from gpumem.core.readers.sources import SystemSource
    from gpumem.ipython import extension

    state, hooks = extension.get_state(), extension.get_hooks()
    assert state is not None
    assert hooks is not None
    spent: dict[str, float] = {}
    parts: list[tuple[Any, str, str]] = [
        (state.monitor.source, "snapshot", "source snapshot (both reads)"),
        (state.monitor.source, "reset_peaks", "source reset_peaks"),
        (state.tracker, "begin", "tracker.begin"),
        (state.tracker, "end", "tracker.end"),
        (state.tracker, "_figure_warnings", "  figure warnings (leaks, capacity, fragmentation)"),
        (state.tracker, "_variables", "  variables"),
        (Stretch, "device_changes", "  device changes"),
        (tracker_module, "staircase_notes", "  staircase notes"),
        (hooks, "show", "hooks.show"),
    ]
    source = state.monitor.source
    if isinstance(source, SystemSource):
        parts += [
            (source.torch, "read", "  allocator reads"),
            (source.nvml, "read", "  NVML reads"),
            (source.host, "read", "  host read"),
        ]
    if hooks.oom is not None:
        parts += [(hooks.oom, "pre_run_cell", "out-of-memory pre"), (hooks.oom, "post_run_cell", "out-of-memory post")]
    for owner, attribute, label in parts:
        setattr(owner, attribute, _adding(getattr(owner, attribute), label, spent))
    return spent


def _adding(function: Any, label: str, spent: dict[str, float]) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - began

    return timed


def _time_hooks(shell: Any, cell: str, cells: int, pause_s: float) -> None:
    """Between cells (untimed) a pause, as in bench_cells.py and in real use: a cell after idle time runs
    with cold caches, which a back-to-back loop hides."""
    spent = _timed_hooks(shell)
    per_cell = []
    for _ in range(cells):
        time.sleep(pause_s)
        spent[-1] = 0.0
        shell.run_cell(cell, store_history=True)
        per_cell.append(spent[-1])
    quartiles = statistics.quantiles(per_cell, n=4)
    print(
        f"{cells} cells ({cell!r}, {pause_s * 1e3:g} ms apart): in gpumem's hooks median "
        f"{statistics.median(per_cell) * 1e3:.3f} ms (IQR {quartiles[0] * 1e3:.3f}-{quartiles[2] * 1e3:.3f})"
    )
    parts = _parts()  # a second run, its parts timed (the wrappers add a little to each)
    shares: dict[str, list[float]] = {}
    for _ in range(cells):
        time.sleep(pause_s)
        parts.clear()
        shell.run_cell(cell, store_history=True)
        for label, seconds in parts.items():
            shares.setdefault(label, []).append(seconds)
    for label, values in shares.items():
        print(f"  {label:<52} median {statistics.median(values) * 1e6:7.1f} us per cell ({len(values)} cells)")


def _cell(variables: int, shell: Any) -> str:
    if not variables:
        return "x = 1"
    shell.run_cell(
        f"_touched = [f'touched_{{i:04d}}' for i in range({variables})]\n"
        "def _touch_names():\n    g = globals()\n    for n in _touched:\n        g[n] = [n]\n"
    )
    return "_touch_names()"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=2000)
    parser.add_argument("--vars", default="never", choices=["never", "auto", "always"])
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--sort", default="cumulative")
    parser.add_argument("--hooks", action="store_true", help="time the hooks (no profiler)")
    parser.add_argument("--variables", type=int, default=0)
    parser.add_argument("--namespace", type=int, default=0, help="bench_cells.py's variables, this many")
    parser.add_argument("--pause-ms", type=float, default=5.0, help="untimed pause between --hooks cells")
    parser.add_argument("--no-cuda-init", action="store_true", help="leave CUDA uninitialized (no allocator reads)")
    args = parser.parse_args()

    shell = _shell(args.vars, cuda_init=not args.no_cuda_init)
    if args.namespace:
        _fill(shell, args.namespace)
    cell = _cell(args.variables, shell)
    for _ in range(50):
        shell.run_cell(cell, store_history=True)
    if args.hooks:
        print(f"--vars {args.vars}, {args.variables} names rebound per cell")
        _time_hooks(shell, cell, args.cells, args.pause_ms / 1e3)
        return 0
    profiler = cProfile.Profile()
    began = time.perf_counter()
    profiler.enable()
    for _ in range(args.cells):
        shell.run_cell(cell, store_history=True)
    profiler.disable()
    elapsed = time.perf_counter() - began
    print(f"{args.cells} cells in {elapsed:.2f} s under the profiler ({elapsed / args.cells * 1e3:.3f} ms per cell)")
    stats = pstats.Stats(profiler, stream=sys.stdout)
    stats.sort_stats(args.sort).print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
