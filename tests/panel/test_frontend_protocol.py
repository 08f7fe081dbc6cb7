"""The status comm's messages as the kernel writes them, against the cases the front end's tests read.

tests/fixtures/status_protocol.json holds them; js/test/protocol.test.ts checks that the front end
(js/src/protocol.ts) reads the same messages as the fixture says, so neither side can change alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpumem.core.units import GIB, MIB
from gpumem.panel import frontend
from gpumem.panel.status import status_payload
from gpumem.testing import FakeSource

PROTOCOL = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "status_protocol.json").read_text("utf-8"))


def _payload(source: FakeSource, devices: int) -> dict[str, Any]:
    return status_payload(source.snapshot(), {index: source.device_info(index) for index in range(devices)})


def test_the_names_are_the_kernels() -> None:
    assert PROTOCOL["status_target"] == frontend.STATUS_TARGET
    assert PROTOCOL["sidebar_mime"] == frontend.SIDEBAR_MIME
    assert PROTOCOL["widget_view_mime"] == frontend.WIDGET_VIEW_MIME


def test_the_status_payloads_are_what_the_kernel_sends() -> None:
    busy = FakeSource(devices=2, total_bytes=140 * GIB, host_rss_bytes=1300 * MIB)
    busy.allocate(3 * GIB + 200 * MIB, device=0)
    idle = FakeSource(devices=1, cuda_initialized=False)
    written = [_payload(busy, 2), _payload(idle, 1)]
    assert [case["data"] for case in PROTOCOL["status_payloads"]] == written


def test_the_requests_and_answers_are_the_documented_ones() -> None:
    reference = frontend.__doc__
    assert reference is not None
    for request in PROTOCOL["requests"]:
        assert f'{{"request": "{request}"}}' in reference, request
    for case in PROTOCOL["sidebar_answers"]:
        (key,) = case["data"]
        assert f'{{"{key}": ' in reference, key
