"""Paths and time limits shared by the harness modules."""

from __future__ import annotations

from pathlib import Path

# tests/_harness/config.py -> the repository root is two folders up from this package.
REPO_ROOT = Path(__file__).resolve().parents[2]
SRC_DIR = REPO_ROOT / "src"

# Default timeouts (seconds). A 2-core CI machine is slow to start JupyterLab and kernels.
SERVER_START_TIMEOUT = 120.0
KERNEL_TIMEOUT = 90.0
OUTPUT_TIMEOUT = 60.0
