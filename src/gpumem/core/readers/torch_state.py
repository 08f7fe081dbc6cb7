"""Which case torch is in here, in one place: every "why no CUDA figures" message is built from it.

The cases, in the order they are checked: not installed, installed but not imported yet (gpumem never
imports torch: that costs seconds), a CPU-only build, a CUDA build that sees no device, CUDA not
initialized yet, and ready. Nothing here creates a CUDA context: before initialization the device count
comes from ``torch.cuda.device_count()``, which asks NVML (or cudaGetDeviceCount) and creates none.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from enum import Enum
from typing import Any, NamedTuple

__all__ = ["TorchCase", "TorchState", "cuda_device_count", "no_device_reason", "no_torch_reason", "torch_state"]


class TorchCase(Enum):
    NOT_INSTALLED = "not installed"
    NOT_IMPORTED = "not imported"
    CPU_BUILD = "CPU-only build"
    NO_DEVICE = "no CUDA device"
    NOT_INITIALIZED = "CUDA not initialized"
    READY = "ready"


class TorchState(NamedTuple):
    """The case and, unless ready, why there are no CUDA figures, as a phrase to put after a colon."""

    case: TorchCase
    reason: str | None
    device_count: int | None  # CUDA devices visible to this process; None when it cannot be known here


def _installed() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a broken or half-removed install
        return False


class _CountCache:
    """Before CUDA is initialized torch does not cache the count (NVML is asked each time): we do, per
    process and CUDA_VISIBLE_DEVICES, since the panel asks for the status a few times a second."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.key: tuple[int, str | None, int] | None = None
        self.count = 0


_cache = _CountCache()


def _device_count(torch: Any) -> int | None:
    cuda: Any = getattr(torch, "cuda", None)
    count = getattr(cuda, "device_count", None)
    if cuda is None or count is None:
        return None
    if cuda.is_initialized():
        return int(count())  # torch caches it once initialized
    key = (os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES"), id(torch))
    with _cache.lock:
        if _cache.key == key:
            return _cache.count
    try:
        found = int(count())
    except Exception:
        return None
    with _cache.lock:
        _cache.key, _cache.count = key, found
    return found


def torch_state() -> TorchState:
    """The case torch is in now; cheap enough for a status line pushed a few times a second."""
    torch = sys.modules.get("torch")
    if torch is None:
        if not _installed():
            return TorchState(TorchCase.NOT_INSTALLED, "torch is not installed in this Python environment", 0)
        return TorchState(
            TorchCase.NOT_IMPORTED,
            "torch is installed but not imported in this process yet (gpumem never imports it; `import torch` does)",
            None,
        )
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not hasattr(cuda, "is_initialized"):
        return TorchState(TorchCase.NOT_IMPORTED, "torch is still being imported (torch.cuda is not there yet)", None)
    if cuda.is_initialized():
        return TorchState(TorchCase.READY, None, _device_count(torch))
    if not getattr(getattr(torch, "version", None), "cuda", None):
        version = getattr(torch, "__version__", "?")
        return TorchState(TorchCase.CPU_BUILD, f"this torch ({version}) is a CPU-only build, without CUDA", 0)
    count = _device_count(torch)
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "no NVIDIA driver or GPU?"
        return TorchState(
            TorchCase.NO_DEVICE, f"this torch is built with CUDA {torch.version.cuda} but sees no device ({hidden})", 0
        )
    return TorchState(
        TorchCase.NOT_INITIALIZED,
        "CUDA is not initialized in this process yet (no tensor has been put on a GPU)",
        count,
    )


def cuda_device_count() -> int | None:
    """The CUDA devices this process can use, without creating a context; None when torch is not imported."""
    return torch_state().device_count


def no_device_reason() -> str:
    """Why there is no CUDA device to speak of, for "no CUDA device here (...)"."""
    state = torch_state()
    return state.reason or "torch sees no CUDA device"


def no_torch_reason(to_do: str) -> str:
    """Why torch cannot be used when it is not in ``sys.modules``: not installed here, or not imported yet
    (then: import it in an earlier cell to ``to_do``, e.g. "trace this one")."""
    if not _installed():
        return "PyTorch is not installed in this Python environment"
    return f"PyTorch is not imported (import torch in an earlier cell to {to_do})"
