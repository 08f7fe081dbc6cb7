"""gpumem's thread CPU with a real browser view of the panel and the sidebar, next to the emulated view.

A CPU-box benchmark: it needs Debian's chromium, Playwright and JupyterLab (the GPU box has no browser,
so it is deliberately not called ``bench_*.py``, which ``.ci/gpu`` runs there). It checks the emulation
that ``bench_threads.py`` and ``profile_writer.py`` rely on (widgets publishing into CommRecorder).

1. Real: a JupyterLab server and a chromium page (the e2e tests' harness); in the kernel a fake
   allocator whose allocations change every 50 ms (``bench_panel._fake_driver``) as the default
   monitor, ``%load_ext gpumem``, ``%gpumem monitor`` inline and ``%gpumem sidebar``: both views live.
   After ``--settle`` s a cell sleeps ``--seconds`` (main thread idle) while each gpumem thread's CPU
   clock (and that of ipykernel's IOPub thread, which does the zmq send of their messages) and the
   panels' stats are read; the page counts what arrives on the kernel websocket.
2. Emulated, in this process: the same monitor and driver, ``bench_threads.threads_on`` (one panel, one
   reported view, a confirmed status comm) plus a compact sidebar panel with one view, CommRecorder
   counting the bytes; the same settle and seconds. Twice: while the page, the server and the kernel
   are still live (the same load on the machine as the real run), then with all of them closed.

    python benchmarks/browser_threads.py --out DIR [--seconds 30] [--settle 5]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# This checkout's gpumem in this process too, as in the kernel (the harness puts src/ first there).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_threads

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent

SIDEBAR_PANEL = "#gpumem-sidebar .gpumem-panel"
MARK = "BROWSER-THREADS "
# ipykernel's thread that does the zmq send of every message the others publish (none when emulated).
IOPUB = "IOPub"


def driven_monitor(stop: threading.Event | None = None) -> Any:
    """A monitor over an 80 GiB fake device whose allocations change every 50 ms, like a training loop's
    (until ``stop`` is set)."""
    import bench_panel
    from gpumem.core.monitoring.monitor import Monitor
    from gpumem.testing import GIB, FakeSource

    source = FakeSource(total_bytes=80 * GIB)
    source.allocate(8 * GIB)
    driver = threading.Thread(
        target=bench_panel._fake_driver, args=(source, 1, stop or threading.Event()), daemon=True, name="fake-driver"
    )
    driver.start()
    return Monitor(source, warn_at=None)  # what the extension's default monitor is made with


def _panel_stats() -> list[dict[str, Any]]:
    from gpumem.panel.writer import open_panels

    return [panel._stats._asdict() for panel in open_panels()]


def measure_threads(seconds: float) -> dict[str, Any]:
    """Each gpumem thread's CPU seconds per wall second and the panels' pushes, over ``seconds`` of sleep."""
    stats_before = _panel_stats()
    names = (*bench_threads.THREAD_NAMES, IOPUB)
    before, began = bench_threads.thread_cpu_s(names), time.monotonic()
    time.sleep(seconds)  # the main thread idle: the threads' own work, no GIL contention
    after, wall_s = bench_threads.thread_cpu_s(names), time.monotonic() - began
    stats_after = _panel_stats()
    panels = [
        {
            "curve_pushes_per_s": (end["curve_pushes"] - start["curve_pushes"]) / wall_s,
            "header_pushes_per_s": (end["header_pushes"] - start["header_pushes"]) / wall_s,
            "last_payload_bytes": end["last_payload_bytes"],
            "views": end["views"],
            "visible": end["visible"],
        }
        for start, end in zip(stats_before, stats_after, strict=False)
    ]
    return {
        "began_monotonic": began,
        "wall_s": wall_s,
        "cpu_ms_per_s": {k: v * 1e3 for k, v in bench_threads.per_second(after, before, wall_s).items()},
        "panels": panels,
    }


@contextlib.contextmanager
def lab_page(base: Path) -> Iterator[Any]:
    """A JupyterLab server loading this checkout's labextension, and a chromium page on it."""
    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(REPO / "tests"))
    from _harness import CHROMIUM_ARGS, chromium_path, make_jupyter_env, start_jupyter_server

    env = make_jupyter_env(base / "env")
    built = REPO / "src" / "gpumem" / "labextension"
    if (built / "package.json").is_file():  # as the e2e tests' fixture: this checkout's build comes first
        (env.data_dir / "labextensions").mkdir(parents=True, exist_ok=True)
        (env.data_dir / "labextensions" / "gpumem").symlink_to(built, target_is_directory=True)
    executable = chromium_path()
    if executable is None:
        raise SystemExit("Debian's chromium is needed (/usr/bin/chromium)")
    with start_jupyter_server("lab", root_dir=base / "root", env=env) as server, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
            page.set_default_timeout(120_000)
            yield server, page
        finally:
            browser.close()


def real_run(seconds: float, settle_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both views live in a real JupyterLab: the kernel's measurement and the page's received bytes; then,
    the page still live, the emulated run in this process (the same load on the machine)."""
    with tempfile.TemporaryDirectory(prefix="gpumem-browser-threads-") as tmp, lab_page(Path(tmp)) as (server, page):
        from _harness import KernelFrames, open_notebook, run_cell, wait_for_cell_done, wait_for_output

        sockets = KernelFrames(page)
        server.make_notebook("threads.ipynb", [""])
        open_notebook(page, server, "threads.ipynb", timeout=180)
        run_cell(
            page,
            f"import sys\nsys.path.insert(0, {str(BENCH_DIR)!r})\nimport browser_threads as bt\n"
            "from gpumem.core.monitoring.monitor import set_default_monitor\nset_default_monitor(bt.driven_monitor())",
            timeout=120,
        )
        run_cell(page, "%load_ext gpumem", timeout=120)
        run_cell(page, "%gpumem monitor", timeout=120)
        page.locator(".jp-OutputArea .gpumem-panel").first.wait_for(state="visible")
        run_cell(page, "%gpumem sidebar", timeout=120)
        page.locator(SIDEBAR_PANEL).first.wait_for(state="visible")
        page.wait_for_timeout(settle_s * 1000)
        measure = f"import json\nprint({MARK!r} + json.dumps(bt.measure_threads({seconds})))"
        cell = run_cell(page, measure, wait=False)
        page.wait_for_timeout(seconds * 1000)  # Playwright delivers websocket events while it waits
        wait_for_cell_done(cell, timeout=seconds + 120)
        text = wait_for_output(cell, MARK, timeout=30)
        result: dict[str, Any] = json.loads(text.split(MARK, 1)[1].strip().splitlines()[0])
        page.wait_for_timeout(500)  # frames of the window's last moments
        began, wall_s = result["began_monotonic"], result["wall_s"]
        result["socket_kb_per_s"] = sockets.bytes_between(began, began + wall_s) / wall_s / 1e3
        result["socket_comm_kb_per_s"] = sockets.bytes_between(began, began + wall_s, comm=True) / wall_s / 1e3
        return result, emulated_run(seconds, settle_s)


def emulated_run(seconds: float, settle_s: float) -> dict[str, Any]:
    """The same monitor and driver with the views emulated: bench_threads' set-up plus a sidebar panel."""
    from _harness.traffic import CommRecorder
    from gpumem.core.monitoring.monitor import default_monitor
    from gpumem.panel.widget import Panel

    stop = threading.Event()
    bench_threads.make_monitor = lambda cuda: driven_monitor(stop)  # noqa: ARG005
    with CommRecorder() as recorder, bench_threads.threads_on(bench_threads.Probe(1.0), cuda=False, settle_s=0.0):
        sidebar = Panel(default_monitor(), compact=True)  # what %gpumem sidebar opens
        sidebar._repr_mimebundle_()
        sidebar.set_state({"_view_count": 1})
        time.sleep(settle_s)
        result = measure_threads(seconds)
        began, wall_s = result["began_monotonic"], result["wall_s"]
        messages = [m for m in recorder.snapshot() if began <= m.at_s <= began + wall_s]
        sidebar.close()
    stop.set()
    result["socket_kb_per_s"] = result["socket_comm_kb_per_s"] = sum(m.nbytes for m in messages) / wall_s / 1e3
    return result


def _pushes(run: dict[str, Any], key: str) -> str:
    return " + ".join(f"{panel[key]:.2f}" for panel in run["panels"]) or "none"


def _iopub(run: dict[str, Any]) -> str:
    return f"{run['cpu_ms_per_s'][IOPUB]:.3f}" if IOPUB in run["cpu_ms_per_s"] else "none (no kernel)"


def _row(label: str, *cells: str) -> str:
    return f"| {label} | {' | '.join(cells)} |"


def markdown(report: dict[str, Any]) -> list[str]:
    runs = [report["real"], report["emulated_browser_live"], report["emulated"]]
    seconds, settle = report["seconds"], report["settle_s"]
    lines = [
        f"### gpumem threads, real browser vs emulated view ({report['date']}, {report['machine']})",
        "",
        (
            f"Inline panel + sidebar panel, fake allocator changing every 50 ms; {seconds:.0f} s measured after "
            f"{settle:.0f} s settling, main thread asleep."
        ),
        "",
        _row("", "real JupyterLab + chromium", "emulated, the page still live", "emulated, browser closed"),
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [
        _row(f"{name}, CPU ms per s", *(f"{run['cpu_ms_per_s'].get(name, 0.0):.3f}" for run in runs))
        for name in bench_threads.THREAD_NAMES
    ]
    lines.append(_row(f"ipykernel's {IOPUB} thread, CPU ms per s", *(_iopub(run) for run in runs)))
    for label, key in (("curve pushes per s", "curve_pushes_per_s"), ("header pushes per s", "header_pushes_per_s")):
        lines.append(_row(f"{label} (inline + sidebar)", *(_pushes(run, key) for run in runs)))
    lines += [
        _row("views per panel", *(_pushes(run, "views") for run in runs)),
        _row("comm messages, KB/s (received / serialized)", *(f"{run['socket_comm_kb_per_s']:.1f}" for run in runs)),
        _row("everything on the kernel websocket, KB/s", f"{runs[0]['socket_kb_per_s']:.1f}", "n/a", "n/a"),
        "",
        f"Sane: {report['sane']['ok']} ({'; '.join(report['sane']['problems']) or 'the writer pushed to every view'}).",
    ]
    return lines


def sanity(real: dict[str, Any]) -> dict[str, Any]:
    """The real run counts only if the writer really pushed to two registered views."""
    problems = []
    if len(real["panels"]) != 2:
        problems.append(f"{len(real['panels'])} open panels, not 2 (inline + sidebar)")
    for index, panel in enumerate(real["panels"]):
        if panel["views"] < 1:
            problems.append(f"panel {index} has no registered view")
        if panel["curve_pushes_per_s"] <= 0:
            problems.append(f"panel {index} pushed no curves")
    if real["socket_comm_kb_per_s"] <= 0:
        problems.append("no comm message reached the page")
    return {"ok": not problems, "problems": problems}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path())
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--settle", type=float, default=5.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    real, emulated_browser_live = real_run(args.seconds, args.settle)
    emulated = emulated_run(args.seconds, args.settle)
    report = {
        "benchmark": "browser_threads",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": bench_threads.CPU_LABEL,
        "seconds": args.seconds,
        "settle_s": args.settle,
        "real": real,
        "emulated_browser_live": emulated_browser_live,
        "emulated": emulated,
        "sane": sanity(real),
    }
    (args.out / "browser_threads.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = markdown(report)
    (args.out / "browser_threads.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if report["sane"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
