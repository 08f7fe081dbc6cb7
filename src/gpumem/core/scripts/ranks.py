"""Every rank's memory on rank 0, through torch.distributed's own object collectives (gloo or NCCL).

Each rank sends plain data (a :class:`RankFigures`), so nothing CUDA-specific crosses the wire; with
NCCL, torch moves the pickled bytes through the current CUDA device, which the job has set already.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, NamedTuple

from gpumem.core.monitoring.spans import DeviceChange, SpanRecord, counter_changes
from gpumem.core.units import format_bytes

__all__ = ["RankFigures", "RankReport", "gather", "rank_figures"]


class RankFigures(NamedTuple):
    """One process's figures: per device, now and the highest peak recorded (tags, scopes, counters)."""

    rank: int
    world_size: int
    hostname: str
    pid: int
    devices: tuple[DeviceChange, ...]
    host_rss_bytes: int | None
    host_peak_rss_bytes: int | None  # lifetime peak of the process (exact)


class RankReport(NamedTuple):
    ranks: tuple[RankFigures, ...]

    def peaks(self) -> dict[int, int]:
        """Per rank, its highest peak allocated on any device."""
        return {rank.rank: max((d.peak_allocated_bytes for d in rank.devices), default=0) for rank in self.ranks}

    def imbalance_text(self) -> str:
        peaks = self.peaks()
        if len(peaks) < 2:  # noqa: PLR2004 - an imbalance needs two ranks
            return ""
        if not any(peaks.values()):
            return "imbalance: no CUDA peaks to compare"
        high = max(peaks, key=lambda rank: peaks[rank])
        low = min(peaks, key=lambda rank: peaks[rank])
        spread = peaks[high] - peaks[low]
        ratio = f"{peaks[high] / peaks[low]:.2f}x" if peaks[low] else "inf"
        return (
            f"imbalance: rank {high} peaks at {format_bytes(peaks[high])}, rank {low} at {format_bytes(peaks[low])} "
            f"({format_bytes(spread)} apart, {ratio})"
        )


def _highest(records: list[SpanRecord], now: DeviceChange) -> DeviceChange:
    """The device's figures now, with the highest peak recorded on it; exact if that peak is."""
    best = now
    for record in records:
        figures = record.device(now.device)
        if figures is not None and figures.peak_allocated_bytes > best.peak_allocated_bytes:
            best = now._replace(
                peak_allocated_bytes=figures.peak_allocated_bytes,
                peak_reserved_bytes=max(figures.peak_reserved_bytes, now.peak_reserved_bytes),
                peak_exact=figures.peak_exact,
                peak_note=figures.peak_note,
            )
    return best


def rank_figures(monitor: Any, rank: int, world_size: int) -> RankFigures:
    """This process's figures: the counters now, raised to the highest peak its tags and scopes saw."""
    snapshot = monitor.snapshot()
    records = list(monitor.recorder.tags) + list(monitor.recorder.scopes)
    now = counter_changes(snapshot, "the counter's value since it was last reset")
    devices = [_highest(records, figures) for figures in now]
    host = snapshot.host
    return RankFigures(
        rank, world_size, socket.gethostname(), os.getpid(), tuple(devices),
        host.rss_bytes if host else None, host.peak_rss_bytes if host else None,
    )  # fmt: skip


def _dist() -> Any:
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "monitor.gather() needs a torch.distributed process group: call "
            "torch.distributed.init_process_group(...) first (torchrun sets the environment for it)"
        )
    return dist


def gather(monitor: Any, *, group: Any = None, all_ranks: bool = False, dst: int = 0) -> RankReport | None:
    """Every rank calls it with its gpumem Monitor; rank ``dst`` (every rank with ``all_ranks``) gets the
    report, the others None."""
    dist = _dist()
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    mine = rank_figures(monitor, rank, world_size)
    if all_ranks:
        everyone: list[Any] = [None] * world_size
        dist.all_gather_object(everyone, mine, group=group)
        return _report(everyone)
    received: list[Any] | None = [None] * world_size if rank == dst else None
    dist.gather_object(mine, received, dst=dst, group=group)
    return _report(received) if received is not None else None


def _report(received: list[Any]) -> RankReport:
    return RankReport(tuple(sorted(received, key=lambda figures: figures.rank)))
