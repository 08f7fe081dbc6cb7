"""A synthesized snapshot of a training loop's allocation history, for benchmarks and tests that
have no GPU: each step allocates activations in a few cells' lines, frees them, and keeps a slowly
growing list of results, in the format of ``torch.cuda.memory._snapshot()``."""

from __future__ import annotations

from typing import Any

__all__ = ["synthetic_snapshot"]

_BASE = 0x7F0000000000
_IPYTHON = "/usr/lib/python3/dist-packages/IPython/core/interactiveshell.py"
_SHELL = [{"filename": _IPYTHON, "line": 3577, "name": "run_code"}]


def _frames(step_line: int) -> list[dict[str, Any]]:
    return [
        {"filename": "/usr/lib/python3/dist-packages/torch/nn/functional.py", "line": 1676, "name": "linear"},
        {"filename": "/usr/lib/python3/dist-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
        {"filename": "<ipython-input-1-0a1b2c3d>", "line": step_line, "name": "train_step"},
        {"filename": "<ipython-input-2-4e5f6a7b>", "line": 2, "name": "<module>"},
        *_SHELL,
    ]


def synthetic_snapshot(events: int, *, sites: int = 24) -> dict[str, Any]:
    """About ``events`` trace entries (alloc and free_requested pairs, one kept alive in 50)."""
    stacks = [_frames(line) for line in range(3, 3 + sites)]
    trace: list[dict[str, Any]] = []
    kept: list[tuple[int, int]] = []
    time_us = 1_000_000.0
    number = 0
    while len(trace) < events:
        address = _BASE + number * (1 << 21)
        size = (1 + number % 7) * (1 << 20)
        trace.append({"action": "alloc", "addr": address, "size": size, "stream": 0, "time_us": time_us,
                      "frames": stacks[number % sites]})  # fmt: skip
        time_us += 3.0
        if number % 50 == 0:
            kept.append((address, size))
        else:
            trace.append({"action": "free_requested", "addr": address, "size": size, "stream": 0,
                          "time_us": time_us, "frames": []})  # fmt: skip
            time_us += 2.0
        number += 1
    blocks = [{"address": address, "size": size, "requested_size": size, "state": "active_allocated", "frames": []}
              for address, size in kept]  # fmt: skip
    segment = {"device": 0, "address": _BASE, "total_size": number * (1 << 21), "stream": 0, "segment_type": "large",
               "blocks": blocks}  # fmt: skip
    return {"segments": [segment], "device_traces": [trace]}
