"""A deterministic memory source for tests and demos: a caching allocator simulated in Python.

It behaves like PyTorch's allocator from the outside (allocated, reserved that only shrinks on
``empty_cache``, peaks that ``reset_peaks`` resets) so the logic above it can be driven exactly.
With ``segments=True`` it also places every block in segments by the caching allocator's rules
(:mod:`gpumem._fake_allocator`), and ``memory_snapshot()`` shows them as torch's does.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

from gpumem._fake_allocator import SegmentAllocator
from gpumem.core.readers.cuda_fault import cuda_faults, healthy, status_text
from gpumem.core.readers.readings import AllocatorReading, DeviceInfo, DeviceReading, HostReading, Snapshot
from gpumem.core.units import GIB, MIB

__all__ = ["GIB", "MIB", "FakeSource"]


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
                dev.segments = SegmentAllocator(total_bytes - context_bytes - other_processes_bytes, index)
        self._ids = itertools.count(1)
        self.context_bytes = context_bytes
        self.other_processes_bytes = other_processes_bytes
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
                if dev.allocated + nbytes > dev.total_bytes - self.context_bytes - self.other_processes_bytes:
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
                    used = own + self.other_processes_bytes
                    devices.append(
                        DeviceReading(
                            device=index,
                            total_bytes=dev.total_bytes,
                            used_bytes=used,
                            free_bytes=dev.total_bytes - used,
                            process_used_bytes=own if process_memory else None,
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
