"""The one byte and duration formatter and the one size parser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpumem.core.holders import find_holders, render_text
from gpumem.core.units import GIB, MIB, format_bytes, format_delta, format_duration, parse_size


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0.0 ms"), (0.0004, "0.4 ms"), (0.0994, "99.4 ms"), (0.25, "250 ms"), (1.234, "1.23 s"),
     (125, "2 min 5 s"), (3 * 3600 + 120, "3 h 2 min")],
)  # fmt: skip
def test_durations_keep_what_matters(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


# The cases the front end's formatBytes (js/src/format.ts) is tested on too (js/test/format.test.ts).
FORMAT_BYTES_CASES = Path(__file__).resolve().parents[1] / "fixtures" / "format_bytes.json"


def _shared_cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = json.loads(FORMAT_BYTES_CASES.read_text(encoding="utf-8"))["cases"]
    return cases


@pytest.mark.parametrize("case", _shared_cases(), ids=lambda case: f"{case['bytes']}-{case.get('precision', 1)}")
def test_bytes_read_as_the_front_end_writes_them(case: dict[str, Any]) -> None:
    value = float(case["bytes"]) if isinstance(case["bytes"], str) else case["bytes"]
    assert format_bytes(value, case.get("precision", 1)) == case["text"]


def test_the_shared_cases_hold_the_ties_and_the_edges() -> None:
    texts = {(str(case["bytes"]), case.get("precision", 1)): case["text"] for case in _shared_cases()}
    assert texts[str(1280), 1] == "1.2 KiB"  # a tie: to even, where JavaScript's toFixed goes up
    assert texts[str(1792), 1] == "1.8 KiB"
    assert texts[str(2560), 0] == "2 KiB"
    assert texts[str(1023), 1] == "1023 B"
    assert texts["nan", 1] == "n/a"
    assert len(texts) == len(_shared_cases()), "a case appears twice"


def test_bytes_and_sizes_round_trip() -> None:
    assert format_bytes(1536 * MIB) == "1.5 GiB"
    assert format_delta(-64 * MIB) == "-64.0 MiB"
    assert parse_size("1GiB") == GIB
    assert parse_size("64MiB") == 64 * MIB


def test_a_quick_walk_says_its_time_in_tenths_of_a_millisecond() -> None:
    torch = pytest.importorskip("torch")
    text = render_text(find_holders({"t": torch.zeros(4)}, device="cpu"))
    first = text.splitlines()[0]
    assert first.startswith("Tensor memory held by names (cpu), walked in ")
    assert not first.endswith(" 0 ms"), first  # a walk under a millisecond is not "0 ms"
