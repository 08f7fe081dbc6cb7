"""A promise in the caching allocator's units, from its segments (``torch.cuda.memory_snapshot()``).

To the allocator: each released storage's block, found by its address (a block can be larger than the
storage: 512-byte rounding, or the remainder of a segment too small to split off). To the device: with
``empty_cache`` after the release, every segment of the default pool whose blocks are then all free
(``empty_cache`` returns exactly those; a private pool's, such as a CUDA graph's, stays). Without the
segments (cudaMallocAsync, or too many to read) the blocks are computed from the sizes and nothing is
promised to the device: the promise is then marked inexact.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpumem.core.holders.remainder import block_size
from gpumem.core.holders.tensors import StorageKey
from gpumem.core.readers.allocator_backend import native_allocator
from gpumem.core.reclaim.promises import DeviceBytes

__all__ = ["allocator_promise", "workspace_blocks"]

_DEFAULT_POOL = (0, 0)
Address = tuple[str, int]  # (device name as in StorageKey, address)


def _blocks(segment: Mapping[str, Any]) -> Iterable[tuple[int, int, str]]:
    """``(address, size, state)`` of a segment's blocks (addresses follow each other from the segment's)."""
    address = int(segment.get("address", 0))
    for block in segment.get("blocks", ()):
        size = int(block.get("size", 0))
        yield int(block.get("address", address)), size, str(block.get("state", ""))
        address += size


def _releasable(segment: Mapping[str, Any]) -> bool:
    """``empty_cache`` returns this segment once its blocks are free (default pool, not expandable)."""
    pool = segment.get("segment_pool_id", _DEFAULT_POOL)
    return tuple(pool) == _DEFAULT_POOL and not segment.get("is_expandable", False)


def allocator_promise(
    freed: Mapping[StorageKey, int],
    segments: Sequence[Mapping[str, Any]] | None,
    devices: Sequence[int],
    *,
    extra_blocks: Iterable[Address] = (),
) -> tuple[tuple[DeviceBytes, ...], bool]:
    """Per CUDA device in ``devices``: the blocks of the ``freed`` storages (and of ``extra_blocks``, by
    address), and the segments then wholly free; and whether both are exact."""
    if segments is None:
        return _from_sizes(freed, devices), not any(key[0].startswith("cuda") for key in freed)
    releasing: set[Address] = {(device, address) for device, address, _ in freed}
    releasing.update(extra_blocks)
    allocated = dict.fromkeys(devices, 0)
    reserved = dict.fromkeys(devices, 0)
    matched: set[Address] = set()
    exact = True
    for segment in segments:
        number = int(segment.get("device", 0))
        name = f"cuda:{number}"
        all_free = True
        for address, size, state in _blocks(segment):
            if state == "inactive":
                continue
            if state == "active_allocated" and (name, address) in releasing:
                allocated[number] = allocated.get(number, 0) + size
                matched.add((name, address))
            else:
                all_free = False
        if all_free and _releasable(segment):
            reserved[number] = reserved.get(number, 0) + int(segment.get("total_size", 0))
        elif all_free:
            exact = False  # an expandable or private-pool segment: what empty_cache returns of it is not known
    for device, address, nbytes in freed:
        if device.startswith("cuda") and (device, address) not in matched:
            exact = False  # the storage is not at a block's start (a private pool's tensor, or it just changed)
            number = int(device.partition(":")[2] or 0)
            allocated[number] = allocated.get(number, 0) + block_size(nbytes)
    ordered = sorted(set(allocated) | set(reserved))
    return tuple(DeviceBytes(n, allocated.get(n, 0), reserved.get(n, 0)) for n in ordered), exact


def _from_sizes(freed: Mapping[StorageKey, int], devices: Sequence[int]) -> tuple[DeviceBytes, ...]:
    """Blocks computed from the storage sizes (512-byte multiples on the native allocator), nothing to the device."""
    allocated = dict.fromkeys(devices, 0)
    for device, _, nbytes in freed:
        if device.startswith("cuda"):
            number = int(device.partition(":")[2] or 0)
            allocated[number] = allocated.get(number, 0) + (block_size(nbytes) if native_allocator() else nbytes)
    return tuple(DeviceBytes(n, allocated[n], 0) for n in sorted(allocated))


def workspace_blocks(
    segments: Sequence[Mapping[str, Any]] | None,
    known: Iterable[StorageKey],
    sizes: Mapping[str, tuple[int, ...]],
) -> list[tuple[Address, int]]:
    """Live blocks no known storage starts at whose size is a cuBLAS(Lt) workspace's on that device."""
    if segments is None:
        return []
    starts = {(device, address) for device, address, _ in known}
    found: list[tuple[Address, int]] = []
    for segment in segments:
        name = f"cuda:{int(segment.get('device', 0))}"
        wanted = sizes.get(name, ())
        for address, size, state in _blocks(segment):
            if state == "active_allocated" and size in wanted and (name, address) not in starts:
                found.append(((name, address), size))
    return found
