"""What one cell did with GPU memory, from PyTorch's allocator snapshot: pure functions, no torch.

Three questions, per device, each answered by allocation site: what was alive at the cell's peak,
what the cell left behind, and what was temporary (allocated and freed inside the cell). Bytes are
the sizes the allocator's trace records, which are the sizes *requested*; the allocator rounds each
block up (to 512 B at least), so ``torch.cuda.memory_allocated`` can be a little higher.

Memory that existed before the cell is never charged to a site: it is "before the cell", found as
the blocks alive at the end that the cell did not allocate plus those the cell freed without having
allocated them. A block counts as freed at ``free_requested`` (where ``memory_allocated`` drops),
or at ``free_completed`` where no request was recorded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate
from typing import Any, NamedTuple

from gpumem.core.trace.sites import Frame, Site, SiteNamer

__all__ = ["BEFORE", "DeviceTrace", "SiteUsage", "TraceEvent", "analyse_device", "analyse_snapshot", "live_blocks"]

BEFORE = -1  # the site index of memory allocated before the cell (or before the trace's window)
_STACKS_TRIED = 1024  # distinct stacks (by frame identity) looked up before deciding whether it pays


class TraceEvent(NamedTuple):
    """One change of allocated memory: ``delta`` bytes at ``time`` (µs), charged to ``site`` (or BEFORE)."""

    time: float
    delta: int
    site: int


@dataclass
class SiteUsage:
    """Bytes of one site in one view; ``stack`` is the stack of its largest block (innermost first)."""

    site: Site
    bytes: int = 0
    count: int = 0
    largest: int = 0
    stack: tuple[Frame, ...] = ()


@dataclass
class DeviceTrace:
    """The answers for one device."""

    device: int
    sites: list[Site]
    times: list[float]  # per event, in order: when (µs), its bytes (+ alloc, - free) and its site (or BEFORE)
    deltas: list[int]
    owners: list[int]
    start_bytes: int  # allocated before the cell (still or once alive during it)
    end_bytes: int
    peak_bytes: int
    peak_time: float | None  # None: the peak is the cell's start
    before_at_peak: int  # of peak_bytes, what was allocated before the cell
    at_peak: list[SiteUsage]
    left: list[SiteUsage]
    temporary: list[SiteUsage]
    freed_before: int  # bytes allocated before the cell that the cell freed
    truncated: bool  # the trace's oldest events may be missing (its ring buffer was full)
    failed: list[int] = field(default_factory=list)  # sizes of allocations that ran out of memory
    first_time: float | None = None
    last_time: float | None = None

    @property
    def events(self) -> list[TraceEvent]:
        """The events as tuples, built on demand (the analysis and the timeline read the lists)."""
        return list(map(TraceEvent, self.times, self.deltas, self.owners))


class _Block(NamedTuple):
    site: int
    size: int
    frames: Sequence[Mapping[str, Any]]
    address: int


def live_blocks(snapshot: Mapping[str, Any], device: int) -> dict[int, int]:
    """``{address: requested bytes}`` of the blocks allocated on ``device`` when the snapshot was taken."""
    found: dict[int, int] = {}
    for segment in snapshot.get("segments", ()):
        if int(segment.get("device", 0)) != device:
            continue
        address = int(segment.get("address", 0))
        for block in segment.get("blocks", ()):
            size = int(block.get("size", 0))
            here = int(block.get("address", address))
            if block.get("state") == "active_allocated":
                found[here] = int(block.get("requested_size", size) or size)
            address = here + size
    return found


class _Replay:
    """One forward pass over a device's trace: classifies every alloc and free.

    Events are kept as three parallel lists (time, delta, site) rather than one tuple each: the loop
    runs once per trace entry (100,000 a cell) and building an object per entry was most of its cost.
    """

    def __init__(self, namer: SiteNamer) -> None:
        self.namer = namer
        self.sites: list[Site] = []
        self.index: dict[tuple[str, int, str], int] = {}
        self.positions: dict[int, int] = {}  # id(Site) -> its index (the namer keeps each Site alive)
        self.stacks: dict[tuple[int, ...], tuple[Sequence[Mapping[str, Any]], int]] | None = {}
        self.stack_hits = 0
        self.times: list[float] = []
        self.deltas: list[int] = []
        self.owners: list[int] = []  # per event: its site, or BEFORE
        self.steps: list[_Block | int] = []  # per event: the block an alloc made, or the address a free freed
        self.live: dict[int, _Block] = {}
        self.freed_before = 0
        self.temporary: dict[int, SiteUsage] = {}
        self.temporary_frames: dict[int, Sequence[Mapping[str, Any]]] = {}
        self.failed: list[int] = []

    def site_of(self, frames: Sequence[Mapping[str, Any]]) -> int:
        """The site index of one allocation's frames, found by the identity of its frame dicts when it can be.

        torch's snapshot makes one dict per distinct frame and shares it between entries, so a stack seen
        before is found without reading a frame. Where dicts are not shared, nothing repeats: the lookup
        is given up after a while. Each stored stack keeps its frames alive, so an id stays theirs.
        """
        stacks = self.stacks
        if stacks is not None:
            key = tuple(map(id, frames))
            known = stacks.get(key)
            if known is not None:
                self.stack_hits += 1
                return known[1]
        site = self.namer.site(frames)
        position = self.positions.get(id(site))
        if position is None:
            position = self.index.get(site.key)
            if position is None:
                position = self.index[site.key] = len(self.sites)
                self.sites.append(site)
            self.positions[id(site)] = position
        if stacks is not None:
            stacks[key] = (frames, position)
            if len(stacks) == _STACKS_TRIED and self.stack_hits < _STACKS_TRIED:  # under half of lookups hit
                self.stacks = None
        return position

    def run(self, entries: Iterable[Mapping[str, Any]]) -> None:
        """The whole replay in one loop with its state in locals."""
        live, requested, temporary = self.live, set(), self.temporary  # requested: freed, not yet completed
        add_time, add_delta, add_owner, add_step = (
            self.times.append,
            self.deltas.append,
            self.owners.append,
            self.steps.append,
        )
        site_of, new_usage, sites = self.site_of, SiteUsage, self.sites
        new_block = partial(tuple.__new__, _Block)  # _Block(...) runs a Python __new__: 60,000 times a cell
        for number, entry in enumerate(entries):
            try:  # the keys every torch entry has, read by subscript (a third of the cost of .get)
                action, address, time = entry["action"], entry["addr"], entry["time_us"]
            except KeyError:
                action, address, time = entry.get("action"), entry.get("addr", 0), entry.get("time_us", number)
            if action == "alloc":
                frames = entry.get("frames") or ()
                site, size = site_of(frames), entry.get("size", 0)
                live[address] = block = new_block((site, size, frames, address))
                requested.discard(address)
                add_time(time)
                add_delta(size)
                add_owner(site)
                add_step(block)
            elif action == "free_requested" or action == "free_completed":  # noqa: PLR1714 - faster than `in`
                if action == "free_requested":
                    requested.add(address)
                elif address in requested:
                    requested.discard(address)
                    continue
                freed = live.pop(address, None)
                add_step(address)
                add_time(time)
                if freed is None:
                    size = int(entry.get("size", 0))
                    self.freed_before += size
                    add_delta(-size)
                    add_owner(BEFORE)
                    continue
                site, size = freed.site, freed.size
                add_delta(-size)
                add_owner(site)
                usage = temporary.get(site)  # charged as temporary here, inline: once per free
                if usage is None:
                    usage = temporary[site] = new_usage(sites[site])
                usage.bytes += size
                usage.count += 1
                if size >= usage.largest:
                    usage.largest = size
                    self.temporary_frames[site] = freed.frames
            elif action == "oom":
                self.failed.append(int(entry.get("size", 0)))


def _add(usage: SiteUsage, size: int) -> None:
    usage.bytes += size
    usage.count += 1
    usage.largest = max(usage.largest, size)


def _ranked(usages: Iterable[SiteUsage]) -> list[SiteUsage]:
    """Largest first; the user's own sites before library ones of the same size."""
    return sorted(usages, key=lambda usage: (-usage.bytes, not usage.site.user, usage.site.label))


def _by_site(blocks: Iterable[_Block], sites: list[Site], namer: SiteNamer) -> list[SiteUsage]:
    usages: dict[int, SiteUsage] = {}
    stacks: dict[int, Sequence[Mapping[str, Any]]] = {}
    for block in blocks:
        usage = usages.get(block.site)
        if usage is None:
            usage = usages[block.site] = SiteUsage(sites[block.site])
        if block.size >= usage.largest:
            stacks[block.site] = block.frames
        _add(usage, block.size)
    for site, usage in usages.items():
        usage.stack = tuple(namer.frames(stacks.get(site, ())))
    return _ranked(usages.values())


def _peak(deltas: Sequence[int], start: int) -> tuple[int, int]:
    """``(peak bytes, index of the event that first reached it)``; index -1: the start was the peak."""
    totals = list(accumulate(deltas, initial=start))
    peak = max(totals)
    return peak, totals.index(peak) - 1


def analyse_device(
    snapshot: Mapping[str, Any],
    device: int,
    *,
    first_entry: int = 0,
    namer: SiteNamer | None = None,
    truncated: bool = False,
) -> DeviceTrace:
    """The three answers for ``device``; the trace's entries before ``first_entry`` predate the cell."""
    namer = namer or SiteNamer()
    traces = snapshot.get("device_traces") or []
    entries: Sequence[Mapping[str, Any]] = traces[device][first_entry:] if device < len(traces) else []
    replay = _Replay(namer)
    replay.run(entries)
    at_end = live_blocks(snapshot, device)
    survivors = sum(size for address, size in at_end.items() if address not in replay.live)
    start = survivors + replay.freed_before
    times, deltas = replay.times, replay.deltas
    peak, where = _peak(deltas, start)
    alive, before_at_peak = _alive_at(replay, where, start)
    for site, usage in replay.temporary.items():
        usage.stack = tuple(namer.frames(replay.temporary_frames.get(site, ())))
    return DeviceTrace(
        device=device,
        sites=replay.sites,
        times=times,
        deltas=deltas,
        owners=replay.owners,
        start_bytes=start,
        end_bytes=start + sum(deltas),
        peak_bytes=peak,
        peak_time=times[where] if where >= 0 else None,
        before_at_peak=before_at_peak,
        at_peak=_by_site(alive, replay.sites, namer),
        left=_by_site(replay.live.values(), replay.sites, namer),
        temporary=_ranked(replay.temporary.values()),
        freed_before=replay.freed_before,
        truncated=truncated,
        failed=replay.failed,
        first_time=times[0] if times else None,
        last_time=times[-1] if times else None,
    )


def _alive_at(replay: _Replay, until: int, start: int) -> tuple[list[_Block], int]:
    """The cell's blocks alive just after event ``until``, and the bytes from before the cell then."""
    alive: dict[int, _Block] = {}
    before = start
    for owner, delta, step in zip(replay.owners[: until + 1], replay.deltas, replay.steps, strict=False):
        if owner == BEFORE:
            before += delta
        elif isinstance(step, _Block):
            alive[step.address] = step
        else:
            alive.pop(step, None)
    return list(alive.values()), before


def analyse_snapshot(
    snapshot: Mapping[str, Any],
    *,
    first_entry: Mapping[int, int] | None = None,
    cell_numbers: Mapping[str, int] | None = None,
    truncated: Sequence[int] = (),
) -> list[DeviceTrace]:
    """One :class:`DeviceTrace` per device that the cell allocated or freed on."""
    namer = SiteNamer(cell_numbers)
    found = []
    for device in range(len(snapshot.get("device_traces") or [])):
        start = (first_entry or {}).get(device, 0)
        trace = analyse_device(snapshot, device, first_entry=start, namer=namer, truncated=device in truncated)
        if trace.times or trace.failed:
            found.append(trace)
    return found
