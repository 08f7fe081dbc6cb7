"""Automatic mode's shortcuts for the usual cell (nothing changed, nothing raised, the same source again) give
what the full path gives, in a real IPython shell over the fake allocator: each test runs cells down both paths.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from _harness import gpumem_loaded, run_cell_capture
from gpumem.core.cells import CellOptions, CellRecord
from gpumem.core.cells.record import HostChange, first_line_of, source_key
from gpumem.ipython import extension as _extension
from gpumem.testing import GIB, MIB, FakeSource


@pytest.fixture
def shell(ip: Any) -> Iterator[Any]:
    source = FakeSource(total_bytes=10 * GIB)
    with gpumem_loaded(ip, source) as loaded:
        loaded.user_ns.update(src=source, GIB=GIB, MIB=MIB)
        run_cell_capture(loaded, "%gpumem auto on")
        run_cell_capture(loaded, "first = src.allocate(MIB)")  # a device in use from here on
        yield loaded


def _last_record() -> CellRecord:
    state = _extension.get_state()
    assert state is not None
    return state.tracker.history[-1]


def _gpumem_lines(cap: Any) -> list[str]:
    return [o.data.get("text/plain", "") for o in cap.outputs if "gpumem" in o.data.get("text/plain", "")]


def test_the_options_follow_every_change_of_the_settings(shell: Any) -> None:
    state = _extension.get_state()
    assert state is not None

    def built_now() -> CellOptions:  # what the settings say, built afresh
        attribute = {"changed": None, "always": True, "never": False}[state.config.vars]
        return CellOptions(keep_peaks=state.config.keep_peaks, attribute=attribute, mode="auto")

    run_cell_capture(shell, "x = 1")
    assert not _last_record().keep_peaks
    assert state.auto_options() == built_now() and state.auto_options() is state.auto_options()
    run_cell_capture(shell, "%config GpuMem.keep_peaks = True")
    run_cell_capture(shell, "x = 2")
    assert _last_record().keep_peaks  # the setting made between the cells applies to the next one
    assert state.auto_options() == built_now()
    run_cell_capture(shell, "%gpumem auto on --vars always")
    run_cell_capture(shell, "x = 3")
    assert state.auto_options() == built_now() and state.auto_options().attribute is True
    assert "not inspected" not in _last_record().variables_note
    state.config.vars = "never"  # set directly, as a configurable
    run_cell_capture(shell, "x = 4")
    assert _last_record().variables_note == "variables not inspected (turned off)"


def test_a_repeated_source_is_named_as_a_new_one_is(shell: Any) -> None:
    cells = ["a = 1", "a = 1", "# note\n\nb = 2  ", "a = 1", "c = 3\n", "c = 3\n"]
    for cell in cells:
        run_cell_capture(shell, cell)
        record = _last_record()
        assert record.source_hash == source_key(cell)
        assert record.first_line == first_line_of(cell)


def test_a_cell_that_changed_nothing_reports_as_one_that_did(shell: Any) -> None:
    run_cell_capture(shell, "del first; kept = src.allocate(99 * MIB); src.transient(GIB)")
    grown = _last_record()
    assert [(change.allocated_delta_bytes, change.peak_above_start_bytes) for change in grown.devices] == [
        (99 * MIB, 1123 * MIB)
    ]
    _result, cap = run_cell_capture(shell, "x = 1")
    same = _last_record()
    (change,) = same.devices
    assert change.allocated_before_bytes == change.allocated_after_bytes == 100 * MIB
    assert change.peak_allocated_bytes == 100 * MIB and change.peak_exact
    assert same.host is not None and same.host.peak_rss_bytes >= same.host.rss_after_bytes
    assert same.largest_change_bytes() == 0 and not same.warnings and not _gpumem_lines(cap)
    # The counter kept (still at the earlier spike): the sampled bound is the larger of the start and end levels.
    run_cell_capture(shell, "%config GpuMem.keep_peaks = True")
    run_cell_capture(shell, "src.transient(GIB)")
    run_cell_capture(shell, "more = src.allocate(10 * MIB)")
    (change,) = _last_record().devices
    assert not change.peak_exact and change.peak_allocated_bytes == 110 * MIB
    run_cell_capture(shell, "src.free(more); del more")
    (change,) = _last_record().devices
    assert not change.peak_exact and change.peak_allocated_bytes == 110 * MIB


def test_a_full_device_is_told_once_forgotten_when_freed_and_told_again(shell: Any) -> None:
    _result, cap = run_cell_capture(shell, "x = 1")
    assert not _last_record().warnings  # nothing held: the quick path
    _result, cap = run_cell_capture(shell, "big = src.allocate(9 * GIB + 512 * MIB)")
    (line,) = _gpumem_lines(cap)
    assert "cuda:0 is 100% full after this cell" in line
    assert [w.kind for w in _last_record().warnings] == ["capacity"]
    _result, cap = run_cell_capture(shell, "x = 2")
    assert not _last_record().warnings and not _gpumem_lines(cap)  # standing: not repeated
    run_cell_capture(shell, "src.free(big); del big; src.empty_cache()")
    assert not _last_record().warnings
    _result, cap = run_cell_capture(shell, "big = src.allocate(9 * GIB + 512 * MIB)")
    assert [w.kind for w in _last_record().warnings] == ["capacity"]  # forgotten when freed: told again


def test_only_a_cell_that_raised_is_looked_at_for_an_out_of_memory_error(shell: Any) -> None:
    pytest.importorskip("torch")
    _result, cap = run_cell_capture(shell, "x = 1")
    assert not cap.outputs
    _result, cap = run_cell_capture(shell, "raise ValueError('not memory')")
    assert not [o for o in cap.outputs if "out of memory" in o.data.get("text/plain", "")]
    cell = "import torch\nraise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0)')"
    _result, cap = run_cell_capture(shell, cell)
    explained = [o for o in cap.outputs if "gpumem: CUDA out of memory on cuda:0" in o.data["text/plain"]]
    assert len(explained) == 1 and "requested 2.0 GiB" in explained[0].data["text/plain"]


def _largest_as_defined(record: CellRecord) -> int:
    """The definition, figure by figure."""
    sizes = [0]
    for change in record.devices:
        sizes += [abs(change.allocated_delta_bytes), abs(change.reserved_delta_bytes)]
        sizes.append(max(change.peak_above_start_bytes, 0))
    if record.host is not None:
        sizes.append(abs(record.host.rss_delta_bytes))
    return max(sizes)


@pytest.mark.parametrize(
    ("allocated", "reserved", "peak", "rss"),
    [
        ((0, 0), (0, 0), 0, None),
        ((5, 3), (10, 2), 4, (7, 7)),  # everything shrank, peak below the start (a kept counter's bound)
        ((1, 9), (2, 2), 20, (1, 100)),
        ((9, 1), (40, 2), 9, (50, 3)),
    ],
)
def test_the_largest_change_is_the_definition(
    shell: Any, allocated: tuple[int, int], reserved: tuple[int, int], peak: int, rss: tuple[int, int] | None
) -> None:
    run_cell_capture(shell, "x = 1")
    template = _last_record()
    (change,) = template.devices
    device = change._replace(
        allocated_before_bytes=allocated[0],
        allocated_after_bytes=allocated[1],
        reserved_before_bytes=reserved[0],
        reserved_after_bytes=reserved[1],
        peak_allocated_bytes=peak,
    )
    host = HostChange(rss[0], rss[1], max(rss), False) if rss is not None else None
    for devices in ((device,), (device, device._replace(device=1, allocated_after_bytes=allocated[1] + 3)), ()):
        record = template._replace(devices=tuple(devices), host=host)
        assert record.largest_change_bytes() == _largest_as_defined(record)


def test_a_peak_reset_is_noticed_in_the_first_cell_that_makes_one(shell: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    source = shell.user_ns["src"]
    # The CPU build has no CUDA reset; stand in for it with one that resets the fake allocator.
    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", lambda d: source.reset_peaks([d]), raising=False)
    shell.user_ns["torch"] = torch
    run_cell_capture(shell, "src.transient(GIB)")
    (change,) = _last_record().devices
    assert change.peak_exact and not _last_record().warnings  # no reset counted yet: the quick answer
    _result, cap = run_cell_capture(shell, "src.transient(GIB); torch._C._cuda_resetPeakMemoryStats(0)")
    (change,) = _last_record().devices
    assert not change.peak_exact and [w.kind for w in _last_record().warnings] == ["peak-reset"]
    assert any("peak counter was reset inside the cell" in line for line in _gpumem_lines(cap))
    run_cell_capture(shell, "src.transient(GIB)")
    assert _last_record().devices[0].peak_exact  # counted resets from before the cell do not count
