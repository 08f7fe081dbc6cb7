"""What the CUDA caching allocator makes of a stream of allocations: allocated and reserved bytes.

PyTorch's fake-tensor counting (``MemTracker``) sees each storage's bytes rounded to 512. The real
allocator (``c10/cuda/CUDACachingAllocator.cpp``, native backend, default settings) also:

- serves requests of at most 1 MiB from a small pool of 2 MiB segments, larger ones from a large pool:
  a request under 10 MiB takes a 20 MiB segment, a larger one a segment rounded up to 2 MiB;
- picks the smallest cached free block that fits (best fit), and splits it only when the rest is
  worth keeping: at least 512 B in the small pool, more than 1 MiB in the large pool. An unsplit block
  is handed out whole, and ``memory_allocated`` counts all of it (an 11 MiB tensor in a fresh 12 MiB
  segment counts 12 MiB);
- merges a freed block with free neighbours in its segment, and keeps segments (reserved) until
  ``empty_cache``.

:class:`AllocatorModel` replays allocations and frees under those rules and keeps the peaks. Blocks that
existed before the replay and are freed during it become free blocks of their own size (their
neighbours are unknown), which is what the allocator can reuse at least.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from gpumem.core.units import MIB

__all__ = [
    "BLOCK_BYTES",
    "LARGE_SEGMENT_BYTES",
    "SMALL_REQUEST_BYTES",
    "SMALL_SEGMENT_BYTES",
    "AllocatorModel",
    "round_request",
    "segment_bytes",
]

BLOCK_BYTES = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_REQUEST_BYTES = 1 * MIB  # kSmallSize: requests up to it come from the small pool
SMALL_SEGMENT_BYTES = 2 * MIB  # kSmallBuffer
LARGE_SEGMENT_BYTES = 20 * MIB  # kLargeBuffer, for requests under kMinLargeAlloc
MIN_LARGE_ALLOC_BYTES = 10 * MIB  # kMinLargeAlloc
LARGE_ROUNDING_BYTES = 2 * MIB  # kRoundLarge


def round_request(nbytes: int) -> int:
    """A request's block size: at least 512 B, rounded up to 512 B (``round_size``)."""
    if nbytes < BLOCK_BYTES:
        return BLOCK_BYTES
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


def segment_bytes(block: int) -> int:
    """The segment the allocator reserves (``cudaMalloc``) when no cached block fits ``block`` bytes."""
    if block <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if block < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-block // LARGE_ROUNDING_BYTES) * LARGE_ROUNDING_BYTES


def _is_small(block: int) -> bool:
    return block <= SMALL_REQUEST_BYTES


class _Block:
    """A block of a segment; neighbours linked as in the allocator (``prev``/``next``)."""

    __slots__ = ("free", "next", "offset", "prev", "segment", "size", "small")

    def __init__(self, segment: int, offset: int, size: int, *, free: bool = True, small: bool = False) -> None:
        self.segment = segment  # the segment's number (segments are numbered as reserved)
        self.offset = offset
        self.size = size
        self.free = free
        self.small = small
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


@dataclass
class AllocatorModel:
    """One device's caching allocator, replayed (bytes above what was there when the replay started).

    ``allocated``/``reserved`` are the bytes allocated and reserved by the replay (frees of blocks that
    existed before make ``allocated`` negative); ``peak_allocated``/``peak_reserved`` their highest values.
    """

    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    segments_made: int = 0
    end_allocated: int = 0  # allocated and reserved when the replayed code ended (see keep_end)
    end_reserved: int = 0
    _free: dict[bool, list[tuple[int, int, int]]] = field(default_factory=lambda: {True: [], False: []})
    _where: dict[tuple[int, int, int], _Block] = field(default_factory=dict)  # free blocks by key
    _live: dict[object, _Block] = field(default_factory=dict)  # the caller's key -> its block
    _next_segment: int = 0
    _seeded: dict[int, _Block] = field(default_factory=dict)  # seeded allocated blocks no storage has claimed

    # Requests ---------------------------------------------------------------------------------
    def allocate(self, key: object, nbytes: int) -> int:
        """A storage of ``nbytes`` is allocated under ``key``; returns the bytes counted as allocated."""
        size = round_request(nbytes)
        small = _is_small(size)
        block = self._take_free(size, small)
        if block is None:
            block = self._new_segment(segment_bytes(size), small)
        block = self._split(block, size)
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block.size

    def adopt(self, key: object, nbytes: int) -> None:
        """A storage that existed before the replay: counted as already allocated, in a segment of its own."""
        size = round_request(nbytes)
        number = self._next_segment
        self._next_segment += 1
        self._live[key] = _Block(number, 0, size, free=False, small=_is_small(size))

    def seed(self, segments: list[tuple[int, bool, list[tuple[int, int, bool]]]]) -> None:
        """Start from the real allocator's segments: ``(address, small pool?, [(address, size, free), ...])``
        each, blocks in address order. Free blocks can be reused; the allocated ones are kept until
        :meth:`place` gives one to a storage the replay knows (which may free it)."""
        allocated: dict[int, _Block] = {}
        for _, small, blocks in segments:
            number = self._next_segment
            self._next_segment += 1
            previous: _Block | None = None
            start = blocks[0][0] if blocks else 0
            for address, size, free in blocks:
                block = _Block(number, address - start, size, free=free, small=small)
                block.prev = previous
                if previous is not None:
                    previous.next = block
                previous = block
                if free:
                    self._put_free(block)
                else:
                    allocated[address] = block
        self._seeded = allocated

    def place(self, key: object, address: int) -> bool:
        """The storage under ``key`` (adopted) is the seeded allocated block at ``address``; False if none is."""
        block = self._seeded.pop(address, None)
        if block is None:
            return False
        self._live[key] = block
        return True

    def release(self, key: object) -> None:
        """The storage under ``key`` is freed (unknown keys are ignored)."""
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        self._merge(block)

    def resize(self, key: object, nbytes: int) -> None:
        """A storage changed size (``resize_``): freed and allocated again."""
        self.release(key)
        if nbytes > 0:
            self.allocate(key, nbytes)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: every segment that is one free block is given back."""
        for small in (True, False):
            whole = [self._where[key] for key in self._free[small]]
            for block in whole:
                if block.prev is None and block.next is None and block.offset == 0:
                    self._drop_free(block)
                    self.reserved -= block.size

    def keep_end(self) -> None:
        """Remember the figures now as the end of the replayed code (what is freed later is not its doing)."""
        self.end_allocated, self.end_reserved = self.allocated, self.reserved

    # The pools --------------------------------------------------------------------------------
    def _take_free(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        index = bisect.bisect_left(pool, (size, -1, -1))
        if index == len(pool):
            return None
        return self._where.pop(pool.pop(index))

    def _put_free(self, block: _Block) -> None:
        key = block.key()
        bisect.insort(self._free[block.small], key)
        self._where[key] = block

    def _drop_free(self, block: _Block) -> None:
        key = block.key()
        pool = self._free[block.small]
        index = bisect.bisect_left(pool, key)
        if index < len(pool) and pool[index] == key:
            pool.pop(index)
        self._where.pop(key, None)

    def _new_segment(self, nbytes: int, small: bool) -> _Block:
        number = self._next_segment
        self._next_segment += 1
        self.segments_made += 1
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return _Block(number, 0, nbytes, small=small)

    def _split(self, block: _Block, size: int) -> _Block:
        rest = block.size - size
        keep = rest >= BLOCK_BYTES if block.small else rest > SMALL_REQUEST_BYTES
        if not keep:
            return block
        block.size = size
        remainder = _Block(block.segment, block.offset + size, rest, small=block.small)
        remainder.prev, remainder.next = block, block.next
        if block.next is not None:
            block.next.prev = remainder
        block.next = remainder
        self._put_free(remainder)
        return block

    def _merge(self, block: _Block) -> None:
        after = block.next
        if after is not None and after.free:
            self._drop_free(after)
            block.size += after.size
            block.next = after.next
            if after.next is not None:
                after.next.prev = block
        before = block.prev
        if before is not None and before.free:
            self._drop_free(before)
            before.size += block.size
            before.next = block.next
            if block.next is not None:
                block.next.prev = before
            block = before
        self._put_free(block)
