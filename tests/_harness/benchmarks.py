"""Import a script of ``benchmarks/`` by name, to test its pure helpers (the folder is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from _harness.config import REPO_ROOT


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``name`` (registered, so its own imports of it resolve)."""
    path = REPO_ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
