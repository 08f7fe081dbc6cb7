"""What the memory readers return: typed readings in bytes, and the snapshot that bundles them.

Plain data with no behaviour beyond lookups, so the sampler, the cell tracker, the panel and test
fakes can share it without importing any reader.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["AllocatorReading", "DeviceInfo", "DeviceReading", "HostReading", "Snapshot"]


class AllocatorReading(NamedTuple):
    """PyTorch caching-allocator counters for one CUDA device (index as this process sees it)."""

    device: int
    allocated_bytes: int
    reserved_bytes: int
    active_bytes: int
    inactive_split_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    num_ooms: int
    num_alloc_retries: int
    live_allocations: int = -1  # blocks allocated now (memory_stats "allocation.all.current"); -1: not counted


class DeviceReading(NamedTuple):
    """Whole-device memory from NVML (all processes), for one CUDA device index."""

    device: int
    total_bytes: int
    used_bytes: int
    free_bytes: int
    process_used_bytes: int | None  # this process's own share; None when not asked for or unknown
    # What the driver keeps for itself, which NVML's "used" counts and no process holds (NVML's v2 memory
    # figure, read beside the per-process one); None when not asked for or this driver does not say.
    driver_reserved_bytes: int | None = None
    # What NVML lists for the device's other processes, summed; None when not asked for, or when NVML
    # could not list them or has no figure for one of them.
    others_used_bytes: int | None = None


class HostReading(NamedTuple):
    """This process's resident memory and the machine's memory."""

    rss_bytes: int
    peak_rss_bytes: int  # lifetime maximum RSS of this process (getrusage), exact
    available_bytes: int
    total_bytes: int


class DeviceInfo(NamedTuple):
    """How one CUDA device index maps to the physical GPU that NVML reports."""

    device: int  # CUDA index in this process
    nvml_index: int
    name: str
    uuid: str
    pci_bus_id: str
    total_bytes: int


class Snapshot(NamedTuple):
    """Everything readable at one instant; sources that are unavailable contribute nothing."""

    monotonic_s: float
    wall_time_s: float
    allocator: tuple[AllocatorReading, ...]
    devices: tuple[DeviceReading, ...]
    host: HostReading | None

    def allocator_for(self, device: int) -> AllocatorReading | None:
        for reading in self.allocator:
            if reading.device == device:
                return reading
        return None

    def device_for(self, device: int) -> DeviceReading | None:
        for reading in self.devices:
            if reading.device == device:
                return reading
        return None
