"""Name the remainder: ``memory_allocated`` minus what the rows count, split into what can be known.

The parts: tensors saved by the autograd graphs of named tensors, cuBLAS(Lt) workspaces, the allocator's
rounding (every block is a multiple of 512 bytes), and the rest, unexplained. With the allocator's
blocks (``torch.cuda.memory_snapshot()``, no history needed) the split is exact: a block whose address is
a known storage's gives that storage's rounding, a block no storage starts at whose size is a workspace's
is a workspace, and the other unmatched blocks are the unexplained rest. Without the blocks, rounding is
computed from the storage sizes (exact under the default allocator settings) and workspaces are an
estimate: whole workspaces that fit in what is left.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

from gpumem.core.holders.tensors import StorageKey
from gpumem.core.readers.allocator_backend import native_allocator
from gpumem.core.readers.cuda_fault import cuda_faults
from gpumem.core.readers.workspaces import WorkspaceSizes

__all__ = ["BLOCK_BYTES", "Block", "Remainder", "allocator_blocks", "block_size", "split_remainder"]

BLOCK_BYTES = 512  # the caching allocator's smallest block and rounding unit

# One allocated block: (device name as in StorageKey, address, size in bytes).
Block = tuple[str, int, int]


class Remainder(NamedTuple):
    """``allocated_bytes`` minus the named and IPython-held rows, split; every part is bytes."""

    allocated_bytes: int
    graph_saved_bytes: int  # storages only autograd graphs of named tensors keep (exact)
    workspace_bytes: int
    workspace_count: int
    workspace_each_bytes: int  # one cuBLAS workspace (0 when unknown)
    workspaces_confirmed: bool  # True: matched against the allocator's blocks; False: an estimate
    rounding_bytes: int
    unexplained_bytes: int
    unexplained_blocks: int | None  # allocated blocks no storage starts at; None without the blocks
    blocks_read: bool  # the split came from the allocator's blocks (exact) rather than from sizes
    workspace_source: str = ""  # how the workspace size was chosen (env var or default)


def block_size(nbytes: int) -> int:
    """The block the caching allocator hands out for ``nbytes`` (default settings): 512-byte multiples."""
    if nbytes < BLOCK_BYTES:
        return BLOCK_BYTES
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


def split_remainder(
    allocated: int,
    counted: Mapping[StorageKey, int],
    graph_saved: Mapping[StorageKey, int],
    *,
    sizes: Mapping[str, WorkspaceSizes],
    blocks: list[Block] | None,
) -> Remainder:
    """Split ``allocated - sum(counted) - sum(graph_saved)``.

    ``counted`` are the storages in rows (named and IPython-held), ``graph_saved`` those only graphs
    keep; ``sizes`` the workspace sizes per device name (``"cuda:0"``); ``blocks`` the allocated blocks,
    or None when they could not be read.
    """
    saved_total = sum(graph_saved.values())
    rest = allocated - sum(counted.values()) - saved_total
    if blocks is not None:
        return _split_with_blocks(allocated, {**counted, **graph_saved}, saved_total, sizes, blocks)
    rounding = 0  # cudaMallocAsync counts what was asked for: no 512-byte blocks to round to
    if native_allocator():
        rounding = sum(block_size(nbytes) - nbytes for nbytes in (*counted.values(), *graph_saved.values()))
        rounding = min(rounding, max(rest, 0))
    first = next(iter(sizes.values()), None)
    each = first.cublas_bytes if first is not None else 0
    count = (rest - rounding) // each if each and rest - rounding >= each else 0
    return Remainder(
        allocated_bytes=allocated,
        graph_saved_bytes=saved_total,
        workspace_bytes=count * each,
        workspace_count=count,
        workspace_each_bytes=each,
        workspaces_confirmed=False,
        rounding_bytes=rounding,
        unexplained_bytes=rest - rounding - count * each,
        unexplained_blocks=None,
        blocks_read=False,
        workspace_source=first.source if first is not None else "",
    )


def _split_with_blocks(
    allocated: int,
    storages: Mapping[StorageKey, int],
    saved_total: int,
    sizes: Mapping[str, WorkspaceSizes],
    blocks: list[Block],
) -> Remainder:
    by_start = {(device, address): size for device, address, size in blocks}
    rounding = 0
    for (device, address, _), nbytes in storages.items():
        size = by_start.pop((device, address), None)
        if size is not None and size >= nbytes:
            rounding += size - nbytes
    workspace_bytes = workspace_count = unmatched = unmatched_bytes = 0
    for (device, _), size in by_start.items():
        known = sizes.get(device)
        if known is not None and size in (known.cublas_bytes, known.cublaslt_bytes):
            workspace_bytes += size
            workspace_count += 1
        else:
            unmatched += 1
            unmatched_bytes += size
    first = next(iter(sizes.values()), None)
    return Remainder(
        allocated_bytes=allocated,
        graph_saved_bytes=saved_total,
        workspace_bytes=workspace_bytes,
        workspace_count=workspace_count,
        workspace_each_bytes=first.cublas_bytes if first is not None else 0,
        workspaces_confirmed=True,
        rounding_bytes=rounding,
        unexplained_bytes=unmatched_bytes,  # exact: the blocks no known storage starts at
        unexplained_blocks=unmatched,
        blocks_read=True,
        workspace_source=first.source if first is not None else "",
    )


# torch.cuda.memory_snapshot() costs about 3 us per segment on an H200 (16 ms for 5,349); past this many the
# remainder is split from sizes instead, so `who` stays within its 20 ms.
MAX_SEGMENTS_READ = 1_000


def _segment_count(torch: Any, device_numbers: tuple[int, ...]) -> int:
    """Segments the allocator holds on those devices, from its cheap counters (12 us a device)."""
    stats = getattr(getattr(torch, "_C", None), "_cuda_memoryStats", None)
    total = 0
    for number in device_numbers:
        if stats is not None:
            total += int(stats(number)["segment"]["all"]["current"])
        else:
            total += int(torch.cuda.memory_stats(number).get("segment.all.current", 0))
    return total


def allocator_blocks(device_numbers: tuple[int, ...]) -> list[Block] | None:
    """The allocated blocks on those CUDA devices from ``torch.cuda.memory_snapshot()``; None if unreadable.

    Read only once CUDA is initialized (the snapshot would not create a context, but there is nothing to read).
    """
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is None or not cuda.is_initialized() or not native_allocator() or cuda_faults():
            return None  # cudaMallocAsync keeps no blocks of its own: memory_snapshot() raises
        if _segment_count(torch, device_numbers) > MAX_SEGMENTS_READ:
            return None  # the snapshot would cost tens of ms: the split is then an estimate, and says so
        segments: list[dict[str, Any]] = cuda.memory_snapshot()
    except Exception:
        return None
    wanted = set(device_numbers)
    found: list[Block] = []
    for segment in segments:
        device = int(segment.get("device", 0))
        if device not in wanted:
            continue
        address = int(segment.get("address", 0))
        for block in segment.get("blocks", ()):
            size = int(block.get("size", 0))
            if block.get("state") == "active_allocated":
                found.append((f"cuda:{device}", int(block.get("address", address)), size))
            address += size
    return found
