"""On a real CUDA GPU: the OOM under a memory fraction names the cap as the cap, and a device index past
the real device count is refused as such, before CUDA is initialized too (no context is created)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _run(code: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_oom_under_a_memory_fraction_shows_the_cap_and_the_device_apart() -> None:
    # A fresh process: the fraction is process-wide. 5 % of an H200 (~7 GiB): 4 GiB fits, 4 GiB more does not,
    # while the device itself has far more than 4 GiB free.
    result = _run(
        """
        import json, time
        import torch
        from gpumem.core.diagnoses import oom
        from gpumem.core.units import format_bytes
        torch.cuda.set_per_process_memory_fraction(0.05, 0)
        total = torch.cuda.mem_get_info(0)[1]
        allowed = int(0.05 * total)
        oom.start_observing()
        x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda:0")
        started = time.monotonic()
        try:
            y = torch.empty(4 << 30, dtype=torch.uint8, device="cuda:0")
        except torch.OutOfMemoryError as error:
            report = oom.explain(error, observation=oom.observation_since(started))
            message = str(error)
        text = oom.render_text(report)
        print(json.dumps({
            "total": total, "allowed": allowed, "text": text, "message": message,
            "report_allowed": report.figures.allowed_bytes, "report_total": report.figures.device_total_bytes,
            "report_free": report.figures.device_free_bytes, "requested": report.figures.requested_bytes,
            "allocated": report.figures.allocated_bytes, "unallocated": report.figures.reserved_unallocated_bytes,
            "left": format_bytes((report.figures.allowed_bytes or 0) - (4 << 30)),
            "total_text": format_bytes(report.figures.device_total_bytes or 0),
            "allowed_text": format_bytes(report.figures.allowed_bytes or 0),
        }))
        """
    )
    assert " allowed; " in str(result["message"])
    rounding = 6 << 20  # the message writes two decimals of GiB; the observer's figure is exact where it is used
    assert abs(int(result["report_allowed"]) - int(result["allowed"])) <= rounding  # type: ignore[call-overload]
    assert abs(int(result["report_total"]) - int(result["total"])) <= rounding  # type: ignore[call-overload]
    assert result["requested"] == 4 << 30
    assert result["allocated"] == 4 << 30 and result["unallocated"] == 0  # one live 4 GiB segment
    assert int(result["report_free"]) > int(result["report_allowed"])  # type: ignore[call-overload]
    text = str(result["text"])
    assert f"in use 4.0 GiB (reserved by PyTorch), left {result['left']}" in text
    assert "this process's cap (set_per_process_memory_fraction): allowed " in text
    assert "refused the request: the device has " in text
    # The device's own free memory of its own total, apart from the cap.
    assert f" of {result['total_text']}" in text and result["total_text"] != result["allowed_text"]
    assert f"allowed {result['allowed_text']}, in use" in text


def test_a_device_past_the_real_count_is_refused_before_cuda_starts() -> None:
    result = _run(
        """
        import json
        import torch
        from IPython.core.interactiveshell import InteractiveShell
        from IPython.utils.capture import capture_output
        from gpumem.core.readers.sources import SystemSource
        shell = InteractiveShell.instance()
        count = torch.cuda.device_count()
        source_count = SystemSource().device_count()
        shell.run_cell("%load_ext gpumem")
        with capture_output() as cap:
            past = shell.run_cell(f"%%gpumem -d {count}\\nx = 1")
        with capture_output() as who:
            shell.run_cell(f"%gpumem who --device cuda:{count}")
        print(json.dumps({
            "count": count, "source_count": source_count, "refused": past.error_in_exec is not None,
            "ran": "x" in shell.user_ns, "shown": cap.stdout + cap.stderr, "who": who.stdout + who.stderr,
            "initialized": torch.cuda.is_initialized(),
        }))
        """
    )
    count = int(result["count"])  # type: ignore[call-overload]
    assert count >= 1 and result["source_count"] == count
    assert result["refused"] and not result["ran"]
    assert f"--device cuda:{count}: no such device; this process sees {count} CUDA device" in str(result["shown"])
    assert f"--device cuda:{count}: no such device" in str(result["who"])
    assert result["initialized"] is False  # the count came without a CUDA context
