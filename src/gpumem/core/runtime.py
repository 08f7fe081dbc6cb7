"""Lookups several features share: the running IPython shell, and which source to read by default."""

from __future__ import annotations

import sys
from typing import Any

from gpumem.core.readers.sources import MemorySource

__all__ = ["cuda_source", "ipython_shell"]


def ipython_shell() -> Any:
    """The running IPython shell, or None; core never imports IPython, it only asks one already imported."""
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    if get_ipython is None:
        return None
    try:
        return get_ipython()
    except Exception:
        return None


def cuda_source(source: MemorySource | None) -> MemorySource | None:
    """``source`` itself, else the shared monitor's once the user's code initialized CUDA (else None)."""
    if source is not None:
        return source
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return None
    from gpumem.core.monitoring.monitor import default_monitor

    return default_monitor().source
