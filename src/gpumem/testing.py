"""A deterministic memory source for tests and demos: a caching allocator simulated in Python.

It behaves like PyTorch's allocator from the outside (allocated, reserved that only shrinks on
``empty_cache``, peaks that ``reset_peaks`` resets) so the logic above it can be driven exactly.
With ``segments=True`` it also places every block in segments by the caching allocator's rules
(:class:`SegmentAllocator`), and ``memory_snapshot()`` shows them as torch's does.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

from gpumem.core.readers.cuda_fault import cuda_faults, healthy, status_text
from gpumem.core.readers.readings import AllocatorReading, DeviceInfo, DeviceReading, HostReading, Snapshot
from gpumem.core.units import GIB, MIB

__all__ = ["GIB", "MIB", "FakeSource"]


# PyTorch's caching allocator, simulated segment by segment, for ``FakeSource(segments=True)``.
#
# The rules are the CUDA caching allocator's (c10/cuda/CUDACachingAllocator.cpp) that decide where
# free memory ends up: sizes round up to 512 B; requests of 1 MiB or less come from 2 MiB "small"
# segments, larger ones from "large" segments (20 MiB for requests under 10 MiB, else the request
# rounded up to 2 MiB); a request takes the smallest free block of its pool that fits (best fit) and
# splits off the rest when more than 1 MiB (small pool: 512 B) remains; a freed block merges with free
# neighbours; when the device is full the allocator returns every segment with no live block and
# retries once (``num_alloc_retries``), then gives up (``num_ooms``). ``empty_cache`` returns the
# segments with no live block. Streams, events and ``max_split_size`` are left out.
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


class _FakeDevice:
    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.num_ooms = 0
        self.blocks: dict[int, int] = {}
        self.segments: SegmentAllocator | None = None  # set for FakeSource(segments=True)


class FakeSource:
    """Simulated CUDA devices and host; every figure is set by the test that drives it."""

    def __init__(
        self,
        devices: int = 1,
        total_bytes: int = 80 * GIB,
        context_bytes: int = 500 * MIB,
        other_processes_bytes: int = 0,
        driver_bytes: int = 0,
        host_rss_bytes: int = 1 * GIB,
        host_total_bytes: int = 64 * GIB,
        cuda_initialized: bool = True,
        nvml: bool = True,
        segments: bool = False,
    ) -> None:
        self._lock = threading.Lock()
        self._devices = [_FakeDevice(total_bytes) for _ in range(devices)]
        if segments:
            for index, dev in enumerate(self._devices):
                dev.segments = SegmentAllocator(
                    total_bytes - context_bytes - other_processes_bytes - driver_bytes, index
                )
        self._ids = itertools.count(1)
        self.context_bytes = context_bytes
        self.other_processes_bytes = other_processes_bytes
        self.driver_bytes = driver_bytes  # what NVML's v2 figure says the driver keeps (counted in used)
        self.host_rss_bytes = host_rss_bytes
        self.host_peak_rss_bytes = host_rss_bytes
        self.host_total_bytes = host_total_bytes
        self.cuda_initialized = cuda_initialized
        self.nvml = nvml
        self.snapshots_taken = 0

    # Driving the simulation -------------------------------------------------------------------
    def allocate(self, nbytes: int, device: int = 0) -> int:
        """Allocate like the caching allocator (2 MiB granularity for the cache); returns a handle."""
        with self._lock:
            dev = self._devices[device]
            handle = next(self._ids)
            if dev.segments is not None:
                try:
                    dev.blocks[handle] = dev.segments.allocate(nbytes, handle)
                finally:  # a failed request may still have returned unused segments (the retry)
                    dev.allocated = dev.segments.allocated_bytes
                    dev.reserved = dev.segments.reserved_bytes
            else:
                if (
                    dev.allocated + nbytes
                    > dev.total_bytes - self.context_bytes - self.other_processes_bytes - self.driver_bytes
                ):
                    dev.num_ooms += 1
                    raise MemoryError(f"fake CUDA out of memory on device {device}")
                dev.blocks[handle] = nbytes
                dev.allocated += nbytes
                if dev.allocated > dev.reserved:
                    dev.reserved = -(-dev.allocated // (2 * MIB)) * (2 * MIB)
            dev.peak_allocated = max(dev.peak_allocated, dev.allocated)
            dev.peak_reserved = max(dev.peak_reserved, dev.reserved)
            self.cuda_initialized = True
            return handle

    def free(self, handle: int, device: int = 0) -> None:
        with self._lock:
            dev = self._devices[device]
            dev.allocated -= dev.blocks.pop(handle)
            if dev.segments is not None:
                dev.segments.free(handle)

    def transient(self, nbytes: int, device: int = 0) -> None:
        """Allocate and free at once: visible only in the peak counters, never to a sampler."""
        self.free(self.allocate(nbytes, device), device)

    def set_host_rss(self, rss_bytes: int) -> None:
        with self._lock:
            self.host_rss_bytes = rss_bytes
            self.host_peak_rss_bytes = max(self.host_peak_rss_bytes, rss_bytes)

    # MemorySource -----------------------------------------------------------------------------
    def cuda_devices(self) -> tuple[int, ...]:
        return tuple(range(len(self._devices))) if self.cuda_initialized else ()

    def device_count(self) -> int:
        """The simulated devices, known before CUDA is initialized too (as torch.cuda.device_count())."""
        return len(self._devices)

    def snapshot(self, *, process_memory: bool = False) -> Snapshot:
        with self._lock:
            self.snapshots_taken += 1
            allocator: list[AllocatorReading] = []
            devices: list[DeviceReading] = []
            for index, dev in enumerate(self._devices):
                own = (dev.reserved + self.context_bytes) if self.cuda_initialized else 0
                if self.cuda_initialized and healthy([index]):  # as SystemSource: no reading after a CUDA fault
                    allocator.append(
                        AllocatorReading(
                            device=index,
                            allocated_bytes=dev.allocated,
                            reserved_bytes=dev.reserved,
                            active_bytes=dev.allocated,
                            inactive_split_bytes=dev.segments.inactive_split_bytes if dev.segments else 0,
                            peak_allocated_bytes=dev.peak_allocated,
                            peak_reserved_bytes=dev.peak_reserved,
                            num_ooms=dev.segments.num_ooms if dev.segments else dev.num_ooms,
                            num_alloc_retries=dev.segments.num_alloc_retries if dev.segments else 0,
                            live_allocations=len(dev.blocks),
                        )
                    )
                if self.nvml:
                    used = own + self.other_processes_bytes + self.driver_bytes
                    devices.append(
                        DeviceReading(
                            device=index,
                            total_bytes=dev.total_bytes,
                            used_bytes=used,
                            free_bytes=dev.total_bytes - used,
                            process_used_bytes=own if process_memory else None,
                            driver_reserved_bytes=self.driver_bytes if process_memory else None,
                            others_used_bytes=self.other_processes_bytes if process_memory else None,
                        )
                    )
            host = HostReading(
                rss_bytes=self.host_rss_bytes,
                peak_rss_bytes=self.host_peak_rss_bytes,
                available_bytes=self.host_total_bytes - self.host_rss_bytes,
                total_bytes=self.host_total_bytes,
            )
            return Snapshot(time.monotonic(), time.time(), tuple(allocator), tuple(devices), host)

    def device_info(self, device: int) -> DeviceInfo | None:
        if not 0 <= device < len(self._devices):
            return None
        return DeviceInfo(
            device=device,
            nvml_index=device,
            name="Fake GPU",
            uuid=f"GPU-00000000-0000-0000-0000-{device:012d}",
            pci_bus_id=f"00000000:{device + 1:02X}:00.0",
            total_bytes=self._devices[device].total_bytes,
        )

    def reset_peaks(self, devices: Sequence[int]) -> None:
        with self._lock:
            for index in devices:
                dev = self._devices[index]
                dev.peak_allocated = dev.allocated
                dev.peak_reserved = dev.reserved

    def empty_cache(self) -> None:
        faults = cuda_faults()
        if faults:  # as the real one, which would fail again
            raise RuntimeError("; ".join(status_text(fault) for fault in faults.values()))
        with self._lock:
            for dev in self._devices:
                if dev.segments is not None:
                    dev.segments.empty_cache()
                    dev.reserved = dev.segments.reserved_bytes
                else:
                    dev.reserved = -(-dev.allocated // (2 * MIB)) * (2 * MIB)

    def memory_snapshot(self) -> list[dict[str, Any]] | None:
        """Every device's segments as ``torch.cuda.memory_snapshot()`` has them; None without ``segments``."""
        with self._lock:
            if not self.cuda_initialized or any(dev.segments is None for dev in self._devices):
                return None
            return [segment for dev in self._devices if dev.segments for segment in dev.segments.snapshot()]

    def status(self) -> dict[str, str]:
        faults = cuda_faults()
        torch = "ok" if self.cuda_initialized else "unavailable: CUDA is not initialized (fake)"
        if faults and self.cuda_initialized:
            torch = "unavailable: " + "; ".join(status_text(fault) for fault in faults.values())
        return {
            "torch": torch,
            "nvml": "ok" if self.nvml else "unavailable: fake source without NVML",
            "host": "ok",
        }
