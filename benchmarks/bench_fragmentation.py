"""What measuring fragmentation costs a cell.

1. The cheap check every measured cell makes per device in use (``device_warnings``: the near-full
   test and the fragmentation gate on the allocator counters already read), when nothing is suspicious,
   and when the free reserve is large but the counters have not moved since the last snapshot (the
   remembered answer is used).
2. Turning a ``torch.cuda.memory_snapshot()`` segment list into the free-reserve figures
   (``free_reserve``), for synthetic heaps of 1,000 to 100,000 blocks.
3. With CUDA: ``torch.cuda.memory_snapshot()`` itself on a heap of ``--tensors`` live tensors, without
   and with ``torch.cuda.memory._record_memory_history()`` (whose frames make it slower).

    python benchmarks/bench_fragmentation.py --out DIR [--tensors 20000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import timeit
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from gpumem.core.cells.conditions import ToldConditions, device_warnings  # noqa: E402
from gpumem.core.cells.record import DeviceChange  # noqa: E402
from gpumem.core.diagnoses.fragmentation import ReserveReader, free_reserve  # noqa: E402
from gpumem.testing import GIB, MIB, FakeSource  # noqa: E402


def per_call_us(call: Any, number: int) -> float:
    """The fastest of 5 timeit rounds, per call, in microseconds."""
    call()
    return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6


def cheap_check_us(fragmented: bool) -> float:
    source = FakeSource(segments=True)
    kept = [source.allocate(GIB) for _ in range(4)]
    if fragmented:  # 12 pieces of 424 MiB beside live tensors: the gate opens, the answer is remembered
        for handle in [source.allocate(GIB) for _ in range(12)]:
            source.free(handle)
        kept += [source.allocate(600 * MIB) for _ in range(12)]
    snapshot = source.snapshot()
    reading, device = snapshot.allocator[0], snapshot.devices[0]
    change = DeviceChange(
        0, reading.allocated_bytes, reading.allocated_bytes, reading.reserved_bytes, reading.reserved_bytes,
        reading.allocated_bytes, True, "", reading.reserved_bytes, device.used_bytes, device.used_bytes,
        device.total_bytes, False,
    )  # fmt: skip
    told, reader = ToldConditions(), ReserveReader()

    def check() -> None:
        device_warnings((change,), snapshot, snapshot, 0.9, told, reader, source)

    cost = per_call_us(check, 20_000)
    assert reader.reads == (1 if fragmented else 0), reader.reads
    return cost


def synthetic_segments(blocks: int) -> list[dict[str, Any]]:
    """Segments of 4 blocks each (live, free, live, free), as memory_snapshot() lists them."""
    segments = []
    for index in range(blocks // 4):
        states = ("active_allocated", "inactive", "active_allocated", "inactive")
        listed = [{"size": 2 * MIB, "state": state, "address": index * 8 * MIB + i * 2 * MIB} for i, state in
                  enumerate(states)]  # fmt: skip
        segments.append({"device": 0, "total_size": 8 * MIB, "segment_type": "large", "blocks": listed})
    return segments


def analysis_ms(blocks: int) -> float:
    segments = synthetic_segments(blocks)
    return per_call_us(lambda: free_reserve(segments), max(1, 20_000 // blocks)) / 1e3


def cuda_snapshot_ms(tensors: int) -> dict[str, float] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    held = [torch.empty((i % 7 + 1) << 20, dtype=torch.uint8, device="cuda:0") for i in range(tensors)]
    del held[::3]  # free pieces between live ones
    plain = per_call_us(torch.cuda.memory_snapshot, 5) / 1e3
    analysed = per_call_us(lambda: free_reserve(torch.cuda.memory_snapshot()), 5) / 1e3
    torch.cuda.memory._record_memory_history(stacks="python")
    try:
        more = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda:0") for _ in range(1000)]
        recording = per_call_us(torch.cuda.memory_snapshot, 3) / 1e3
        del more
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    segments = len(torch.cuda.memory_snapshot())
    del held
    torch.cuda.empty_cache()
    return {"snapshot_ms": plain, "snapshot_and_analysis_ms": analysed, "snapshot_recording_ms": recording,
            "segments": segments}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tensors", type=int, default=20_000)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "benchmark": "fragmentation",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "cheap_check_us": cheap_check_us(fragmented=False),
        "cheap_check_remembered_us": cheap_check_us(fragmented=True),
        "analysis_ms": {str(n): analysis_ms(n) for n in (1_000, 10_000, 100_000)},
        "cuda": cuda_snapshot_ms(args.tensors),
    }
    (args.out / "bench_fragmentation.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"### Fragmentation check ({result['date']}, Python {result['python']})",
        "",
        "| step | cost |",
        "| --- | --- |",
        f"| per cell and device, nothing suspicious | {result['cheap_check_us']:.1f} us |",
        f"| per cell and device, fragmented, counters unchanged | {result['cheap_check_remembered_us']:.1f} us |",
    ]
    lines += [f"| free_reserve() of {int(n):,} blocks | {ms:.2f} ms |" for n, ms in result["analysis_ms"].items()]
    cuda = result["cuda"]
    if cuda is not None:
        lines += [
            f"| torch.cuda.memory_snapshot(), {cuda['segments']:,} segments | {cuda['snapshot_ms']:.1f} ms |",
            f"| ... and free_reserve() | {cuda['snapshot_and_analysis_ms']:.1f} ms |",
            f"| ... while recording memory history | {cuda['snapshot_recording_ms']:.1f} ms |",
        ]
    (args.out / "bench_fragmentation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
