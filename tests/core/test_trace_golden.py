"""The trace report's text and HTML pinned byte for byte (as SHA-256) for fixed snapshots, so that
making the analysis or the rendering faster cannot change a single character of what is shown."""

from __future__ import annotations

import hashlib
import json
import random
import uuid
from pathlib import Path
from typing import Any

import pytest

from _harness.synthetic_trace import synthetic_snapshot
from gpumem.core.trace import CellSnapshot, build_report
from gpumem.core.trace.analysis import analyse_snapshot
from gpumem.core.trace.site_timeline import _Slices, build_timeline

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "trace_snapshot.json"
CELLS = {"/tmp/ipykernel_42/2817.py": 2, "/tmp/ipykernel_42/1001.py": 3, "/tmp/ipykernel_42/1002.py": 4}
_FILES = [
    ("/usr/lib/python3/dist-packages/torch/nn/functional.py", "linear"),
    ("/usr/lib/python3/dist-packages/torch/optim/adamw.py", "step"),
    ("/tmp/ipykernel_42/1001.py", "make"),
    ("/tmp/ipykernel_42/1002.py", "<module>"),
    ("<ipython-input-5-0a1b2c3d>", "f<&>"),
    ("/home/me/train.py", "step"),
    ("<timed exec>", "<module>"),
    ("<frozen runpy>", "_run"),
]


def _frames(rng: random.Random) -> list[dict[str, Any]]:
    picked = [rng.choice(_FILES) for _ in range(rng.randint(0, 30))]
    return [{"filename": name, "line": rng.randint(1, 6), "name": function} for name, function in picked]


def _mixed_trace(rng: random.Random, count: int) -> list[dict[str, Any]]:
    """Every action the analysis reads, shared and unshared frame lists, frees of unknown blocks."""
    trace: list[dict[str, Any]] = []
    live: list[tuple[int, int]] = []
    shared = [_frames(rng) for _ in range(12)]
    time_us = 5_000.0
    for _ in range(count):
        time_us += rng.choice((0.0, 1.0, 2.5, 40.0))
        roll = rng.random()
        if roll < 0.45 or not live:
            address, size = rng.randrange(1 << 12) * 4096, rng.randint(1, 64) * 512
            frames = rng.choice(shared) if rng.random() < 0.5 else _frames(rng)
            trace.append({"action": "alloc", "addr": address, "size": size, "time_us": time_us, "frames": frames})
            live.append((address, size))
        elif roll < 0.85:
            address, size = live.pop(rng.randrange(len(live)))
            trace.append({"action": "free_requested", "addr": address, "size": size, "time_us": time_us})
            if rng.random() < 0.5:
                trace.append({"action": "free_completed", "addr": address, "size": size, "time_us": time_us})
        elif roll < 0.92:
            action = rng.choice(("free_requested", "free_completed"))
            trace.append({"action": action, "addr": 1 << 40 | rng.randrange(99), "size": 4096, "time_us": time_us})
        elif roll < 0.95:
            trace.append({"action": "oom", "addr": 0, "size": rng.randint(1, 9) << 30, "time_us": time_us})
        else:
            trace.append({"action": "segment_alloc", "addr": 0, "size": 1 << 21, "time_us": time_us})
    return trace


def _mixed_snapshot(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    blocks = [{"address": 1 << 41, "size": 8192, "requested_size": 8000, "state": "active_allocated"}]
    segments = [{"device": 1, "address": 1 << 41, "blocks": blocks}]
    return {"segments": segments, "device_traces": [_mixed_trace(rng, 3000), [], _mixed_trace(rng, 40)]}


def _synthetic_without_completions() -> dict[str, Any]:
    snapshot = synthetic_snapshot(20_000)
    trace = snapshot["device_traces"][0]
    snapshot["device_traces"][0] = [entry for entry in trace if entry["action"] != "free_completed"]
    return snapshot


def _cases() -> dict[str, tuple[CellSnapshot, dict[str, int] | None, int | None]]:
    fixture = json.loads(FIXTURE.read_text())
    return {
        "fixture": (CellSnapshot(fixture, {0: 2}, True, [], None), CELLS, 4),
        "fixture-truncated": (CellSnapshot(json.loads(FIXTURE.read_text()), {}, False, [0], 10), CELLS, None),
        "synthetic": (CellSnapshot(synthetic_snapshot(12_000, sites=30), {}, False, [], 200_000), None, 7),
        "synthetic-real-actions": (CellSnapshot(_synthetic_without_completions(), {0: 5}, False, [], None), None, 8),
        "mixed": (CellSnapshot(_mixed_snapshot(1), {0: 7, 2: 0}, False, [2], 500), {"<frozen runpy>": 9}, 3),
        "mixed-2": (CellSnapshot(_mixed_snapshot(2), {}, True, [], None), None, None),
    }


EXPECTED = {
    "fixture": "2135bd42aa61991284bb324ff99e6808673261a2bacbc943169f6161cab834e0",
    "fixture-truncated": "0dcbdf90211355af1fe65377f8e4d78ccf080af3d87c62d8e0059a7ed48da24f",
    "synthetic": "7ef3ebc57978070a31f5b927d44a79ac53b89644da107797e03cc59d5ddb7dc7",
    "synthetic-real-actions": "52679281415d725b9047f4e7f5e3e94e2eb15f44aef6376371ebc82ac82f0d6a",
    "mixed": "927f457dc3c7eeb97565b3e88f56e9bab764eac5f6e19cb3b0711c4eb74586de",
    "mixed-2": "80d2d4e02614ac1f252141dc461df8d6a977b47554614279ab352208243fbc3a",
}


def _fixed_uuids(monkeypatch: pytest.MonkeyPatch) -> None:
    numbers = iter(range(1, 1000))
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=next(numbers)))


def rendered(name: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The report's text, then its HTML, with the SVG's random element ids made sequential."""
    _fixed_uuids(monkeypatch)
    taken, cells, cell = _cases()[name]
    report = build_report(taken, cell_numbers=cells, cell=cell)
    return repr(report) + "\n----\n" + report._repr_html_()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_report_text_and_html_are_unchanged(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    page = rendered(name, monkeypatch)
    assert hashlib.sha256(page.encode()).hexdigest() == EXPECTED[name], f"{name}: {len(page)} characters"


@pytest.mark.parametrize("name", ["fixture", "synthetic", "mixed", "mixed-2"])
def test_timeline_from_arrays_equals_the_loop(name: str) -> None:
    """The numpy path and the plain loop draw the same points (the loop remains for odd data)."""
    taken, cells, _ = _cases()[name]
    for trace in analyse_snapshot(taken.snapshot, first_entry=taken.first_entry, cell_numbers=cells):
        for columns in (1, 3, 360):
            slices = _Slices(trace, [1 + site % 3 for site in range(len(trace.sites))], columns)
            state = [trace.start_bytes, 0, 0, 0]
            origin = trace.first_time or 0.0
            span = max((trace.last_time or origin) - origin, 1e-9)
            from_arrays = slices.by_arrays(list(state), origin, span)
            assert from_arrays is not None
            assert from_arrays == slices.by_loop(list(state), origin, span)


def test_sizes_that_are_not_integers_are_drawn_by_the_loop() -> None:
    snapshot = synthetic_snapshot(3000)
    trace, floats = analyse_snapshot(snapshot)[0], analyse_snapshot(snapshot)[0]
    floats.deltas = [float(delta) for delta in floats.deltas]
    assert _Slices(floats, [0] * len(floats.sites), 360).by_arrays([0], 0.0, 1.0) is None  # not for arrays
    exact, drawn = build_timeline(trace), build_timeline(floats)
    assert drawn.labels == exact.labels  # the same sites ranked the same, by the loop
    assert (drawn.times, drawn.values, drawn.band_max) == (exact.times, exact.values, exact.band_max)
    assert any(isinstance(value, float) for point in drawn.values for value in point)


def test_frame_dicts_shared_as_torch_shares_them_give_the_same_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookup by frame identity (torch's snapshot shares one dict per distinct frame) changes nothing."""
    _fixed_uuids(monkeypatch)
    snapshot = synthetic_snapshot(12_000, sites=30, shared_frames=True)
    report = build_report(CellSnapshot(snapshot, {}, False, [], 200_000), cell=7)
    page = repr(report) + "\n----\n" + report._repr_html_()
    assert hashlib.sha256(page.encode()).hexdigest() == EXPECTED["synthetic"]
