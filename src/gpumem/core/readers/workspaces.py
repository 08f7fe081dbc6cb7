"""cuBLAS / cuBLASLt workspaces: memory PyTorch allocates for matmuls and keeps, held by no tensor.

The first matmul on a (cuBLAS handle, stream) pair allocates a workspace through the caching allocator
and keeps it until ``torch._C._cuda_clearCublasWorkspaces()``. torch offers no call that reports the
size, so it is computed the way ``aten/src/ATen/cuda/CublasHandlePool.cpp`` chooses it:

- cuBLAS: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KIB:COUNT`` pairs, summed as SIZE * COUNT KiB); unset, 32 MiB
  on compute capability 9.0 (Hopper) and ``:4096:2:16:8`` (8 MiB + 128 KiB) elsewhere; set but not parseable,
  that same default.
- cuBLASLt: ``CUBLASLT_WORKSPACE_SIZE`` in KiB (default 1024), capped at the cuBLAS size unless
  ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` is set false.

The figures are estimates until the allocator's blocks confirm them (:mod:`gpumem.core.holders.remainder`).
cuDNN's workspaces are allocated and freed inside each call, so none is kept between cells.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = [
    "CLEAR_CALL",
    "WorkspaceSizes",
    "clear_cublas_workspaces",
    "cublas_workspace_bytes",
    "cublaslt_workspace_bytes",
    "workspace_sizes",
]

CLEAR_CALL = "torch._C._cuda_clearCublasWorkspaces()"
KIB = 1024
_HOPPER_DEFAULT = 4096 * 8 * KIB  # 32 MiB
_OTHER_DEFAULT = 4096 * KIB * 2 + 16 * KIB * 8  # :4096:2:16:8
_LT_DEFAULT_KIB = 1024
_CONFIG_PAIR = re.compile(r":([0-9]+):([0-9]+)")
_FALSE_WORDS = ("0", "false", "off", "no", "n")


class WorkspaceSizes(NamedTuple):
    """The bytes of one cuBLAS and one cuBLASLt workspace on a device, and how they were chosen."""

    cublas_bytes: int
    cublaslt_bytes: int
    source: str  # e.g. "default for compute capability 9.0", "CUBLAS_WORKSPACE_CONFIG=:4096:8"


def cublas_workspace_bytes(environ: Mapping[str, str], capability: tuple[int, int] | None) -> int:
    """One cuBLAS workspace, as torch computes it from the environment and the device's compute capability."""
    default = _HOPPER_DEFAULT if capability == (9, 0) else _OTHER_DEFAULT
    config = environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config is None:
        return default
    pairs = _CONFIG_PAIR.findall(config)
    if not pairs:
        return default
    return sum(int(size) * KIB * int(count) for size, count in pairs)


def cublaslt_workspace_bytes(environ: Mapping[str, str], cublas_bytes: int) -> int:
    """One cuBLASLt workspace: ``CUBLASLT_WORKSPACE_SIZE`` KiB, capped by the cuBLAS one when unified (the default)."""
    text = environ.get("CUBLASLT_WORKSPACE_SIZE")
    size_kib = _LT_DEFAULT_KIB
    if text is not None:
        match = re.match(r"\s*([+-]?[0-9]+)", text)  # std::stoi reads a leading integer
        if match is not None:
            size_kib = int(match.group(1))
    nbytes = size_kib * KIB
    unified = environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    if unified is None or unified.strip().lower() not in _FALSE_WORDS:
        nbytes = min(nbytes, cublas_bytes)
    return max(nbytes, 0)


def workspace_sizes(device: int = 0, environ: Mapping[str, str] | None = None) -> WorkspaceSizes | None:
    """The workspace sizes on ``device``; None unless torch is imported and CUDA already initialized.

    The device's compute capability is read only then, so this never creates a CUDA context.
    """
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is None or not cuda.is_initialized():
            return None
        capability = tuple(cuda.get_device_capability(device))
    except Exception:
        return None
    environ = os.environ if environ is None else environ
    major, minor = int(capability[0]), int(capability[1])
    cublas = cublas_workspace_bytes(environ, (major, minor))
    config = environ.get("CUBLAS_WORKSPACE_CONFIG")
    source = f"CUBLAS_WORKSPACE_CONFIG={config}" if config is not None else f"default for sm {major}.{minor}"
    return WorkspaceSizes(cublas, cublaslt_workspace_bytes(environ, cublas), source)


def clear_cublas_workspaces(torch: Any) -> bool:
    """Release every cuBLAS(Lt) workspace torch keeps (the next matmul allocates one again); False if not possible."""
    clear = getattr(getattr(torch, "_C", None), "_cuda_clearCublasWorkspaces", None)
    cuda = getattr(torch, "cuda", None)
    if clear is None or cuda is None or not cuda.is_initialized():
        return False
    clear()
    return True
