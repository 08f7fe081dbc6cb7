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

__all__ = ["synthetic_snapshot", "training_snapshot"]

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


# Below ipykernel's dispatch, a kernel's own event loop and launcher: a training_snapshot stack is as deep as
# a real one in a notebook (about 30 frames).
_KERNEL_LOOP = [
    (f"{_LIB}/ipykernel/kernelbase.py", 534, "process_one"),
    (f"{_LIB}/ipykernel/kernelbase.py", 545, "dispatch_queue"),
    ("/usr/lib/python3.11/asyncio/events.py", 84, "_run"),
    ("/usr/lib/python3.11/asyncio/base_events.py", 1936, "_run_once"),
    ("/usr/lib/python3.11/asyncio/base_events.py", 608, "run_forever"),
    (f"{_LIB}/tornado/platform/asyncio.py", 205, "start"),
    (f"{_LIB}/ipykernel/kernelapp.py", 739, "start"),
    (f"{_LIB}/traitlets/config/application.py", 1075, "launch_instance"),
    (f"{_LIB}/ipykernel_launcher.py", 18, "<module>"),
    ("<frozen runpy>", 88, "_run_code"),
    ("<frozen runpy>", 198, "_run_module_as_main"),
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


def training_snapshot(steps: int, *, sites: int = 10, allocs: int = 56, keep_every: int = 10) -> dict[str, Any]:
    """``steps`` training steps as torch records them (``free_completed`` skipped): ``allocs`` allocations a
    step from ``sites`` lines, freed in reverse order as a backward pass frees activations, except the last
    one, freed in the next step (kept to the end every ``keep_every`` steps): 112 entries a step by default.
    Frame dicts are shared between entries and each alloc has its own list, as torch's snapshot makes them.
    The model's parameters (64 blocks of 4 MiB) were allocated before the cell and stay alive."""
    stacks = [[{"filename": name, "line": line, "name": function} for name, line, function in
               [*_stack(line), *_KERNEL_LOOP]] for line in range(3, 3 + sites)]  # fmt: skip
    trace: list[dict[str, Any]] = []
    kept: list[tuple[int, int]] = []
    time_us, pending = 1_000_000.0, None

    def free(address: int, size: int) -> None:
        trace.append({"action": "free_requested", "addr": address, "size": size, "stream": 0, "time_us": time_us,
                      "frames": []})  # fmt: skip

    for step in range(steps):
        made = []
        for number in range(allocs):
            address = _BASE + (number + (step % 2) * allocs) * (1 << 21)  # two steps' worth, reused
            if number == allocs - 1:  # the step's result: an address of its own (it may outlive the step)
                address = _BASE + (1 << 36) + step * (1 << 21)
            size = (1 + (number * 5 + step) % 9) * (1 << 18)
            trace.append({"action": "alloc", "addr": address, "size": size, "stream": 0, "time_us": time_us,
                          "frames": list(stacks[number % sites])})  # fmt: skip
            time_us += 2.0
            made.append((address, size))
            if number == allocs // 2 and pending is not None:  # the previous step's result, dropped mid-step
                free(*pending)
                pending = None
        result = made.pop()
        for address, size in reversed(made):
            free(address, size)
            time_us += 1.5
        if step % keep_every == keep_every - 1:
            kept.append(result)
        else:
            pending = result
    if pending is not None:
        kept.append(pending)
    params = [(_BASE - (index + 1) * (1 << 22), 1 << 22) for index in range(64)]
    blocks = [{"address": address, "size": size, "requested_size": size, "state": "active_allocated", "frames": []}
              for address, size in sorted(params + kept)]  # fmt: skip
    segment = {"device": 0, "address": params[-1][0], "total_size": 1 << 30, "stream": 0, "segment_type": "large",
               "blocks": blocks}  # fmt: skip
    return {"segments": [segment], "device_traces": [trace]}
