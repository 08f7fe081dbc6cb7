"""What a reclaim action promises before it runs, and what it measured after.

A promise is counted in the allocator's own units: the blocks the released storages occupy (to the
allocator, ``memory_allocated`` falls by that much) and the segments that are then wholly free (to the
device: ``empty_cache`` returns them, ``memory_reserved`` falls by that much). A storage that anything
else still reaches (another name, another of IPython's references, an autograd graph kept by another
name) is not promised: releasing one holder of it frees nothing.
"""

from __future__ import annotations

from typing import NamedTuple

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
