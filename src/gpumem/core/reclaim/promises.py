"""What a reclaim action promises before it runs, and what it measured after.

A promise is counted in the allocator's own units: the blocks the released storages occupy (to the
allocator, ``memory_allocated`` falls by that much) and the segments that are then wholly free (to the
device: ``empty_cache`` returns them, ``memory_reserved`` falls by that much). A storage that anything
else still reaches (another name, another of IPython's references, an autograd graph kept by another
name) is not promised: releasing one holder of it frees nothing. The blocks and segments come from the
allocator's own snapshot (:func:`allocator_promise`, :func:`workspace_blocks`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from gpumem.core.holders.remainder import block_size
from gpumem.core.holders.tensors import StorageKey
from gpumem.core.readers.allocator_backend import native_allocator
from gpumem.core.units import format_bytes

__all__ = [
    "CACHE",
    "EXCEPTION",
    "GRADIENTS",
    "OUTPUTS",
    "UNBIND",
    "WORKSPACES",
    "DeviceBytes",
    "Outcome",
    "Promise",
    "allocator_promise",
    "workspace_blocks",
]


# The actions, by id. GRADIENTS and UNBIND are followed by ":<name>" (the model, the name to unbind).
OUTPUTS = "outputs"
EXCEPTION = "exception"
GRADIENTS = "gradients"
WORKSPACES = "workspaces"
CACHE = "cache"
UNBIND = "unbind"


class DeviceBytes(NamedTuple):
    """Bytes of one CUDA device: to the allocator (``memory_allocated``) and to the device (``memory_reserved``)."""

    device: int
    allocated_bytes: int
    reserved_bytes: int


class Promise(NamedTuple):
    """What one action will return, computed before it runs.

    ``exact`` is False when a figure could only be bounded (the walk stopped at a limit, the allocator's
    segments could not be read): the figures are then an upper bound and the label says so.
    ``storage_count``/``storage_bytes`` are the storages the action releases (any device, ``nbytes``);
    ``kept_by`` names the other holders of storages the action reaches but cannot free.
    """

    action: str
    label: str  # what the action does, in a few words ("Release Out[3]", "Drop the last exception's frames")
    devices: tuple[DeviceBytes, ...]
    storage_count: int
    storage_bytes: int
    exact: bool
    kept_by: tuple[str, ...] = ()
    kept_bytes: int = 0  # storages reached by the action but held by something else too (not promised)
    note: str = ""
    host_bytes: int = 0  # of ``storage_bytes``, the storages in host memory (no allocator counts them)

    @property
    def allocated_bytes(self) -> int:
        return sum(d.allocated_bytes for d in self.devices)

    @property
    def reserved_bytes(self) -> int:
        return sum(d.reserved_bytes for d in self.devices)

    def button_text(self) -> str:
        """The action and what it returns, for a button: "Release Out[3]: 1.0 GiB"."""
        nbytes = self.reserved_bytes if self.action == CACHE else self.allocated_bytes
        if not nbytes and self.action != CACHE:
            nbytes = self.host_bytes  # host tensors only: what the action frees is theirs
        bound = "" if self.exact else "up to "
        return f"{self.label}: {bound}{format_bytes(nbytes)}"

    def describe(self) -> str:
        """The promise in one line: to the allocator, to the device, and what is not promised and why."""
        bound = "" if self.exact else "at most "
        text = ""
        if self.devices:
            text = (
                f"returns {bound}{format_bytes(self.allocated_bytes)} to the allocator and "
                f"{bound}{format_bytes(self.reserved_bytes)} to the device"
            )
        if self.host_bytes or not self.devices:
            host = f"releases {bound}{format_bytes(self.host_bytes)} of host tensor storage"
            text = f"{text}; {host}" if self.devices else host
        if self.kept_bytes:
            text += f"; {format_bytes(self.kept_bytes)} stays, also held by {', '.join(self.kept_by[:3])}"
        return f"{text}; {self.note}" if self.note else text


class Outcome(NamedTuple):
    """What one action did, measured: the allocator's counters before and after, exact, per device."""

    promise: Promise
    before: tuple[DeviceBytes, ...]
    after: tuple[DeviceBytes, ...]
    released: tuple[str, ...]  # what was dropped ("Out[3]", "sys.last_traceback", "model.0.weight.grad", ...)
    storages_freed: int  # released storages that are gone now (weak references expired)
    storages_alive: int  # released storages something still holds
    alive_bytes: int
    elapsed_s: float
    error: str = ""

    @property
    def allocated_freed_bytes(self) -> int:
        return _total(self.before, "allocated_bytes") - _total(self.after, "allocated_bytes")

    @property
    def reserved_freed_bytes(self) -> int:
        return _total(self.before, "reserved_bytes") - _total(self.after, "reserved_bytes")

    @property
    def kept(self) -> bool:
        """Whether the promise was kept: both figures measured as promised (exact), or within it (a bound)."""
        if self.error:
            return False
        promise = self.promise
        if not promise.devices:  # no CUDA in use: the storages are the measure
            return self.storages_alive == 0
        if promise.exact:
            return (self.allocated_freed_bytes, self.reserved_freed_bytes) == (
                promise.allocated_bytes,
                promise.reserved_bytes,
            )
        return self.allocated_freed_bytes >= 0 and self.storages_alive == 0

    def reason(self) -> str:
        """Why the promise was not kept ("" when it was)."""
        if self.kept:
            return ""
        if self.error:
            return self.error
        promise = self.promise
        reasons: list[str] = []
        if self.storages_alive:
            reasons.append(
                f"another holder appeared: {self.storages_alive} of the storages "
                f"({format_bytes(self.alive_bytes)}) are still held"
            )
        if not promise.devices:
            return "; ".join(reasons)
        allocated_gap = self.allocated_freed_bytes - promise.allocated_bytes
        reserved_gap = self.reserved_freed_bytes - promise.reserved_bytes
        if not reasons and allocated_gap < 0:
            reasons.append(f"the allocator got back {format_bytes(-allocated_gap)} less than promised")
        if allocated_gap > 0:
            reasons.append(f"{format_bytes(allocated_gap)} more came back: memory was freed meanwhile (a running cell)")
        if reserved_gap < 0 and allocated_gap >= 0:
            reasons.append(
                f"the cache kept it: {format_bytes(-reserved_gap)} freed to the allocator stayed reserved "
                "(a segment still holds another block, or memory was allocated meanwhile)"
            )
        elif reserved_gap > 0:
            reasons.append(f"{format_bytes(reserved_gap)} more went back to the device than promised")
        return "; ".join(reasons) or "the figures changed while it ran"

    def describe(self) -> str:
        """The result in one line: measured figures, then whether the promise was kept."""
        if self.error and not self.before:
            return f"{self.promise.label} failed: {self.error}"
        storages = f"{self.storages_freed} storage{'' if self.storages_freed == 1 else 's'} freed"
        measured = storages
        if self.promise.devices:
            measured = (
                f"{format_bytes(self.allocated_freed_bytes)} back to the allocator, "
                f"{format_bytes(self.reserved_freed_bytes)} to the device"
            )
            measured += f", {storages}" if self.promise.host_bytes else ""
        verdict = "as promised" if self.kept else f"promised {_promised(self.promise)}: {self.reason()}"
        return f"{self.promise.label}: {measured} ({self.elapsed_s:.2f} s), {verdict}"


def _promised(promise: Promise) -> str:
    if not promise.devices:
        return format_bytes(promise.host_bytes)
    return f"{format_bytes(promise.allocated_bytes)} / {format_bytes(promise.reserved_bytes)}"


def _total(devices: tuple[DeviceBytes, ...], field: str) -> int:
    return sum(int(getattr(d, field)) for d in devices)


# A promise in the caching allocator's units, from its segments (``torch.cuda.memory_snapshot()``).
#
# To the allocator: each released storage's block, found by its address (a block can be larger than the
# storage: 512-byte rounding, or the remainder of a segment too small to split off). To the device: with
# ``empty_cache`` after the release, every segment of the default pool whose blocks are then all free
# (``empty_cache`` returns exactly those; a private pool's, such as a CUDA graph's, stays). Without the
# segments (cudaMallocAsync, or too many to read) the blocks are computed from the sizes and nothing is
# promised to the device: the promise is then marked inexact.
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
