"""The one byte and duration formatter and the one size parser."""

from __future__ import annotations

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
