"""``%gpumem summary``'s figures: exact lines from a stats dict and segment list, the counters a torch
lacks named, the real CPU-only torch refused with its reason (never starting CUDA), and the JSON dump."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from gpumem.core.atomic_files import ForeignFileError
from gpumem.core.diagnoses.summary import (
    JSON_MARKER,
    SummaryUnavailableError,
    build_summary,
    read_stats,
    write_stats_json,
)
from gpumem.testing import FakeSource

M = 1 << 20


def _stats() -> dict[str, int]:
    stats: dict[str, int] = {}
    pools = {
        "allocated_bytes": (100 * M, 96 * M, 4 * M),
        "reserved_bytes": (120 * M, 116 * M, 4 * M),
        "active_bytes": (100 * M, 96 * M, 4 * M),
        "inactive_split_bytes": (6 * M, 4 * M, 2 * M),
    }
    for prefix, values in pools.items():
        for pool, value in zip(("all", "large_pool", "small_pool"), values, strict=True):
            stats[f"{prefix}.{pool}.current"] = value
            stats[f"{prefix}.{pool}.peak"] = 2 * value
            stats[f"{prefix}.{pool}.allocated"] = 3 * value
    for pool, count in (("all", 5), ("large_pool", 3), ("small_pool", 2)):
        stats[f"segment.{pool}.current"] = count
        stats[f"segment.{pool}.peak"] = count + 1
    stats.update(num_alloc_retries=1, num_ooms=0, num_device_alloc=9, num_device_free=4)
    return stats


SEGMENTS = [
    {
        "device": 0,
        "segment_type": "large",
        "total_size": 20 * M,
        "blocks": [{"size": 12 * M, "state": "active_allocated"}, {"size": 8 * M, "state": "inactive"}],
    },
    {"device": 0, "segment_type": "large", "total_size": 22 * M, "blocks": [{"size": 22 * M, "state": "inactive"}]},
    {"device": 1, "segment_type": "large", "total_size": 40 * M, "blocks": [{"size": 40 * M, "state": "inactive"}]},
]


def test_every_figure_on_its_line_with_what_it_means() -> None:
    lines = repr(build_summary(_stats(), 0, SEGMENTS)).splitlines()
    large = "requests over 1 MiB; segments of 20 MiB, or the request rounded up to 2 MiB above 10 MiB"
    small = "requests of 1 MiB or less; 2 MiB segments"
    assert lines == [
        "gpumem summary of cuda:0 (PyTorch's caching allocator)",
        "                          current       peak",
        (
            "  allocated             100.0 MiB  200.0 MiB  in tensors now (torch.cuda.memory_allocated), rounded up to "
            "512 B blocks"
        ),
        f"    large pool           96.0 MiB  192.0 MiB  {large}",
        f"    small pool            4.0 MiB    8.0 MiB  {small}",
        (
            "  reserved              120.0 MiB  240.0 MiB  taken from CUDA by the allocator, in tensors or cached "
            "(memory_reserved)"
        ),
        f"    large pool          116.0 MiB  232.0 MiB  {large}",
        f"    small pool            4.0 MiB    8.0 MiB  {small}",
        (
            "  active                100.0 MiB  200.0 MiB  allocated, plus freed blocks still waiting for another "
            "stream's work"
        ),
        f"    large pool           96.0 MiB  192.0 MiB  {large}",
        f"    small pool            4.0 MiB    8.0 MiB  {small}",
        "  inactive split          6.0 MiB   12.0 MiB  free pieces of split blocks: reusable, not returnable to CUDA",
        f"    large pool            4.0 MiB    8.0 MiB  {large}",
        f"    small pool            2.0 MiB    4.0 MiB  {small}",
        "  free reserve           20.0 MiB             reserved minus allocated: cached for reuse",
        (
            "  largest free block     22.0 MiB             the largest request over 1 MiB the reserve serves without a "
            "new cudaMalloc (from the segments)"
        ),
        (
            "  empty_cache() frees    22.0 MiB             what torch.cuda.empty_cache() would return to CUDA now: "
            "segments with no live block"
        ),
        "  segments                      5          6  chunks reserved from CUDA",
        f"    large pool                  3          4  {large}",
        f"    small pool                  2          3  {small}",
        (
            "  allocation retries            1             cudaMalloc failed, the cache was freed and it retried "
            "(memory is tight)"
        ),
        "  out-of-memory errors          0             allocations that raised torch.OutOfMemoryError",
        (
            "  device mallocs                9             cudaMalloc (or cuMemMap) calls: each is slow and may "
            "synchronize"
        ),
        (
            "  device frees                  4             cudaFree (or cuMemUnmap) calls: empty_cache() and retries "
            "cause these"
        ),
    ]


def test_figures_are_the_exact_counters() -> None:
    summary = build_summary(_stats(), 0, SEGMENTS)
    assert summary.figure("allocated_bytes.all")[2:4] == (100 * M, 200 * M)
    assert summary.figure("reserved_bytes.large_pool")[2:4] == (116 * M, 232 * M)
    assert summary.figure("num_device_alloc").current == 9
    assert summary.figure("largest_free_block").current == 22 * M
    other = build_summary(_stats(), 1, SEGMENTS)  # its own segments only
    assert other.figure("largest_free_block").current == 40 * M
    assert "<td>largest free block</td>" in summary._repr_html_()


def test_what_an_older_torch_does_not_count_is_named() -> None:
    stats = {"allocated_bytes.all.current": 512, "allocated_bytes.all.peak": 1024}
    assert repr(build_summary(stats, 0, None)).splitlines() == [
        "gpumem summary of cuda:0 (PyTorch's caching allocator)",
        "             current     peak",
        "  allocated    512 B  1.0 KiB  in tensors now (torch.cuda.memory_allocated), rounded up to 512 B blocks",
        "The segments could not be read, so the largest free block is not shown.",
        "This PyTorch does not count: allocation retries, out-of-memory errors, device mallocs, device frees.",
    ]


def test_real_torch_without_cuda_is_refused_without_starting_it() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this torch has a CUDA device")
    with pytest.raises(SummaryUnavailableError) as refused:
        read_stats(object(), 0)
    expected = "CUDA is not initialized in this process (this PyTorch build has no CUDA support)"
    if torch.version.cuda is not None:
        expected = "CUDA is not initialized in this process (no tensor has been put on a GPU yet)"
    assert str(refused.value) == expected + "; nothing to summarize"
    assert not torch.cuda.is_initialized()


def test_without_torch_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # type: ignore[arg-type]
    with pytest.raises(SummaryUnavailableError, match="PyTorch is not imported in this process"):
        read_stats(object(), 0)


class _StatsSource(FakeSource):
    def memory_stats(self, device: int) -> dict[str, Any]:
        return {"allocated_bytes.all.current": 1000 + device}


def test_a_source_with_its_own_stats_is_read() -> None:
    assert read_stats(_StatsSource(), 1) == {"allocated_bytes.all.current": 1001}


def test_json_dump_is_complete_and_atomic(tmp_path: Path) -> None:
    target = tmp_path / "stats.json"
    assert write_stats_json({0: _stats()}, target) is False
    written = json.loads(target.read_text())
    assert written == {JSON_MARKER: 1, "devices": {"0": _stats()}}
    assert write_stats_json({0: {"num_ooms": 2}}, target) is True
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    with pytest.raises(ForeignFileError):
        write_stats_json({0: {}}, notes)
    assert notes.read_text() == '{"mine": 1}'
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.json", "stats.json"]
