"""What the panel lays out for the width it has: spaced marker labels, truthful host and full-scale controls."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest

from gpumem.core.monitor import Monitor
from gpumem.panel.curves import MARK_LABEL_CHAR_PX, MARK_LABEL_GAP_PX, CurveFrame, label_spaced_marks
from gpumem.panel.options import COMPACT_PLOT_WIDTH_PX, INLINE_PLOT_WIDTH_PX
from gpumem.panel.widget import Panel, close_all
from gpumem.testing import GIB, FakeSource


@pytest.fixture(autouse=True)
def _clean_panels() -> Iterator[None]:
    yield
    close_all()


def _frame(mark_x_ms: list[float], labels: list[str], span_ms: float = 60_000.0) -> CurveFrame:
    return CurveFrame(
        x_ms=np.zeros(0), y=np.zeros((0, 0), dtype=np.float32), curves=(), unit="GiB", unit_bytes=GIB,
        x_min_ms=0.0, x_max_ms=span_ms, y_max=1.0, y_ticks=(0.0, 1.0), capacity=(), capacity_off_scale=(),
        mark_x_ms=np.asarray(mark_x_ms, dtype=np.float64), mark_labels=tuple(labels),
    )  # fmt: skip


def _label_boxes(frame: CurveFrame, width_px: float) -> list[tuple[float, float]]:
    """(left, right) in px of each drawn label: it ends at its line (align end)."""
    span = frame.x_max_ms - frame.x_min_ms
    boxes = []
    for x, label in zip(frame.mark_x_ms, frame.mark_labels, strict=True):
        if label:
            right = (x - frame.x_min_ms) / span * width_px
            boxes.append((right - len(label) * MARK_LABEL_CHAR_PX, right))
    return boxes


@pytest.mark.parametrize("width_px", [COMPACT_PLOT_WIDTH_PX, INLINE_PLOT_WIDTH_PX])
def test_crowded_marks_keep_every_line_and_labels_never_overlap(width_px: int) -> None:
    # Cells 9..40 one second apart in a one-minute window, then a Free: the pile-up "[9][10][11][12]free".
    x = [1000.0 * i for i in range(20, 52)] + [52_500.0]
    labels = [f"[{n}]" for n in range(9, 41)] + ["free"]
    spaced = label_spaced_marks(_frame(x, labels), width_px)
    assert spaced.mark_x_ms.tolist() == x, "every mark keeps its line"
    shown = [label for label in spaced.mark_labels if label]
    assert shown[-1] == "free", "the newest mark is always labelled"
    assert 2 <= len(shown) < len(labels)
    boxes = _label_boxes(spaced, width_px)
    for (_, right), (left, _) in itertools.pairwise(boxes):
        assert left - right >= MARK_LABEL_GAP_PX - 1e-9
    assert all(left >= 0 for left, _ in boxes), "no label runs off the plot's left edge"


def test_marks_far_apart_are_all_labelled() -> None:
    frame = _frame([10_000.0, 30_000.0, 50_000.0], ["[1]", "[2]", "free"])
    assert label_spaced_marks(frame, INLINE_PLOT_WIDTH_PX).mark_labels == ("[1]", "[2]", "free")


def test_a_label_too_close_to_the_left_edge_is_left_off() -> None:
    frame = _frame([100.0, 40_000.0], ["panel opened", "[3]"])
    assert label_spaced_marks(frame, COMPACT_PLOT_WIDTH_PX).mark_labels == ("", "[3]")


def test_without_a_gpu_the_host_box_is_ticked_disabled_and_restored_when_a_gpu_appears() -> None:
    source = FakeSource(devices=0, host_rss_bytes=3 * GIB, host_total_bytes=64 * GIB)
    monitor = Monitor(source)
    panel = Panel(monitor, autostart=False, host=False)
    monitor.sampler.sample_once()
    assert panel.refresh()
    assert panel._host.disabled and panel._host.value
    assert "No GPU in use" in panel._host.tooltip
    assert [c.label for c in panel._last_frame.curves] == ["host RSS"]  # type: ignore[union-attr]
    panel.show_devices((0,), {})
    assert not panel._host.disabled
    assert panel._host.value is False, "the user's choice comes back with a GPU"


def test_full_scale_without_a_gpu_is_the_machines_ram() -> None:
    source = FakeSource(devices=0, host_rss_bytes=800 << 20, host_total_bytes=24 * GIB)
    monitor = Monitor(source)
    panel = Panel(monitor, autostart=False, full_scale=True)
    monitor.sampler.sample_once()
    monitor.sampler.sample_once()
    assert panel.refresh()
    assert panel._y_scale.max >= 24.0
    assert panel._y_axis.label == "GiB"
    panel._full_scale.value = False
    assert panel.refresh()
    assert panel._y_axis.label == "MiB"
    assert panel._y_scale.max <= 1000  # back to the data: 800 MiB of RSS
