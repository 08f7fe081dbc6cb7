"""Lookups several features share: the running IPython shell, and which source to read by default."""

from __future__ import annotations

import sys
from typing import Any

from .sources import MemorySource

__all__ = ["cuda_source", "ipython_shell"]


def ipython_shell() -> Any:
    """The running IPython shell, or None; IPython is never imported just to ask."""
    if "IPython" not in sys.modules:
        return None
    try:
        from IPython import get_ipython
    except Exception:
        return None
    return get_ipython()


def cuda_source(source: MemorySource | None) -> MemorySource | None:
    """``source`` itself, else the shared monitor's once the user's code initialized CUDA (else None)."""
    if source is not None:
        return source
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return None
    from .monitor import default_monitor

    return default_monitor().source
