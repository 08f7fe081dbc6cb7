"""The status comm's messages as the kernel writes them, against the cases the front end's tests read.

tests/fixtures/status_protocol.json holds them; js/test/protocol.test.ts checks that the front end
(js/src/protocol.ts) reads the same messages as the fixture says, so neither side can change alone.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

from gpumem.core.units import GIB, MIB
from gpumem.panel import frontend
from gpumem.panel.frontend import status_payload
from gpumem.testing import FakeSource

REPO = Path(__file__).resolve().parents[2]
PROTOCOL = json.loads((REPO / "tests" / "fixtures" / "status_protocol.json").read_text("utf-8"))
# Where the front end's side names the Python it speaks with.
FRONT_END_TEXTS = [
    *sorted((REPO / "js" / "src").glob("*.ts")),
    *sorted((REPO / "js" / "test").glob("*.ts")),
    REPO / "js" / "README.md",
    *sorted((REPO / "tests" / "fixtures").glob("*.json")),
]
# A dotted name or a path under src/gpumem; not inside a string such as 'gpumem.status' or a mime type.
_DOTTED = re.compile(r"(?<![\w'\".\-/])gpumem(?:\.[A-Za-z_]\w*)+")
_PATH = re.compile(r"src/gpumem/[\w/]+\.py")


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


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def test_the_front_end_names_python_that_exists() -> None:
    named: dict[str, list[str]] = {}
    for path in FRONT_END_TEXTS:
        text = path.read_text("utf-8")
        for name in {*_DOTTED.findall(text), *_PATH.findall(text)}:
            named.setdefault(name, []).append(path.relative_to(REPO).as_posix())
    assert "gpumem.panel.frontend" in named, "the protocol no longer names its Python side"
    missing = {
        name: where
        for name, where in named.items()
        if name != frontend.STATUS_TARGET
        and not ((REPO / name).is_file() if name.startswith("src/") else _resolves(name.rstrip(".")))
    }
    assert not missing, f"named by the front end but not in gpumem: {missing}"
