"""What one cell did with GPU memory, from PyTorch's allocator snapshot: pure functions, no torch.

PyTorch records each allocation's Python stack innermost first. The site of an allocation is its
innermost frame in the user's own code (a notebook cell or a file outside the installed packages,
:class:`SiteNamer`), so that ``torch.empty`` inside ``make()`` in cell 3 is charged to that line of cell 3,
not to torch. Library frames are folded: kept in the stack a site expands to, never its name.

Three questions, per device, each answered by allocation site: what was alive at the cell's peak,
what the cell left behind, and what was temporary (allocated and freed inside the cell). Bytes are
the sizes the allocator's trace records, which are the sizes *requested*; the allocator rounds each
block up (to 512 B at least), so ``torch.cuda.memory_allocated`` can be a little higher.

Memory that existed before the cell is never charged to a site: it is "before the cell", found as
the blocks alive at the end that the cell did not allocate plus those the cell freed without having
allocated them. A block counts as freed at ``free_requested`` (where ``memory_allocated`` drops),
or at ``free_completed`` where no request was recorded.

Frees are paired with allocations by numpy (:mod:`~gpumem.core.trace.pairing`, imported on the first
trace); entries the arrays cannot hold as they are (a key missing, a size that is not an integer)
are replayed by a loop that gives the same answers.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from gpumem.core.trace.pairing import Columns

__all__ = [
    "BEFORE",
    "NO_STACK",
    "DeviceTrace",
    "Frame",
    "Site",
    "SiteNamer",
    "SiteUsage",
    "TraceEvent",
    "analyse_device",
    "analyse_snapshot",
    "live_blocks",
]


# Allocation sites: which frame of a recorded stack is the user's, and how to name it.
# IPython's cell filenames: ipykernel's '/tmp/ipykernel_123/456.py', the terminal's '<ipython-input-3-...>'.
_IPYTHON_INPUT = re.compile(r"<ipython-input-(\d+)-[0-9a-f]+>")
_TIMED_BODIES = ("<timed exec>", "<timed eval>")  # the filenames IPython's %%time compiles a body under
_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/", "\\site-packages\\", "\\dist-packages\\")


@dataclass(frozen=True)
class Frame:
    """One recorded frame, named as a person reads it (``cell [3] line 4`` for a notebook cell)."""

    filename: str
    line: int
    function: str
    where: str  # 'cell [3] line 4' or 'path/to/file.py:12'
    user: bool


@dataclass(frozen=True)
class Site:
    """Where an allocation came from: its innermost frame in user code (or, lacking one, its innermost)."""

    key: tuple[str, int, str]
    label: str  # 'cell [3] line 4 in make'
    user: bool
    via: str  # the innermost library call below the user's frame, e.g. 'torch/nn/functional.py:1676 linear'


NO_STACK = Site(("", 0, ""), "(no stack recorded)", user=False, via="")


def _library_prefixes() -> tuple[str, ...]:
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, getattr(sys, "base_exec_prefix", sys.prefix)}
    return tuple(sorted(f"{prefix.rstrip('/')}/lib" for prefix in prefixes if prefix))


class SiteNamer:
    """Names frames and picks sites; ``cell_numbers`` maps IPython's cell filenames to execution counts."""

    def __init__(self, cell_numbers: Mapping[str, int] | None = None) -> None:
        self.cell_numbers = dict(cell_numbers or {})
        self._prefixes = _library_prefixes()
        self._files: dict[str, tuple[str, bool, int | None]] = {}
        self._sites: dict[tuple[Any, ...], Site] = {}
        self._user_files = _UserFiles(self)

    def _file(self, filename: str) -> tuple[str, bool, int | None]:
        """``(short name, is user code, cell number or None)`` for a filename, cached."""
        known = self._files.get(filename)
        if known is not None:
            return known
        cell = self.cell_numbers.get(filename)
        if cell is None:
            match = _IPYTHON_INPUT.fullmatch(filename)
            cell = int(match.group(1)) if match else None
        if cell is not None:
            known = (f"cell [{cell}]", True, cell)
        elif filename in _TIMED_BODIES:  # a cell body run by %%time: the user's code, numbered from its own line 1
            known = ("%%time body", True, 0)
        elif filename.startswith(("<", *self._prefixes)) or any(marker in filename for marker in _LIBRARY_MARKERS):
            known = (_short_library_name(filename), False, None)
        else:
            known = (filename, True, None)
        self._files[filename] = known
        return known

    def frame(self, raw: Mapping[str, Any]) -> Frame:
        filename = str(raw.get("filename", "?"))
        line = int(raw.get("line", 0) or 0)
        function = str(raw.get("name", "?"))
        short, user, cell = self._file(filename)
        where = f"{short} line {line}" if cell is not None else f"{short}:{line}"
        return Frame(filename, line, function, where, user)

    def frames(self, raw_frames: Sequence[Mapping[str, Any]]) -> list[Frame]:
        return [self.frame(raw) for raw in raw_frames]

    def site(self, raw_frames: Sequence[Mapping[str, Any]]) -> Site:
        """The site of one allocation, from its frames (innermost first)."""
        return self.site_and_depth(raw_frames)[0]

    def site_and_depth(self, raw_frames: Sequence[Mapping[str, Any]]) -> tuple[Site, int | None]:
        """The site, and how many innermost frames decide it: through the innermost user frame (None: no
        frame is the user's, so every frame counts). Equal frames that many deep give the same site."""
        if not raw_frames:
            return NO_STACK, 0
        user_files = self._user_files
        below: Mapping[str, Any] | None = None
        decided: int | None = None
        for depth, raw in enumerate(raw_frames, 1):  # ~20 frames: one lookup per frame
            filename = raw.get("filename", "?")
            if user_files[filename]:
                chosen, decided = raw, depth
                break
            below = raw
        else:
            chosen, below = raw_frames[0], None
            filename = chosen.get("filename", "?")
        # The key determines the Site (it is made from these fields with these defaults).
        if below is None:
            cache_key: tuple[Any, ...] = (filename, chosen.get("line"), chosen.get("name"))
        else:
            cache_key = (filename, chosen.get("line"), chosen.get("name"),
                         below.get("filename", "?"), below.get("line"), below.get("name"))  # fmt: skip
        cached = self._sites.get(cache_key)
        if cached is None:
            cached = self._sites[cache_key] = self._new_site(chosen, below)
        return cached, decided

    def _new_site(self, chosen: Mapping[str, Any], below: Mapping[str, Any] | None) -> Site:
        frame = self.frame(chosen)
        via = ""
        if below is not None:
            inner = self.frame(below)
            via = f"{inner.where} {inner.function}"
        key = (frame.filename, frame.line, frame.function)
        return Site(key, f"{frame.where} in {frame.function}", user=frame.user, via=via)


class _UserFiles(dict[Any, bool]):
    """``{filename: is user code}``, filled on first sight (one lookup per frame, no ``None`` check)."""

    def __init__(self, namer: SiteNamer) -> None:
        super().__init__()
        self._namer = namer

    def __missing__(self, filename: Any) -> bool:
        user = self[filename] = self._namer._file(str(filename))[1]  # noqa: SLF001 - the namer's own cache
        return user


def _short_library_name(filename: str) -> str:
    """'/usr/lib/python3.11/site-packages/torch/nn/functional.py' -> 'torch/nn/functional.py'."""
    for marker in ("site-packages", "dist-packages"):
        position = filename.rfind(marker)
        if position >= 0:
            return filename[position + len(marker) + 1 :]
    for prefix in _library_prefixes():
        if filename.startswith(prefix):
            rest = filename[len(prefix) :].lstrip("/")
            return rest.split("/", 1)[1] if rest.startswith("python") and "/" in rest else rest
    return filename


BEFORE = -1  # the site index of memory allocated before the cell (or before the trace's window)
_STACKS_TRIED = 1024  # distinct stacks (by frame identity) looked up before deciding whether it pays
_CHUNK = 1024  # allocations looked up inline at one depth
_DEPTHS_TRIED = 16  # distinct deciding depths stored (each is one lookup per allocation)


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
    # (deltas, their int64 array, owners, theirs) where the analysis had them as arrays: the timeline
    # reads them instead of converting the lists again, while the lists are these same objects.
    arrays: tuple[Any, ...] = field(default=(), compare=False, repr=False)

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


class _SiteIndex:
    """Site indices in order of first sight, each allocation's found by the identity of its frame dicts
    when it can be.

    torch's snapshot makes one dict per distinct frame and shares it between entries. A stack is stored
    by its innermost frame and the frame that decides its site (its innermost user frame), at that
    depth; a new stack with the same two dicts there is compared with it that many frames deep (in C:
    identical dicts compare at once, and equal frames give the same site), without reading a frame.
    Where dicts are not shared nothing repeats: the lookup is given up after a while. Each stored
    stack keeps its frames alive, so an id stays theirs.
    """

    def __init__(self, namer: SiteNamer) -> None:
        self.namer = namer
        self.sites: list[Site] = []
        self.index: dict[tuple[str, int, str], int] = {}
        self.positions: dict[int, int] = {}  # id(Site) -> its index (the namer keeps each Site alive)
        self.depths: list[int] = []  # the deciding depths stored (negative: a whole stack, no user frame)
        self.stacks: dict[tuple[int, int, int], tuple[Sequence[Mapping[str, Any]], int]] | None = {}
        self.stored = self.hits = self.calls = 0
        self.depth_hits: dict[int, int] = {}  # per depth stored, how many lookups it answered

    def many(self, frame_lists: Sequence[Sequence[Mapping[str, Any]]]) -> list[int]:
        """The site index of each allocation's frames, in order: in chunks, each looked up inline at the
        depth that has matched most so far (one call per allocation was half of the analysis's cost)."""
        found: list[int] = []
        for begin in range(0, len(frame_lists), _CHUNK):
            chunk = frame_lists[begin : begin + _CHUNK]
            stacks, depth = self.stacks, max(self.depth_hits, key=self.depth_hits.__getitem__, default=0)
            if stacks is None:  # given up: straight to the namer
                site, position = self.namer.site, self.position
                found.extend(position(site(frames)) for frames in chunk)
                continue
            if depth <= 0:
                found.extend(map(self, chunk))
                continue
            get, call, calls = stacks.get, self.__call__, self.calls
            found.extend(
                known[1]
                if len(frames) >= depth
                and (known := get((depth, id(frames[0]), id(frames[depth - 1])))) is not None
                and frames[:depth] == known[0]
                else call(frames)
                for frames in chunk
            )
            inline = len(chunk) - (self.calls - calls)  # found inline, without a call
            self.hits += inline
            self.depth_hits[depth] += inline
        return found

    def __call__(self, frames: Sequence[Mapping[str, Any]]) -> int:
        """The site index of one allocation's frames (innermost first)."""
        self.calls += 1
        stacks = self.stacks
        if stacks is not None and frames:
            first, size = id(frames[0]), len(frames)
            for depth in self.depths:
                if depth > 0:
                    if depth <= size:
                        known = stacks.get((depth, first, id(frames[depth - 1])))
                        if known is not None and frames[:depth] == known[0]:
                            self.hits += 1
                            self.depth_hits[depth] += 1
                            return known[1]
                elif -depth == size:
                    known = stacks.get((depth, first, id(frames[-1])))
                    if known is not None and frames == known[0]:
                        self.hits += 1
                        return known[1]
        site, decided = self.namer.site_and_depth(frames)
        position = self.position(site)
        if stacks is not None and frames:
            self.store(stacks, frames, decided, position)
        return position

    def position(self, site: Site) -> int:
        position = self.positions.get(id(site))
        if position is None:
            position = self.index.get(site.key)
            if position is None:
                position = self.index[site.key] = len(self.sites)
                self.sites.append(site)
            self.positions[id(site)] = position
        return position

    def store(
        self, stacks: dict[Any, Any], frames: Sequence[Mapping[str, Any]], decided: int | None, site: int
    ) -> None:
        depth = -len(frames) if decided is None else decided
        if depth not in self.depths:
            if len(self.depths) == _DEPTHS_TRIED:
                return
            self.depths.append(depth)
            if depth > 0:
                self.depth_hits[depth] = 0
        kept = frames[:depth] if depth > 0 else frames
        stacks[depth, id(frames[0]), id(kept[-1])] = (kept, site)
        self.stored += 1
        if self.stored == _STACKS_TRIED and self.hits < _STACKS_TRIED:  # under half of lookups hit
            self.stacks = None


class _Replay:
    """One forward pass over a device's trace: classifies every alloc and free (for entries that the
    arrays of :mod:`~gpumem.core.trace.pairing` do not hold as they are).

    Events are kept as three parallel lists (time, delta, site) rather than one tuple each: the loop
    runs once per trace entry (100,000 a cell) and building an object per entry was most of its cost.
    """

    def __init__(self, site_of: _SiteIndex) -> None:
        self.site_of = site_of
        self.sites = site_of.sites
        self.times: list[float] = []
        self.deltas: list[int] = []
        self.owners: list[int] = []  # per event: its site, or BEFORE
        self.steps: list[_Block | int] = []  # per event: the block an alloc made, or the address a free freed
        self.live: dict[int, _Block] = {}
        self.freed_before = 0
        self.temporary: dict[int, SiteUsage] = {}
        self.temporary_frames: dict[int, Sequence[Mapping[str, Any]]] = {}
        self.failed: list[int] = []

    def left(self) -> list[_Block]:
        return list(self.live.values())

    def peak(self, start: int) -> tuple[int, int]:
        return _peak(self.deltas, start)

    def alive_at(self, until: int) -> tuple[list[_Block], int]:
        """The cell's blocks alive just after event ``until``, and the bytes from before the cell freed by then."""
        alive: dict[int, _Block] = {}
        before = 0
        for owner, delta, step in zip(self.owners[: until + 1], self.deltas, self.steps, strict=False):
            if owner == BEFORE:
                before += delta
            elif isinstance(step, _Block):
                alive[step.address] = step
            else:
                alive.pop(step, None)
        return list(alive.values()), before

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


class _ArrayReplay:
    """The replay's answers from arrays (:mod:`~gpumem.core.trace.pairing`): only the sites are found
    one allocation at a time."""

    def __init__(self, columns: Columns, entries: Sequence[Mapping[str, Any]], site_of: _SiteIndex) -> None:
        from gpumem.core.trace.pairing import Pairing  # numpy: imported on the first trace, not at %load_ext

        self.columns, self.sites = columns, site_of.sites
        self.frames = [entries[entry].get("frames") or () for entry in columns.allocs.tolist()]
        self.pairing = pairing = Pairing(columns, site_of.many(self.frames), before=BEFORE)
        every = len(pairing.events) == len(columns.times)  # as torch records (no completions, no segment events)
        self.times = columns.times if every else list(map(columns.times.__getitem__, pairing.events.tolist()))
        self.deltas: list[int] = pairing.deltas.tolist()
        self.owners: list[int] = pairing.owners.tolist()
        self.arrays = (self.deltas, pairing.deltas, self.owners, pairing.owners)
        self.freed_before, self.failed = pairing.freed_before, columns.failed
        self.temporary: dict[int, SiteUsage] = {}
        self.temporary_frames: dict[int, Sequence[Mapping[str, Any]]] = {}
        for site, total, count, largest, alloc in pairing.temporary():
            self.temporary[site] = SiteUsage(self.sites[site], total, count, largest)
            self.temporary_frames[site] = self._blocks([alloc])[0].frames

    def _blocks(self, allocs: Any) -> list[_Block]:
        """The blocks of the allocs at these entries (an index array), as the loop's replay makes them."""
        columns, pairing = self.columns, self.pairing
        frames = map(self.frames.__getitem__, columns.allocs.searchsorted(allocs).tolist())
        found = zip(pairing.site_of[allocs].tolist(), columns.sizes[allocs].tolist(), frames,
                    columns.addresses[allocs].tolist(), strict=True)  # fmt: skip
        return [_Block(*block) for block in found]

    def left(self) -> list[_Block]:
        return self._blocks(self.pairing.alive_after(len(self.deltas) - 1))

    def peak(self, start: int) -> tuple[int, int]:
        return self.pairing.peak(start) or _peak(self.deltas, start)

    def alive_at(self, until: int) -> tuple[list[_Block], int]:
        return self._blocks(self.pairing.alive_after(until)), self.pairing.before_until(until)


def _columns(entries: Sequence[Mapping[str, Any]]) -> Columns | None:
    from gpumem.core.trace.pairing import Columns  # numpy: imported on the first trace, not at %load_ext

    return Columns.read(entries)


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
    site_of = _SiteIndex(namer)
    columns = _columns(entries)
    replay: _Replay | _ArrayReplay
    if columns is not None:
        replay = _ArrayReplay(columns, entries, site_of)
    else:
        replay = _Replay(site_of)
        replay.run(entries)
    left = replay.left()
    at_end = live_blocks(snapshot, device)
    alive_at_end = {block.address for block in left}
    survivors = sum(size for address, size in at_end.items() if address not in alive_at_end)
    start = survivors + replay.freed_before
    times, deltas = replay.times, replay.deltas
    peak, where = replay.peak(start)
    alive, before_delta = replay.alive_at(where)
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
        before_at_peak=start + before_delta,
        at_peak=_by_site(alive, replay.sites, namer),
        left=_by_site(left, replay.sites, namer),
        temporary=_ranked(replay.temporary.values()),
        freed_before=replay.freed_before,
        truncated=truncated,
        failed=replay.failed,
        first_time=times[0] if times else None,
        last_time=times[-1] if times else None,
        arrays=getattr(replay, "arrays", ()),
    )


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
