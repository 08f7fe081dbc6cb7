"""``python -m gpumem run script.py [args]``: the script runs as ``python script.py`` would, under the monitor.

The script gets its own ``sys.argv``, ``__name__ == "__main__"`` and its exit code; an exception is shown
by ``sys.excepthook`` from the script's first frame on and exits 1. gpumem writes only to stderr, once,
at the end: the peak of every device (exact from the allocator's counters unless marked), when the
sampler saw it, and the session's timeline summary; ``--save`` keeps it all as a session export
(:mod:`gpumem.core.sessions.session_file`'s format, the run's figures under ``run``), which ``%gpumem load`` shows.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, TextIO

from gpumem.core.monitoring.monitor import Monitor, default_monitor
from gpumem.core.monitoring.spans import SpanRecord
from gpumem.core.sampling.sampler import channel_device
from gpumem.core.sampling.thresholds import DEFAULT_WARN_FRACTION
from gpumem.core.scripts.memory_report import report_rows
from gpumem.core.sessions.session_file import SessionData, capture_session, write_session
from gpumem.core.units import format_bytes

__all__ = ["SessionResult", "run_figures", "run_script", "session_text"]

INTERRUPTED_EXIT = 130  # what a shell reports for a process stopped by Ctrl-C


class SessionResult(NamedTuple):
    script: str
    argv: tuple[str, ...]
    exit_code: int
    record: SpanRecord  # the whole run, start to end
    started_monotonic_s: float
    peak_times_s: dict[int, float]  # per device, seconds after the start of the highest sampled allocation
    samples: int
    mean_sample_s: float


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")  # SystemExit("message") prints the message and exits 1, as Python does
    return 1


def _script_traceback(tb: TracebackType | None, script: str) -> TracebackType | None:
    """Drop gpumem's and runpy's frames so that the traceback starts in the script, as Python shows it."""
    current = tb
    while current is not None and current.tb_frame.f_code.co_filename != script:
        current = current.tb_next
    return current if current is not None else tb


def _show(error: BaseException, script: str) -> None:
    """What Python prints for an uncaught exception (through the script's own excepthook, if it set one)."""
    trimmed = _script_traceback(error.__traceback__, script)
    error.__traceback__ = trimmed  # the default hook prints the exception's own traceback
    sys.excepthook(type(error), error, trimmed)


def _run(path: Path, argv: list[str], given: str, kept: list[dict[str, Any]]) -> int:
    """Run the script; its globals go into ``kept`` so that what it left alive is still alive at the report."""
    script = str(path)
    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [given, *argv]  # as python sets it: the script as it was named on the command line
    sys.path.insert(0, str(path.parent))
    try:
        kept.append(runpy.run_path(script, run_name="__main__"))
    except SystemExit as exit_:
        return _exit_code(exit_.code)
    except BaseException as error:
        _show(error, script)
        return INTERRUPTED_EXIT if isinstance(error, KeyboardInterrupt) else 1
    finally:
        sys.argv = saved_argv
        if sys.path and sys.path[0] == str(path.parent) and saved_path0 != sys.path[0]:
            del sys.path[0]
    return 0


def _peak_times(monitor: Monitor, start_s: float) -> dict[int, float]:
    series = monitor.timeline.window(start_s)
    times: dict[int, float] = {}
    for name, values in series.values.items():
        device = channel_device(name)
        if device is not None and name.endswith("/allocated") and values:
            index = max(range(len(values)), key=lambda i: values[i])
            times[device] = series.times[index] - start_s
    return times


def run_script(
    script: str, argv: list[str], *, save: str | None = None, rate_hz: float = 10.0, stream: TextIO | None = None
) -> int:
    """Run ``script`` with ``argv`` under the shared monitor; report to ``stream`` (stderr); its exit code."""
    path = Path(script).resolve()
    if not path.is_file():
        (stream or sys.stderr).write(f"gpumem run: no such script: {script}\n")
        return 2
    monitor = default_monitor()
    monitor.rate_hz = rate_hz
    monitor.thresholds.warn_at(DEFAULT_WARN_FRACTION)
    session = monitor.recorder.clock.stream("session")
    session.point("start")
    started = time.monotonic()
    monitor.start()
    code = 1
    kept: list[dict[str, Any]] = []  # as under python, the script's globals live until after the report
    try:
        code = _run(path, argv, script, kept)
    finally:
        record = session.point("end")._replace(kind="run")
        session.close()
        monitor.stop()
        monitor.thresholds.drain()
        cost = monitor.sampler.cost()
        result = SessionResult(
            str(path), tuple(argv), code, record, started, _peak_times(monitor, started),
            cost.samples, cost.mean_s,
        )  # fmt: skip
        out = stream or sys.stderr
        out.write(session_text(result))
        if save:
            saved = capture_session(monitor.timeline, ())
            saved.run = run_figures(result)
            _save(save, saved, out)
    return code


def session_text(result: SessionResult) -> str:
    record = result.record
    lines = [f"gpumem: memory report for {Path(result.script).name} (exit code {result.exit_code})"]
    if not record.devices:
        lines.append("  CUDA: not used by this run (no tensor was put on a GPU)")
    for device in record.devices:
        peak = format_bytes(device.peak_allocated_bytes)
        peak = peak if device.peak_exact else f"≥ {peak} ({device.peak_note})"
        when = result.peak_times_s.get(device.device)
        at = f", highest sample at {when:.1f} s" if when is not None else ""
        lines.append(
            f"  cuda:{device.device}: peak allocated {peak}{at}; peak reserved "
            f"{format_bytes(device.peak_reserved_bytes)}; at exit {format_bytes(device.allocated_bytes)} allocated, "
            f"{format_bytes(device.reserved_bytes)} reserved"
        )
    if record.host is not None:
        host = record.host
        peak = format_bytes(host.peak_rss_bytes) if host.peak_exact else f"≥ {format_bytes(host.peak_rss_bytes)}"
        lines.append(f"  host: peak RSS {peak}; at exit {format_bytes(host.rss_bytes)}")
    lines.append(
        f"  timeline: {record.duration_s:.1f} s, {result.samples} sample{'' if result.samples == 1 else 's'} "
        f"({result.mean_sample_s * 1e3:.2f} ms each on average)"
    )
    return "\n".join(lines) + "\n"


def run_figures(result: SessionResult) -> dict[str, Any]:
    """What a saved session keeps of the run itself (its ``run``): times in seconds from its start."""
    return {
        "script": result.script,
        "argv": list(result.argv),
        "exit_code": result.exit_code,
        "started_wall_s": result.record.started_wall_s,
        "duration_s": result.record.duration_s,
        "figures": report_rows([result.record]),
        "peak_times_s": {f"cuda:{device}": at for device, at in result.peak_times_s.items()},
        "samples": result.samples,
    }


def _save(path: str, session: SessionData, out: TextIO) -> None:
    """Write the session export; a file there that is not a gpumem session is left as it was."""
    target = Path(path).expanduser()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_session(session, target)
    except FileExistsError:
        out.write(f"gpumem run: {path} exists and is not a gpumem session; it was left as it was\n")
    except OSError as error:
        out.write(f"gpumem run: could not save the session to {path}: {error}\n")
    else:
        out.write(f"gpumem: session saved to {path} (%gpumem load {path} shows it)\n")
