"""Fragmentation, measured: how much of PyTorch's free reserve a request can actually use.

The caching allocator's counters say how much is reserved but unallocated (the free reserve), not in
what pieces. ``inactive_split_bytes`` is no measure of waste either: one free 1.9 GiB block left in a
2 GiB segment with a live tensor counts in full, yet any request up to 1.9 GiB uses it. The truth is
in the allocator's segments and blocks (``torch.cuda.memory_snapshot()``): a request larger than the
largest free block cannot be served from the reserve; ``empty_cache()`` (and the allocator itself,
when ``cudaMalloc`` fails) returns only segments with no live block, so free pieces that share a
segment with a live tensor are stranded until that tensor goes.

:func:`free_reserve` turns a snapshot's segment list into a :class:`FreeReserve` per device (pure);
:func:`worth_a_look` decides from the cheap counters whether to read a snapshot at all;
:class:`ReserveReader` reads one lazily, never initializing CUDA, and remembers the answer while the
counters stay the same. torch is never imported here, only looked up in ``sys.modules``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from gpumem.core.readers.allocator_backend import native_allocator
from gpumem.core.readers.cuda_fault import cuda_faults
from gpumem.core.readers.sources import AllocatorReading, SystemSource, TorchAllocatorSource
from gpumem.core.units import GIB, MIB, format_bytes

__all__ = [
    "FRAGMENTED_BYTES",
    "FreeReserve",
    "ReserveReader",
    "allocator_counters",
    "empty_cache_advice",
    "expandable_segments_advice",
    "expandable_segments_on",
    "fragmentation_text",
    "free_reserve",
    "worth_a_look",
]

FRAGMENTED_BYTES = GIB  # unusable free reserve below this is not worth a warning
_LOOK_SHARE = 4  # read the segments only when at least a quarter of the reserve is free (or a retry happened)
_PAGE = 2 * MIB  # expandable segments map and unmap memory in pages of this size
_FREE = "inactive"
_ALLOCATED = "active_allocated"
_ENV_LINE = "%env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


class FreeReserve(NamedTuple):
    """One device's free reserve, from the allocator's segments (bytes; pieces are free blocks)."""

    device: int
    reserved_bytes: int  # all segments
    allocated_bytes: int  # blocks in use by tensors
    free_bytes: int  # free ("inactive") blocks: the free reserve
    pending_free_bytes: int  # freed, waiting for another stream's work (usable soon, not now)
    pieces: int  # free blocks
    largest_free_bytes: int  # largest free block a request above 1 MiB can use (large pool)
    releasable_bytes: int  # what torch.cuda.empty_cache() would return now
    stranded_bytes: int  # free bytes in segments that also hold a live block: empty_cache cannot return them
    unusable_bytes: int  # stranded bytes outside the largest stranded block: wasted for any larger request
    expandable: bool  # the segments are expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)

    @property
    def fragmented(self) -> bool:
        """Much of the free reserve is stranded in pieces no larger request can use, and the largest
        free block does not cover most of it."""
        return self.unusable_bytes >= FRAGMENTED_BYTES and 2 * self.unusable_bytes >= self.free_bytes


class _Tally:
    """Running sums for one device while its segments are read."""

    def __init__(self) -> None:
        self.reserved = self.allocated = self.free = self.pending = self.pieces = 0
        self.largest = self.releasable = self.stranded = self.largest_stranded = 0
        self.expandable = False

    def add(self, segment: Mapping[str, Any]) -> None:
        blocks = [block for block in _list(segment.get("blocks")) if isinstance(block, Mapping)]
        large = segment.get("segment_type", "large") != "small"
        expandable = bool(segment.get("is_expandable", False))
        self.expandable = self.expandable or expandable
        self.reserved += _int(segment.get("total_size"))
        free_sizes: list[int] = []
        live = False
        for block in blocks:
            size = _int(block.get("size"))
            state = block.get("state")
            if state == _FREE:
                free_sizes.append(size)
            elif state == _ALLOCATED:
                self.allocated += size
                live = True
            else:  # pending free: not usable yet, and empty_cache first waits for it
                self.pending += size
        self.free += sum(free_sizes)
        self.pieces += len(free_sizes)
        if large and free_sizes:
            self.largest = max(self.largest, *free_sizes)
        if expandable:
            # empty_cache unmaps every whole page of every free block of an expandable segment.
            self.releasable += sum(_whole_pages(block) for block in blocks if block.get("state") == _FREE)
        elif not live:
            self.releasable += sum(free_sizes)
        else:
            self.stranded += sum(free_sizes)
            if large and free_sizes:
                self.largest_stranded = max(self.largest_stranded, *free_sizes)

    def result(self, device: int) -> FreeReserve:
        return FreeReserve(
            device=device,
            reserved_bytes=self.reserved,
            allocated_bytes=self.allocated,
            free_bytes=self.free,
            pending_free_bytes=self.pending,
            pieces=self.pieces,
            largest_free_bytes=self.largest,
            releasable_bytes=self.releasable,
            stranded_bytes=self.stranded,
            unusable_bytes=self.stranded - self.largest_stranded,
            expandable=self.expandable,
        )


def free_reserve(segments: Iterable[Any]) -> dict[int, FreeReserve]:
    """Per device, the free reserve of a ``torch.cuda.memory_snapshot()`` segment list."""
    tallies: dict[int, _Tally] = {}
    for segment in segments:
        if not isinstance(segment, Mapping):
            continue
        tallies.setdefault(_int(segment.get("device")), _Tally()).add(segment)
    return {device: tally.result(device) for device, tally in sorted(tallies.items())}


def _whole_pages(block: Mapping[str, Any]) -> int:
    size = _int(block.get("size"))
    address = block.get("address")
    if not isinstance(address, int):
        return size // _PAGE * _PAGE
    start = -(-address // _PAGE) * _PAGE
    end = (address + size) // _PAGE * _PAGE
    return max(0, end - start)


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _list(value: Any) -> Sequence[Any]:
    return value if isinstance(value, (list, tuple)) else ()


# ----------------------------------------------------------------------------------------------
# When to look, and the reader
# ----------------------------------------------------------------------------------------------


def worth_a_look(start: AllocatorReading | None, end: AllocatorReading) -> bool:
    """Whether the counters allow fragmentation: a large free reserve, or an allocation in between
    that had to free the cache and retry, or failed. Costs a few comparisons, no call into torch.
    Never under cudaMallocAsync: CUDA's pool has none of PyTorch's segments to fragment."""
    if not native_allocator():
        return False
    if start is not None and (end.num_alloc_retries > start.num_alloc_retries or end.num_ooms > start.num_ooms):
        return True
    free = end.reserved_bytes - end.allocated_bytes
    return free >= FRAGMENTED_BYTES and free * _LOOK_SHARE >= end.reserved_bytes


def allocator_counters(reading: AllocatorReading) -> tuple[int, ...]:
    """The counters that change whenever the allocator's blocks do (peaks left out: the tracker resets them)."""
    return (
        reading.reserved_bytes,
        reading.allocated_bytes,
        reading.active_bytes,
        reading.inactive_split_bytes,
        reading.num_alloc_retries,
        reading.num_ooms,
    )


class ReserveReader:
    """Reads the allocator's segments when asked, for the devices asked; remembers each device's answer
    while its counters are unchanged, so cells that leave the allocator alone cost no snapshot.

    ``source`` is the memory source the counters came from: a real one (:class:`SystemSource`) is
    read through torch, a fake one through its own ``memory_snapshot()``; any other gives nothing.
    """

    def __init__(self) -> None:
        self.reads = 0  # snapshots taken (for tests and benchmarks)
        self._known: dict[int, tuple[tuple[int, ...], FreeReserve | None]] = {}

    def read(self, source: Any, readings: Sequence[AllocatorReading]) -> dict[int, FreeReserve]:
        """The free reserve of each device in ``readings`` (counters from ``source``) that the segments describe."""
        found: dict[int, FreeReserve] = {}
        missing: list[AllocatorReading] = []
        for reading in readings:
            known = self._known.get(reading.device)
            if known is not None and known[0] == allocator_counters(reading):
                if known[1] is not None:
                    found[reading.device] = known[1]
            else:
                missing.append(reading)
        if not missing:
            return found
        segments = read_segments(source)
        if segments is None:
            return found
        self.reads += 1
        fresh = free_reserve(segments)
        for reading in missing:
            reserve = fresh.get(reading.device)
            self._known[reading.device] = (allocator_counters(reading), reserve)
            if reserve is not None:
                found[reading.device] = reserve
        return found

    def forget(self) -> None:
        self._known.clear()


def read_segments(source: Any) -> list[Any] | None:
    """The allocator's segments (all devices), or None when they cannot be read without side effects, or
    when CUDA's pool allocates (cudaMallocAsync: no segments, so nothing to say about fragmentation)."""
    if not native_allocator() or cuda_faults():  # no CUDA call after a sticky CUDA error either
        return None
    own = getattr(source, "memory_snapshot", None)
    if callable(own):
        try:
            segments = own()
        except Exception:
            return None
        return list(segments) if isinstance(segments, (list, tuple)) else None
    if not isinstance(source, (SystemSource, TorchAllocatorSource)):
        return None
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not callable(getattr(cuda, "is_initialized", None)) or not cuda.is_initialized():
        return None  # never the one to initialize CUDA
    try:
        try:
            segments = cuda.memory_snapshot(include_traces=False)  # torch >= 2.10: no trace entries
        except TypeError:
            segments = cuda.memory_snapshot()
    except Exception:
        return None
    return list(segments) if isinstance(segments, (list, tuple)) else None


# ----------------------------------------------------------------------------------------------
# What to say
# ----------------------------------------------------------------------------------------------


def expandable_segments_on() -> bool:
    """Whether this process asked for expandable segments (the variable torch read at CUDA start)."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        value = os.environ.get(name, "").replace(" ", "").lower()
        if "expandable_segments:true" in value:
            return True
    return False


def expandable_segments_advice(variable: str = "PYTORCH_CUDA_ALLOC_CONF") -> str:
    """How to avoid fragmentation in the next kernel (the allocator reads the setting once, at CUDA start)."""
    return (
        f"for the next kernel, set {variable}=expandable_segments:True before torch initializes CUDA: "
        f"`{_ENV_LINE.replace('PYTORCH_CUDA_ALLOC_CONF', variable)}` in the first cell, or "
        f'os.environ["{variable}"] = "expandable_segments:True" before `import torch`'
    )


def empty_cache_advice(reserve: FreeReserve) -> str:
    """What ``%gpumem free`` (torch.cuda.empty_cache()) would give back of the free reserve, said truly."""
    if reserve.releasable_bytes > 0:
        return (
            f"`%gpumem free` (torch.cuda.empty_cache()) returns {format_bytes(reserve.releasable_bytes)} of it "
            "to the device now (the segments no tensor uses)"
        )
    return (
        "`%gpumem free` (torch.cuda.empty_cache()) would return none of it: every free piece shares a segment "
        "with a live tensor, and goes back only when those tensors are deleted"
    )


def fragmentation_text(reserve: FreeReserve) -> str:
    """The figures: the free reserve, in how many pieces, and the largest request it can serve."""
    pieces = f"{reserve.pieces:,} piece{'' if reserve.pieces == 1 else 's'}"
    free, reserved = format_bytes(reserve.free_bytes), format_bytes(reserve.reserved_bytes)
    head = f"{free} of the {reserved} reserved is free but in {pieces}"
    if reserve.largest_free_bytes == 0:
        return f"{head}, all of them for requests of 1 MiB or less: a larger request cannot use any of it"
    largest = format_bytes(reserve.largest_free_bytes)
    return f"{head}, the largest {largest}: a request above {largest} cannot use any of it"
