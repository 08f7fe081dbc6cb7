"""The trace analysis by arrays (frees paired with allocations by numpy) answers exactly as the
replay loop that it replaced, which still runs for entries the arrays cannot hold; and the site
lookup by frame identity never charges an allocation to another stack's site."""

from __future__ import annotations

import random
from typing import Any

import pytest

from _harness.synthetic_trace import synthetic_snapshot, training_snapshot
from gpumem.core.trace import analysis
from gpumem.core.trace.analysis import DeviceTrace, SiteNamer, analyse_device

_FILES = ["/usr/lib/python3/dist-packages/torch/nn/functional.py", "/home/me/train.py", "<ipython-input-4-ab>",
          "/usr/lib/python3/dist-packages/torch/optim/adamw.py", "<frozen runpy>"]  # fmt: skip
_ACTIONS = ["alloc"] * 5 + ["free_requested"] * 3 + ["free_completed"] * 2 + ["oom", "segment_alloc", "snapshot"]


def _random_snapshot(seed: int, count: int = 600) -> dict[str, Any]:
    """Few addresses (allocs that replace live blocks, double frees, frees of unknown blocks), frame
    dicts shared and not, frees completed with and without a request."""
    rng = random.Random(seed)
    pool = [{"filename": rng.choice(_FILES), "line": rng.randint(1, 4), "name": "f"} for _ in range(12)]
    stacks = [[rng.choice(pool) for _ in range(rng.randint(0, 8))] for _ in range(10)]
    trace = []
    for number in range(count):
        action = rng.choice(_ACTIONS)
        entry: dict[str, Any] = {"action": action, "addr": rng.randrange(24) * 512, "size": rng.randrange(5) * 512,
                                 "time_us": 100.0 + number * rng.choice((0, 1, 3))}  # fmt: skip
        if action == "alloc":
            stack = rng.choice(stacks)
            entry["frames"] = stack if rng.random() < 0.7 else [dict(frame) for frame in stack]
        trace.append(entry)
    blocks = [{"address": rng.randrange(24) * 512, "size": 1024, "requested_size": 1000, "state": "active_allocated"}
              for _ in range(4)]  # fmt: skip
    return {"segments": [{"device": 0, "address": 0, "blocks": blocks}], "device_traces": [trace]}


def _both(snapshot: dict[str, Any], monkeypatch: pytest.MonkeyPatch, first_entry: int = 0) -> list[DeviceTrace]:
    by_arrays = analyse_device(snapshot, 0, first_entry=first_entry, namer=SiteNamer())
    with monkeypatch.context() as patched:
        patched.setattr(analysis, "_columns", lambda entries: None)
        by_loop = analyse_device(snapshot, 0, first_entry=first_entry, namer=SiteNamer())
    return [by_arrays, by_loop]


@pytest.mark.parametrize("seed", range(40))
def test_arrays_answer_as_the_loop_on_random_traces(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    by_arrays, by_loop = _both(_random_snapshot(seed), monkeypatch, first_entry=seed % 7)
    assert by_arrays == by_loop
    assert by_arrays.times  # not vacuous: there were events, sites and frees of memory from before
    assert by_arrays.freed_before > 0


@pytest.mark.parametrize("make", [lambda: training_snapshot(40), lambda: synthetic_snapshot(5000)])
def test_arrays_answer_as_the_loop_on_training_shaped_traces(make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    by_arrays, by_loop = _both(make(), monkeypatch)
    assert by_arrays == by_loop
    assert by_arrays.left
    assert by_arrays.temporary


def test_entries_the_arrays_cannot_hold_fall_back_to_the_loop() -> None:
    snapshot = training_snapshot(3)
    trace = snapshot["device_traces"][0]
    assert analysis._columns(trace) is not None
    odd = [dict(trace[0], size=1.5), *trace[1:]]  # a float size: numpy would truncate it
    missing = [{key: value for key, value in trace[0].items() if key != "time_us"}, *trace[1:]]
    assert analysis._columns(odd) is None
    assert analysis._columns(missing) is None
    assert analyse_device({"device_traces": [odd]}, 0).deltas[0] == 1.5
    assert analyse_device({"device_traces": [missing]}, 0).times[0] == 0  # the loop's entry number


def test_a_stack_sharing_the_innermost_and_user_frame_dicts_is_still_told_apart() -> None:
    """Stacks that share the two frames the lookup is keyed by, at the same depth, but differ between
    them: the second's innermost user frame is another one, so is its site."""
    torch_frame = {"filename": "/usr/lib/python3/dist-packages/torch/nn/functional.py", "line": 9, "name": "linear"}
    library = {"filename": "/usr/lib/python3/dist-packages/torch/nn/modules/linear.py", "line": 5, "name": "forward"}
    helper = {"filename": "/home/me/model.py", "line": 12, "name": "block"}
    cell = {"filename": "<ipython-input-3-ab>", "line": 2, "name": "<module>"}
    trace = [
        {"action": "alloc", "addr": 512 * number, "size": 512, "time_us": float(number), "frames": frames}
        for number, frames in enumerate([[torch_frame, library, cell], [torch_frame, helper, cell]] * 3)
    ]
    found = analyse_device({"device_traces": [trace]}, 0)
    labels = [usage.site.label for usage in found.left]
    assert labels == ["/home/me/model.py:12 in block", "cell [3] line 2 in <module>"]
    assert [usage.count for usage in found.left] == [3, 3]


def test_the_timeline_drawn_from_the_analysis_arrays_equals_one_from_the_lists() -> None:
    from gpumem.core.trace.site_timeline import _Events, build_timeline

    trace = analyse_device(training_snapshot(30), 0)
    assert _Events(trace).deltas is trace.arrays[1]  # the analysis's arrays are reused
    reused = build_timeline(trace, columns=50)
    trace.deltas, trace.owners = list(trace.deltas), list(trace.owners)  # other lists: converted again
    assert _Events(trace).deltas is not trace.arrays[1]
    assert build_timeline(trace, columns=50) == reused
