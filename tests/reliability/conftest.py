"""The reliability suite: ``reliability`` tests run by default; ``soak`` tests (long) only with ``GPUMEM_SOAK=1``.

A marker expression in ``addopts`` would override the user's own ``-m``, so the long tests skip
themselves instead; ``make soak`` sets the variable and runs them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SOAK = os.environ.get("GPUMEM_SOAK") == "1"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.reliability)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("soak") is not None and not SOAK:
        pytest.skip("a soak test: runs with GPUMEM_SOAK=1 (make soak)")
