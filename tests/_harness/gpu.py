"""Is CUDA usable? Probed once, in a child interpreter, so the test process never initializes CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from _harness.config import SRC_DIR

_CUDA_PROBE = """
import json
try:
    import torch
except Exception as exc:
    print(json.dumps({"torch": None, "available": False, "count": 0, "error": repr(exc)}))
else:
    ok = bool(torch.cuda.is_available())
    print(json.dumps({"torch": torch.__version__, "available": ok,
                      "count": torch.cuda.device_count() if ok else 0, "error": None}))
"""

_cuda_cache: dict[str, Any] | None = None


def cuda_status() -> dict[str, Any]:
    """``{"torch": version|None, "available": bool, "count": int, "error": str|None, "reason": str}``.

    Probed once per process in a child interpreter: calling ``torch.cuda.is_available()`` here could
    initialize CUDA in the test process and break tests that fork later.
    """
    global _cuda_cache
    if _cuda_cache is None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(SRC_DIR), env.get("PYTHONPATH", "")] if p)
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _CUDA_PROBE],
                capture_output=True,
                text=True,
                timeout=300,
                env=env,
                check=False,
            )
            lines = proc.stdout.strip().splitlines()
            status: dict[str, Any] = (
                json.loads(lines[-1])
                if lines
                else {
                    "torch": None,
                    "available": False,
                    "count": 0,
                    "error": f"probe failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}",
                }
            )
        except (subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
            status = {"torch": None, "available": False, "count": 0, "error": f"probe failed: {exc!r}"}
        if status["torch"] is None:
            status["reason"] = f"torch is not importable ({status['error']})"
        elif not status["available"]:
            status["reason"] = f"torch {status['torch']} sees no CUDA device (torch.cuda.is_available() is False)"
        else:
            status["reason"] = f"torch {status['torch']} with {status['count']} CUDA device(s)"
        _cuda_cache = status
    return _cuda_cache


def gpu_required() -> bool:
    """True when ``$GPUMEM_REQUIRE_GPU`` is set (the GPU CI job): then missing CUDA fails gpu tests."""
    return os.environ.get("GPUMEM_REQUIRE_GPU", "").strip().lower() not in ("", "0", "false", "no")


def check_gpu_item(item: pytest.Item) -> None:
    """Skip (or fail, when a GPU is required) a ``gpu``-marked test if CUDA is not usable.

    Called from ``pytest_runtest_setup`` before pytest evaluates skip marks, so the skip is reported
    at the test's own location.
    """
    if item.get_closest_marker("gpu") is None:
        return
    status = cuda_status()
    if status["available"]:
        return
    if gpu_required():
        pytest.fail(f"GPUMEM_REQUIRE_GPU is set but {status['reason']}", pytrace=False)
    item.add_marker(pytest.mark.skip(reason=f"needs CUDA: {status['reason']}"))
