"""Suite-wide pytest configuration. The fixtures live in the ``tests/_harness`` package (see its docstring)."""

from __future__ import annotations

import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

# Tests run against src/ even when the package is not pip-installed (the GPU job uses PYTHONPATH).
_TESTS = Path(__file__).resolve().parent
for _path in (str(_TESTS.parent / "src"), str(_TESTS)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

# Before the first import of the harness: its __init__ imports every module of the package, so
# pytest must be told up front that they are all plugins (else it warns it cannot rewrite them).
pytest.register_assert_rewrite("_harness")

from _harness import check_gpu_item  # noqa: E402 - needs tests/ on sys.path, set just above

# The harness modules that define fixtures; pytest imports them after this file (tests/ is on sys.path).
pytest_plugins = [
    "_harness.artifacts",
    "_harness.shell",
    "_harness.notebooks",
    "_harness.servers",
    "_harness.chromium",
]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # `gpu` tests skip (or fail under GPUMEM_REQUIRE_GPU=1) when CUDA is unusable; the probe runs
    # once, in a child process, and only if a gpu test is about to run.
    check_gpu_item(item)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    # Make each phase's report reachable from fixtures (browser_page saves a screenshot on failure).
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
