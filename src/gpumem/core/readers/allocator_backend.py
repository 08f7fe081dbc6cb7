"""Which CUDA allocator PyTorch uses in this process, and the settings it read: one place for both.

PyTorch picks its CUDA allocator once, as it loads, from ``PYTORCH_ALLOC_CONF`` (or the older
``PYTORCH_CUDA_ALLOC_CONF``): its own caching allocator (``native``: large and small pools,
segments, 512 B rounding, ``memory_snapshot()``, allocation history) or CUDA's stream-ordered one
(``backend:cudaMallocAsync``), for which only the allocated and reserved counters and their peaks
mean anything. Everything gpumem says about pools, segments, rounding, fragmentation or allocation
sites asks :func:`native_allocator` first.

``torch.cuda.get_allocator_backend()`` names the allocator chosen at load time and creates no CUDA
context (it asks the allocator object, which exists before CUDA starts). Its answer, and the setting
as it was then, are kept once per process; before torch is imported (or in a build without CUDA) the
setting is read from the environment each time, since it can still change.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from typing import NamedTuple

__all__ = [
    "ASYNC",
    "NATIVE",
    "AllocatorBackend",
    "allocator_backend",
    "allocator_line",
    "native_allocator",
    "not_native_reason",
    "parse_alloc_conf",
]

NATIVE = "native"
ASYNC = "cudaMallocAsync"
_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # the first set wins, as in PyTorch


class AllocatorBackend(NamedTuple):
    """The allocator in use and the setting it was chosen from."""

    name: str  # "native" or "cudaMallocAsync" (or whatever a later PyTorch names)
    variable: str | None  # the environment variable that set it; None when none was set
    setting: str | None  # that variable's value
    from_torch: bool  # torch.cuda.get_allocator_backend() said so (else: read from the environment)

    @property
    def native(self) -> bool:
        return self.name == NATIVE

    @property
    def title(self) -> str:
        """How a report names the allocator."""
        if self.native:
            return "PyTorch's caching allocator"
        if self.name == ASYNC:
            return "CUDA's stream-ordered allocator, cudaMallocAsync"
        return f"the {self.name} allocator"


def parse_alloc_conf(value: str) -> dict[str, str]:
    """``"backend:cudaMallocAsync,expandable_segments:True"`` -> ``{"backend": ..., ...}`` (keys lower-case)."""
    found: dict[str, str] = {}
    for part in value.split(","):
        key, _, setting = part.partition(":")
        if key.strip():
            found[key.strip().lower()] = setting.strip()
    return found


def _setting(environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    for variable in _VARIABLES:
        value = environ.get(variable)
        if value is not None:
            return variable, value
    return None, None


def _from_environment(environ: Mapping[str, str]) -> AllocatorBackend:
    variable, value = _setting(environ)
    backend = parse_alloc_conf(value or "").get("backend", NATIVE) or NATIVE
    return AllocatorBackend(ASYNC if backend.lower() == ASYNC.lower() else backend, variable, value, from_torch=False)


class _Cache:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = -1
        self.found: AllocatorBackend | None = None


_cache = _Cache()


def allocator_backend(environ: Mapping[str, str] | None = None) -> AllocatorBackend:
    """The allocator in use: torch's answer once torch is imported (kept for the process), else the environment's."""
    if environ is not None:
        return _from_environment(environ)
    pid = os.getpid()
    with _cache.lock:
        if _cache.pid == pid and _cache.found is not None:
            return _cache.found
    torch = sys.modules.get("torch")
    ask = getattr(getattr(torch, "_C", None), "_cuda_getAllocatorBackend", None)
    fallback = _from_environment(os.environ)
    if not callable(ask):
        return fallback  # no torch yet, or no CUDA in it: the setting may still change
    try:
        name = str(ask())
    except Exception:
        return fallback
    found = AllocatorBackend(name, fallback.variable, fallback.setting, from_torch=True)
    with _cache.lock:
        _cache.pid, _cache.found = pid, found
    return found


def native_allocator() -> bool:
    """Whether PyTorch's own caching allocator is in use (pools, segments, snapshots, history)."""
    return allocator_backend().native


def not_native_reason(what: str) -> str | None:
    """Why ``what`` (e.g. "allocation sites") cannot be had, in one sentence with the way out; None if it can."""
    backend = allocator_backend()
    if backend.native:
        return None
    variable = backend.variable or "PYTORCH_CUDA_ALLOC_CONF"
    return (
        f"{what} need PyTorch's native caching allocator, and this process uses {backend.title} "
        f"({variable}={backend.setting}): restart the kernel with {variable} unset or set to backend:native"
    )


def allocator_line() -> str:
    """For ``%gpumem status``: the allocator and the settings in force."""
    backend = allocator_backend()
    if backend.variable is None:
        settings = "PyTorch's defaults (PYTORCH_CUDA_ALLOC_CONF is not set)"
    else:
        settings = f"{backend.variable}={backend.setting}"
    known = "" if backend.from_torch else " (read from the environment)"
    return f"{backend.title}{known}; settings: {settings}"
