"""A synthesized snapshot of a training loop's allocation history, for benchmarks and tests that
have no GPU: each step allocates activations in a few cells' lines, frees them, and keeps a slowly
growing list of results, in the format of ``torch.cuda.memory._snapshot()``.

Shaped like a real one where cost depends on it: every alloc carries its own list of frames, about 20
deep (torch's modules and IPython's own frames below the cell), and each free is a ``free_requested``
then a ``free_completed`` entry with no frames (``context="alloc"`` records stacks of allocations only).
By default every list holds its own frame dicts, the analysis's worst case; torch's own snapshot
(``py_symbolize``) makes one dict per distinct frame and shares it between entries, which
``shared_frames=True`` reproduces.
"""

from __future__ import annotations

from typing import Any

__all__ = ["synthetic_snapshot"]

_BASE = 0x7F0000000000
_LIB = "/usr/lib/python3/dist-packages"
_TORCH = [
    (f"{_LIB}/torch/nn/functional.py", 1676, "linear"),
    (f"{_LIB}/torch/nn/modules/linear.py", 125, "forward"),
    (f"{_LIB}/torch/nn/modules/module.py", 1762, "_call_impl"),
    (f"{_LIB}/torch/nn/modules/module.py", 1751, "_wrapped_call_impl"),
    (f"{_LIB}/torch/nn/modules/container.py", 240, "forward"),
    (f"{_LIB}/torch/nn/modules/module.py", 1762, "_call_impl"),
    (f"{_LIB}/torch/nn/modules/module.py", 1751, "_wrapped_call_impl"),
]
_SHELL = [
    (f"{_LIB}/IPython/core/interactiveshell.py", 3577, "run_code"),
    (f"{_LIB}/IPython/core/interactiveshell.py", 3517, "run_ast_nodes"),
    (f"{_LIB}/IPython/core/interactiveshell.py", 3334, "run_cell_async"),
    (f"{_LIB}/IPython/core/async_helpers.py", 128, "_pseudo_sync_runner"),
    (f"{_LIB}/IPython/core/interactiveshell.py", 3130, "_run_cell"),
    (f"{_LIB}/IPython/core/interactiveshell.py", 3075, "run_cell"),
    (f"{_LIB}/ipykernel/zmqshell.py", 549, "run_cell"),
    (f"{_LIB}/ipykernel/ipkernel.py", 449, "do_execute"),
    (f"{_LIB}/ipykernel/kernelbase.py", 778, "execute_request"),
    (f"{_LIB}/ipykernel/kernelbase.py", 437, "dispatch_shell"),
]


def _stack(step_line: int) -> list[tuple[str, int, str]]:
    return [*_TORCH, ("<ipython-input-1-0a1b2c3d>", step_line, "train_step"),
            ("<ipython-input-2-4e5f6a7b>", 2, "<module>"), *_SHELL]  # fmt: skip


def synthetic_snapshot(events: int, *, sites: int = 24, shared_frames: bool = False) -> dict[str, Any]:
    """About ``events`` trace entries (an alloc, then its free requested and completed; one kept alive in 50)."""
    stacks = [[{"filename": name, "line": line, "name": function} for name, line, function in _stack(line)]
              for line in range(3, 3 + sites)]  # fmt: skip
    trace: list[dict[str, Any]] = []
    kept: list[tuple[int, int]] = []
    time_us = 1_000_000.0
    number = 0
    while len(trace) < events:
        address = _BASE + number * (1 << 21)
        size = (1 + number % 7) * (1 << 20)
        stack = stacks[number % sites]
        frames = list(stack) if shared_frames else [dict(frame) for frame in stack]
        trace.append({"action": "alloc", "addr": address, "size": size, "stream": 0, "time_us": time_us,
                      "frames": frames})  # fmt: skip
        time_us += 3.0
        if number % 50 == 0:
            kept.append((address, size))
        else:
            for action in ("free_requested", "free_completed"):
                trace.append({"action": action, "addr": address, "size": size, "stream": 0,
                              "time_us": time_us, "frames": []})  # fmt: skip
                time_us += 1.0
        number += 1
    blocks = [{"address": address, "size": size, "requested_size": size, "state": "active_allocated", "frames": []}
              for address, size in kept]  # fmt: skip
    segment = {"device": 0, "address": _BASE, "total_size": number * (1 << 21), "stream": 0, "segment_type": "large",
               "blocks": blocks}  # fmt: skip
    return {"segments": [segment], "device_traces": [trace]}
