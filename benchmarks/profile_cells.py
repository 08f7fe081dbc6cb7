"""Where automatic mode's per-cell time goes: cProfile over trivial cells in the in-process shell.

Not a benchmark (``.ci/gpu`` runs only ``bench_*.py``): a tool for finding what to make cheaper.
Without CUDA a fake allocator stands in for a device in use, as in ``bench_cells.py``.

    python benchmarks/profile_cells.py [--cells 2000] [--vars never] [--top 30]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=2000)
    parser.add_argument("--vars", default="never", choices=["never", "auto", "always"])
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--sort", default="cumulative")
    args = parser.parse_args()

    import torch
    from IPython.core.interactiveshell import InteractiveShell

    from gpumem.core.monitor import Monitor, set_default_monitor
    from gpumem.testing import MIB, FakeSource

    if torch.cuda.is_available():
        set_default_monitor(Monitor())
    else:
        fake = FakeSource()
        fake.allocate(64 * MIB)
        set_default_monitor(Monitor(fake))
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.hist_file = ":memory:"  # as in bench_cells.py: no shared-disk noise
    shell = InteractiveShell.instance(config=config)
    shell.run_line_magic("load_ext", "gpumem")
    with contextlib.redirect_stdout(io.StringIO()):
        shell.run_line_magic("gpumem", f"auto on --vars {args.vars}")
    for _ in range(50):
        shell.run_cell("x = 1", store_history=True)
    profiler = cProfile.Profile()
    began = time.perf_counter()
    profiler.enable()
    for _ in range(args.cells):
        shell.run_cell("x = 1", store_history=True)
    profiler.disable()
    elapsed = time.perf_counter() - began
    print(f"{args.cells} cells in {elapsed:.2f} s under the profiler ({elapsed / args.cells * 1e3:.3f} ms per cell)")
    stats = pstats.Stats(profiler, stream=sys.stdout)
    stats.sort_stats(args.sort).print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
