"""PyTorch's caching allocator, simulated segment by segment, for :class:`gpumem.testing.FakeSource`.

The rules are the CUDA caching allocator's (c10/cuda/CUDACachingAllocator.cpp) that decide where
free memory ends up: sizes round up to 512 B; requests of 1 MiB or less come from 2 MiB "small"
segments, larger ones from "large" segments (20 MiB for requests under 10 MiB, else the request
rounded up to 2 MiB); a request takes the smallest free block of its pool that fits (best fit) and
splits off the rest when more than 1 MiB (small pool: 512 B) remains; a freed block merges with free
neighbours; when the device is full the allocator returns every segment with no live block and
retries once (``num_alloc_retries``), then gives up (``num_ooms``). ``empty_cache`` returns the
segments with no live block. Streams, events and ``max_split_size`` are left out.
"""

from __future__ import annotations

from typing import Any

from gpumem.core.units import MIB

__all__ = ["SegmentAllocator"]

_MIN_BLOCK = 512
_SMALL_SIZE = MIB  # largest request served by the small pool
_SMALL_BUFFER = 2 * MIB  # small-pool segment
_LARGE_BUFFER = 20 * MIB  # large-pool segment for requests under _MIN_LARGE_ALLOC
_MIN_LARGE_ALLOC = 10 * MIB
_ROUND_LARGE = 2 * MIB


class _Block:
    __slots__ = ("handle", "requested", "size")

    def __init__(self, size: int, handle: int | None = None, requested: int = 0) -> None:
        self.size = size
        self.handle = handle  # None: free
        self.requested = requested


class _Segment:
    __slots__ = ("address", "blocks", "small")

    def __init__(self, address: int, size: int, small: bool) -> None:
        self.address = address
        self.small = small
        self.blocks = [_Block(size)]

    @property
    def size(self) -> int:
        return sum(block.size for block in self.blocks)

    @property
    def empty(self) -> bool:
        return all(block.handle is None for block in self.blocks)


class SegmentAllocator:
    """One device's segments and blocks. Not thread-safe: the fake source holds its lock around calls."""

    def __init__(self, capacity_bytes: int, device: int = 0) -> None:
        self.capacity_bytes = capacity_bytes  # what cudaMalloc can hand out in all
        self.device = device
        self.segments: list[_Segment] = []
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self._next_address = 1 << 40  # 2 MiB aligned, like the driver's

    # Counters ---------------------------------------------------------------------------------
    @property
    def reserved_bytes(self) -> int:
        return sum(segment.size for segment in self.segments)

    @property
    def allocated_bytes(self) -> int:
        return sum(b.size for s in self.segments for b in s.blocks if b.handle is not None)

    @property
    def inactive_split_bytes(self) -> int:
        """Free bytes in segments cut into more than one block (torch's ``inactive_split_bytes``)."""
        return sum(b.size for s in self.segments if len(s.blocks) > 1 for b in s.blocks if b.handle is None)

    # Allocation -------------------------------------------------------------------------------
    def allocate(self, nbytes: int, handle: int) -> int:
        """Place ``nbytes`` for ``handle``; returns the block's (rounded) size. MemoryError when full."""
        size = max(_MIN_BLOCK, -(-nbytes // _MIN_BLOCK) * _MIN_BLOCK)
        small = size <= _SMALL_SIZE
        found = self._best_fit(size, small)
        if found is None:
            segment = self._new_segment(size, small)
            found = (segment, 0)
        segment, index = found
        block = segment.blocks[index]
        remaining = block.size - size
        if (remaining >= _MIN_BLOCK) if small else (remaining > _SMALL_SIZE):
            segment.blocks[index : index + 1] = [_Block(size), _Block(remaining)]
            block = segment.blocks[index]
        block.handle = handle
        block.requested = nbytes
        return block.size

    def free(self, handle: int) -> int:
        """Free ``handle``'s block, merging it with free neighbours; returns its size."""
        for segment in self.segments:
            for index, block in enumerate(segment.blocks):
                if block.handle == handle:
                    block.handle = None
                    size = block.size
                    self._merge(segment, index)
                    return size
        raise KeyError(handle)

    def empty_cache(self) -> int:
        """Return the segments with no live block; returns the bytes released."""
        released = sum(segment.size for segment in self.segments if segment.empty)
        self.segments = [segment for segment in self.segments if not segment.empty]
        return released

    def _best_fit(self, size: int, small: bool) -> tuple[_Segment, int] | None:
        best: tuple[int, _Segment, int] | None = None
        for segment in self.segments:
            if segment.small != small:
                continue
            for index, block in enumerate(segment.blocks):
                if block.handle is None and block.size >= size and (best is None or block.size < best[0]):
                    best = (block.size, segment, index)
        return None if best is None else (best[1], best[2])

    def _new_segment(self, size: int, small: bool) -> _Segment:
        if small:
            segment_size = _SMALL_BUFFER
        elif size < _MIN_LARGE_ALLOC:
            segment_size = _LARGE_BUFFER
        else:
            segment_size = -(-size // _ROUND_LARGE) * _ROUND_LARGE
        if self.reserved_bytes + segment_size > self.capacity_bytes:
            self.num_alloc_retries += 1  # cudaMalloc failed: free every unused segment and retry once
            self.empty_cache()
            if self.reserved_bytes + segment_size > self.capacity_bytes:
                self.num_ooms += 1
                raise MemoryError(f"fake CUDA out of memory on device {self.device}")
        segment = _Segment(self._next_address, segment_size, small)
        self._next_address += -(-segment_size // _ROUND_LARGE) * _ROUND_LARGE
        self.segments.append(segment)
        return segment

    @staticmethod
    def _merge(segment: _Segment, index: int) -> None:
        blocks = segment.blocks
        if index + 1 < len(blocks) and blocks[index + 1].handle is None:
            blocks[index].size += blocks.pop(index + 1).size
        if index > 0 and blocks[index - 1].handle is None:
            blocks[index - 1].size += blocks.pop(index).size

    # torch.cuda.memory_snapshot() -------------------------------------------------------------
    def snapshot(self) -> list[dict[str, Any]]:
        """The segments in the shape ``torch.cuda.memory_snapshot()`` returns them."""
        segments: list[dict[str, Any]] = []
        for segment in self.segments:
            address = segment.address
            blocks: list[dict[str, Any]] = []
            for block in segment.blocks:
                live = block.handle is not None
                blocks.append(
                    {
                        "address": address,
                        "size": block.size,
                        "requested_size": block.requested if live else 0,
                        "state": "active_allocated" if live else "inactive",
                        "frames": [],
                    }
                )
                address += block.size
            allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
            segments.append(
                {
                    "device": self.device,
                    "address": segment.address,
                    "total_size": segment.size,
                    "allocated_size": allocated,
                    "active_size": allocated,
                    "requested_size": sum(b["requested_size"] for b in blocks),
                    "stream": 0,
                    "segment_type": "small" if segment.small else "large",
                    "segment_pool_id": (0, 0),
                    "is_expandable": False,
                    "frames": [],
                    "blocks": blocks,
                }
            )
        return segments
