"""Fragmentation measured from the allocator's segments: synthetic ``torch.cuda.memory_snapshot()`` lists
with exact figures, the cheap counter check that decides whether to read one, the lazy reader, and the
simulated caching allocator the fake source uses."""

from __future__ import annotations

from typing import Any

import pytest

from gpumem.core.diagnoses.fragmentation import (
    FreeReserve,
    ReserveReader,
    free_reserve,
    read_segments,
    worth_a_look,
)
from gpumem.core.readers.sources import AllocatorReading, SystemSource
from gpumem.testing import GIB, MIB, FakeSource, SegmentAllocator

ALLOCATED, FREE, PENDING = "active_allocated", "inactive", "active_pending_free"


def segment(
    blocks: list[tuple[int, str]], *, device: int = 0, kind: str = "large", address: int = 0, expandable: bool = False
) -> dict[str, Any]:
    """One segment as torch.cuda.memory_snapshot() lists it (only the keys gpumem reads, plus a few)."""
    listed = []
    at = address
    for size, state in blocks:
        listed.append({"address": at, "size": size, "requested_size": size, "state": state, "frames": []})
        at += size
    return {
        "device": device,
        "address": address,
        "total_size": sum(size for size, _ in blocks),
        "segment_type": kind,
        "is_expandable": expandable,
        "stream": 0,
        "blocks": listed,
    }


def test_one_large_free_block_beside_live_tensors_is_not_fragmentation() -> None:
    """x = 1 GiB; a 2 GiB transient freed; two 64 MiB tensors taken from its segment (seen on an H200)."""
    segments = [
        segment([(GIB, ALLOCATED)]),
        segment([(64 * MIB, ALLOCATED), (64 * MIB, ALLOCATED), (2 * GIB - 128 * MIB, FREE)], address=4 * GIB),
    ]
    assert free_reserve(segments) == {
        0: FreeReserve(
            device=0,
            reserved_bytes=3 * GIB,
            allocated_bytes=GIB + 128 * MIB,
            free_bytes=2 * GIB - 128 * MIB,
            pending_free_bytes=0,
            pieces=1,
            largest_free_bytes=2 * GIB - 128 * MIB,
            releasable_bytes=0,
            stranded_bytes=2 * GIB - 128 * MIB,
            unusable_bytes=0,
            expandable=False,
        )
    }
    assert not free_reserve(segments)[0].fragmented  # any request up to 1.875 GiB uses the free block


def test_pieces_stranded_beside_live_tensors_are() -> None:
    """12 x 1 GiB freed, then 12 x 600 MiB taken: each segment keeps 424 MiB free beside a live tensor."""
    segments = [segment([(600 * MIB, ALLOCATED), (424 * MIB, FREE)], address=i * GIB) for i in range(12)]
    (reserve,) = free_reserve(segments).values()
    assert reserve == FreeReserve(
        device=0,
        reserved_bytes=12 * GIB,
        allocated_bytes=12 * 600 * MIB,
        free_bytes=12 * 424 * MIB,
        pending_free_bytes=0,
        pieces=12,
        largest_free_bytes=424 * MIB,
        releasable_bytes=0,  # empty_cache returns none of it
        stranded_bytes=12 * 424 * MIB,
        unusable_bytes=11 * 424 * MIB,
        expandable=False,
    )
    assert reserve.fragmented


def test_empty_segments_are_returned_by_empty_cache_so_not_fragmentation() -> None:
    segments = [segment([(424 * MIB, FREE)], address=i * GIB) for i in range(12)]
    (reserve,) = free_reserve(segments).values()
    assert (reserve.free_bytes, reserve.pieces, reserve.largest_free_bytes) == (12 * 424 * MIB, 12, 424 * MIB)
    assert reserve.releasable_bytes == 12 * 424 * MIB and reserve.stranded_bytes == 0 and reserve.unusable_bytes == 0
    assert not reserve.fragmented


def test_half_stranded_half_releasable() -> None:
    """Stranded pieces count; an empty segment beside them is what empty_cache would return."""
    segments = [segment([(600 * MIB, ALLOCATED), (424 * MIB, FREE)], address=i * GIB) for i in range(6)]
    segments.append(segment([(2 * GIB, FREE)], address=64 * GIB))
    (reserve,) = free_reserve(segments).values()
    assert reserve.free_bytes == 6 * 424 * MIB + 2 * GIB
    assert reserve.largest_free_bytes == 2 * GIB and reserve.pieces == 7
    assert reserve.releasable_bytes == 2 * GIB
    assert reserve.unusable_bytes == 5 * 424 * MIB  # 2.07 GiB, but less than half of the 4.48 GiB free
    assert not reserve.fragmented


def test_small_pool_pieces_serve_no_request_above_one_mib() -> None:
    """2 MiB small-pool segments each with a 512 KiB tensor: 1.5 MiB free in each, useless above 1 MiB."""
    segments = [
        segment([(512 << 10, ALLOCATED), (1536 << 10, FREE)], kind="small", address=i * 2 * MIB) for i in range(1024)
    ]
    (reserve,) = free_reserve(segments).values()
    assert reserve.free_bytes == 1536 * MIB and reserve.pieces == 1024
    assert reserve.largest_free_bytes == 0  # no large-pool block: a request above 1 MiB uses none of it
    assert reserve.stranded_bytes == reserve.unusable_bytes == 1536 * MIB
    assert reserve.fragmented


def test_expandable_segments_return_every_whole_free_page() -> None:
    page = 2 * MIB
    blocks = [(GIB, ALLOCATED), (3 * GIB + MIB, FREE), (page, ALLOCATED), (5 * MIB, FREE)]
    (reserve,) = free_reserve([segment(blocks, expandable=True)]).values()
    # The first free block starts on a page boundary and ends 1 MiB into a page: 3 GiB of whole pages.
    # The second starts 1 MiB into a page (after the live 2 MiB) and ends 6 MiB later: 2 whole pages.
    assert reserve.releasable_bytes == 3 * GIB + 2 * page
    assert reserve.expandable and reserve.stranded_bytes == 0 and not reserve.fragmented


def test_devices_pending_frees_and_junk() -> None:
    segments: list[Any] = [
        segment([(GIB, PENDING), (GIB, FREE)], device=1),
        segment([(2 * GIB, FREE)], device=0),
        "not a segment",
        {"device": 0, "total_size": 2 * MIB, "blocks": ["junk", {"size": "big", "state": FREE}]},
    ]
    reserves = free_reserve(segments)
    assert sorted(reserves) == [0, 1]
    one = reserves[1]
    assert one.pending_free_bytes == GIB and one.free_bytes == GIB and one.allocated_bytes == 0
    assert one.releasable_bytes == 2 * GIB - GIB  # empty_cache waits for the pending free, then returns it all
    assert reserves[0].reserved_bytes == 2 * GIB + 2 * MIB and reserves[0].free_bytes == 2 * GIB
    assert free_reserve([]) == {}


def _reading(reserved: int, allocated: int, *, retries: int = 0, ooms: int = 0, device: int = 0) -> AllocatorReading:
    return AllocatorReading(device, allocated, reserved, allocated, 0, allocated, reserved, ooms, retries)


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        (None, _reading(12 * GIB, 7 * GIB), True),  # 5 GiB free of 12 GiB reserved
        (None, _reading(3 * GIB, 2 * GIB), True),  # 1 GiB free, a third of the reserve
        (None, _reading(3 * GIB, 2 * GIB + 1), False),  # just under 1 GiB free
        (None, _reading(60 * GIB, 56 * GIB), False),  # 4 GiB free of 60 GiB: usual slack
        (_reading(60 * GIB, 56 * GIB), _reading(60 * GIB, 56 * GIB, retries=1), True),  # had to retry
        (_reading(60 * GIB, 56 * GIB), _reading(60 * GIB, 56 * GIB, ooms=1), True),  # failed
        (_reading(1, 1, retries=3), _reading(2 * MIB, MIB, retries=3), False),  # old retries
    ],
)
def test_worth_a_look(start: AllocatorReading | None, end: AllocatorReading, expected: bool) -> None:
    assert worth_a_look(start, end) is expected


def test_the_reader_reads_once_per_change_of_the_counters() -> None:
    fake = FakeSource(segments=True)
    handles = [fake.allocate(GIB) for _ in range(4)]
    fake.free(handles.pop())
    reader = ReserveReader()
    first = reader.read(fake, fake.snapshot().allocator)
    assert reader.reads == 1 and first[0].free_bytes == GIB and first[0].releasable_bytes == GIB
    assert reader.read(fake, fake.snapshot().allocator) == first and reader.reads == 1  # nothing changed
    fake.free(handles.pop())
    second = reader.read(fake, fake.snapshot().allocator)
    assert reader.reads == 2 and second[0].free_bytes == 2 * GIB
    reader.forget()
    assert reader.read(fake, fake.snapshot().allocator) == second and reader.reads == 3


def test_sources_without_segments_give_nothing() -> None:
    plain = FakeSource()  # counters only: no segments to read
    plain.allocate(GIB)
    assert read_segments(plain) is None
    assert ReserveReader().read(plain, plain.snapshot().allocator) == {}
    assert read_segments(object()) is None


def test_the_real_reader_never_initializes_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is already initialized in this process")
    assert read_segments(SystemSource()) is None
    assert not torch.cuda.is_initialized()


# The simulated caching allocator --------------------------------------------------------------------


def test_the_simulated_allocator_follows_the_caching_allocators_rules() -> None:
    model = SegmentAllocator(capacity_bytes=80 * GIB)
    assert model.allocate(1000, handle=1) == 1024  # rounded up to 512 B, from a 2 MiB small segment
    assert model.allocate(5 * MIB, handle=2) == 5 * MIB  # from a 20 MiB large segment
    assert [s["total_size"] for s in model.snapshot()] == [2 * MIB, 20 * MIB]
    assert model.allocate(16 * MIB + 1, handle=3) == 16 * MIB + 512  # 15 MiB free is too small: a new segment
    assert model.snapshot()[-1]["total_size"] == 18 * MIB  # the request rounded up to 2 MiB
    assert model.allocate(GIB, handle=4) == GIB
    model.free(4)
    assert model.allocate(600 * MIB, handle=5) == 600 * MIB  # best fit: the free 1 GiB block, split
    assert [b["size"] for b in model.snapshot()[-1]["blocks"]] == [600 * MIB, 424 * MIB]
    assert model.allocate(424 * MIB - MIB, handle=6) == 424 * MIB  # 1 MiB left over: not split off
    model.free(5)
    model.free(6)
    assert [b["size"] for b in model.snapshot()[-1]["blocks"]] == [GIB]  # merged again
    assert model.inactive_split_bytes == 20 * MIB - 5 * MIB + 2 * MIB - 1024 + 2 * MIB - 512
    assert model.empty_cache() == GIB and model.reserved_bytes == 40 * MIB


def test_the_simulated_allocator_retries_then_gives_up() -> None:
    model = SegmentAllocator(capacity_bytes=4 * GIB)
    model.allocate(2 * GIB, handle=1)
    model.free(1)
    model.allocate(GIB, handle=2)  # from the free 2 GiB segment, split: 1 GiB stays free beside it
    model.allocate(GIB, handle=3)  # that free 1 GiB, exactly
    model.allocate(GIB, handle=4)  # a new segment: 3 GiB reserved
    with pytest.raises(MemoryError):
        model.allocate(2 * GIB, handle=5)  # no segment is empty: the retry frees nothing
    assert (model.num_alloc_retries, model.num_ooms) == (1, 1) and model.reserved_bytes == 3 * GIB
    model.free(4)
    assert model.allocate(2 * GIB, handle=6) == 2 * GIB  # the retry returns the empty 1 GiB segment first
    assert (model.num_alloc_retries, model.num_ooms) == (2, 1) and model.reserved_bytes == 4 * GIB
