"""The figures a CUDA out-of-memory error states, parsed from its message (torch 1.x and 2.x wordings).

PyTorch's caching allocator words it as: "Tried to allocate A. GPU 0 has a total capacity of T of which F
is free. Including non-PyTorch memory, this process has P memory in use. C allowed; Of the allocated
memory X is allocated by PyTorch, and Y is reserved by PyTorch but unallocated." The "C allowed" part is
there only under ``torch.cuda.set_per_process_memory_fraction``: C is the process's cap, and the
allocator refused because its reserve plus the request would pass C, whatever the device has free.
"""

from __future__ import annotations

import re
import sys
from typing import NamedTuple

__all__ = ["OomFigures", "find_oom_error", "parse_oom_message"]


class OomFigures(NamedTuple):
    """An out-of-memory error's figures: parsed from its message (None where it does not say), or, in an
    :class:`~gpumem.core.diagnoses.oom.OomReport`, the observer's and the allocator's with the message's."""

    device: int | None
    requested_bytes: int | None
    device_total_bytes: int | None
    device_free_bytes: int | None
    process_bytes: int | None
    allocated_bytes: int | None
    reserved_unallocated_bytes: int | None
    allowed_bytes: int | None = None  # the process's cap (set_per_process_memory_fraction), when one is set



_UNIT_BYTES = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "PiB": 1 << 50}
_SIZE = r"([\d.]+)\s*(bytes|B|KiB|MiB|GiB|TiB|PiB)"  # torch writes sizes up to 1 KiB as "N bytes"
_PATTERNS: dict[str, tuple[re.Pattern[str], ...]] = {
    "requested": (re.compile(r"Tried to allocate " + _SIZE),),
    "total": (re.compile(r"total capacity of " + _SIZE), re.compile(_SIZE + r" total capacity")),
    "free": (re.compile(r"of which " + _SIZE + r" is free"), re.compile(_SIZE + r" free;")),
    "process": (re.compile(r"this process has " + _SIZE + r" memory in use"),),
    "allocated": (re.compile(_SIZE + r" is allocated by PyTorch"), re.compile(_SIZE + r" already allocated")),
    "unallocated": (re.compile(_SIZE + r" is reserved by PyTorch but unallocated"),),
    "reserved_total": (re.compile(_SIZE + r" reserved in total by PyTorch"),),
    "allowed": (re.compile(_SIZE + r" allowed;"),),
}
_GPU = re.compile(r"GPU (\d+)")


def _size(text: str, key: str) -> int | None:
    for pattern in _PATTERNS[key]:
        match = pattern.search(text)
        if match is not None:
            try:
                return int(float(match.group(1)) * _UNIT_BYTES[match.group(2)])
            except ValueError:
                return None
    return None


def parse_oom_message(message: str) -> OomFigures:
    """Figures from a CUDA out-of-memory message (torch 1.x and 2.x wordings)."""
    gpu = _GPU.search(message)
    allocated = _size(message, "allocated")
    unallocated = _size(message, "unallocated")
    if unallocated is None:
        reserved_total = _size(message, "reserved_total")
        if reserved_total is not None and allocated is not None:
            unallocated = max(0, reserved_total - allocated)
    return OomFigures(
        device=int(gpu.group(1)) if gpu else None,
        requested_bytes=_size(message, "requested"),
        device_total_bytes=_size(message, "total"),
        device_free_bytes=_size(message, "free"),
        process_bytes=_size(message, "process"),
        allocated_bytes=allocated,
        reserved_unallocated_bytes=unallocated,
        allowed_bytes=_size(message, "allowed"),
    )


_MAX_CHAIN = 32  # causes and contexts followed at most (a chain can loop)


def find_oom_error(error: BaseException | None) -> BaseException | None:
    """The CUDA out-of-memory error in ``error`` or its cause / context chain, else None."""
    torch = sys.modules.get("torch")
    oom_types: tuple[type, ...] = tuple(
        t
        for t in (
            getattr(torch, "OutOfMemoryError", None),
            getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None),
        )
        if isinstance(t, type)
    )
    seen: set[int] = set()
    current = error
    while current is not None and id(current) not in seen and len(seen) < _MAX_CHAIN:
        seen.add(id(current))
        if oom_types and isinstance(current, oom_types):
            return current
        if isinstance(current, RuntimeError) and "CUDA out of memory" in str(current):
            return current
        current = current.__cause__ or current.__context__
    return None
