"""Where screenshots and logs go: ``$GPUMEM_TEST_ARTIFACTS`` or ``<repo>/test-artifacts``."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from _harness.config import REPO_ROOT

if TYPE_CHECKING:  # pragma: no cover
    from playwright.sync_api import Page


def artifacts_path() -> Path:
    """Directory for screenshots and logs (``$GPUMEM_TEST_ARTIFACTS`` or ``<repo>/test-artifacts``)."""
    path = Path(os.environ.get("GPUMEM_TEST_ARTIFACTS") or REPO_ROOT / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def safe_name(name: str) -> str:
    """A file-name-safe version of a test name or node id."""
    name = name.split("::", 1)[-1] if "::" in name else name
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[:150] or "unnamed"


def save_screenshot(page: Page, name: str | pytest.FixtureRequest, *, full_page: bool = True) -> Path:
    """Save ``page`` as ``test-artifacts/<name>.png`` and return the path.

    ``name`` may be a string or the test's ``request`` fixture (then the test's name is used).
    """
    label = name if isinstance(name, str) else name.node.name
    path = artifacts_path() / f"{safe_name(label)}.png"
    page.screenshot(path=str(path), full_page=full_page)
    return path


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    return artifacts_path()
