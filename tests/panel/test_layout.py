"""What the panel lays out for the width it has: spaced marker labels, truthful host and full-scale controls."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest

from gpumem.core.monitoring.monitor import Monitor
from gpumem.panel.curves import (
    MARK_GROUP_PX,
    MARK_LABEL_BAND_PX,
    MARK_LABEL_CHAR_PX,
    MARK_LABEL_GAP_PX,
    MARK_LABEL_OFFSET_PX,
    CurveFrame,
    group_marks,
    layout_marks,
)
from gpumem.panel.options import (
    COMPACT_PLOT_HEIGHT_PX,
    COMPACT_PLOT_WIDTH_PX,
    INLINE_PLOT_HEIGHT_PX,
    INLINE_PLOT_WIDTH_PX,
)
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


def _label_boxes(frame: CurveFrame, width_px: float) -> dict[int, tuple[float, float]]:
    """(left, right) in px of each drawn label, by mark: it ends just left of its line, or starts just right
    of it (``mark_label_right``)."""
    span = frame.x_max_ms - frame.x_min_ms
    on_right = frame.mark_label_right or (False,) * len(frame.mark_labels)
    boxes = {}
    for index, (x, label) in enumerate(zip(frame.mark_x_ms, frame.mark_labels, strict=True)):
        if label:
            line = (x - frame.x_min_ms) / span * width_px
            width = len(label) * MARK_LABEL_CHAR_PX
            if on_right[index]:
                boxes[index] = (line + MARK_LABEL_OFFSET_PX, line + MARK_LABEL_OFFSET_PX + width)
            else:
                boxes[index] = (line - MARK_LABEL_OFFSET_PX - width, line - MARK_LABEL_OFFSET_PX)
    return boxes


def _lines_crossing_labels(frame: CurveFrame, width_px: float) -> list[tuple[int, int]]:
    """(line, label) pairs where a mark's full-height line runs through another mark's label."""
    span = frame.x_max_ms - frame.x_min_ms
    tops = frame.mark_tops or (1.0,) * len(frame.mark_labels)
    crossings = []
    for index, x in enumerate(frame.mark_x_ms):
        px = (x - frame.x_min_ms) / span * width_px
        for other, (left, right) in _label_boxes(frame, width_px).items():
            if other != index and left - 1 <= px <= right + 1 and tops[index] >= 1.0:
                crossings.append((index, other))
    return crossings


# Cells 9..40 one second apart in a one-minute window, the panel opened among them, then a Free: the pile-up
# "[9][10][11][12]free" and the barcode of a 250 px sidebar.
_CROWD_X = [1000.0 * i for i in range(20, 52)] + [35_500.0, 52_500.0]
_CROWD_LABELS = [f"[{n}]" for n in range(9, 41)] + ["panel opened", "free"]


def _crowd() -> CurveFrame:
    order = np.argsort(_CROWD_X, kind="stable")
    return _frame([_CROWD_X[i] for i in order], [_CROWD_LABELS[i] for i in order])


@pytest.mark.parametrize("width_px", [COMPACT_PLOT_WIDTH_PX, INLINE_PLOT_WIDTH_PX])
def test_crowded_marks_are_grouped_and_no_line_crosses_a_label(width_px: int) -> None:
    laid = layout_marks(_crowd(), width_px, COMPACT_PLOT_HEIGHT_PX)
    shown = [label for label in laid.mark_labels if label]
    # The named marks come first: labelled wherever their label fits inside the plot (at 114 px, "panel
    # opened" would run off the left edge).
    assert "free" in shown
    assert ("panel opened" in shown) == (width_px == INLINE_PLOT_WIDTH_PX), shown
    # Grouped: fewer lines than cells, each cell in exactly one group, no two cell lines closer than a group.
    grouped = group_marks(_crowd(), width_px)
    assert laid.mark_x_ms.tolist() == grouped.mark_x_ms.tolist()
    assert len(grouped.mark_labels) < len(_CROWD_LABELS)
    cells = [i for i, label in enumerate(grouped.mark_labels) if label.startswith("[")]
    px = (grouped.mark_x_ms - grouped.x_min_ms) / (grouped.x_max_ms - grouped.x_min_ms) * width_px
    assert all(b - a >= MARK_GROUP_PX for a, b in itertools.pairwise(px[cells].tolist()))
    covered = [n for i in cells for n in _cell_range(grouped.mark_labels[i])]
    assert covered == list(range(9, 41)), grouped.mark_labels
    boxes = sorted(_label_boxes(laid, width_px).values())
    for (_, right), (left, _) in itertools.pairwise(boxes):
        assert left - right >= MARK_LABEL_GAP_PX - 1e-9, "labels never overlap"
    assert all(left >= 0 and right <= width_px for left, right in boxes), "no label runs off the plot"
    assert _lines_crossing_labels(laid, width_px) == [], "no full-height line runs through a label"
    assert min(laid.mark_tops) < 1.0, "the lines that would cross a label stop under the labels' band"


@pytest.mark.parametrize("width_px", [COMPACT_PLOT_WIDTH_PX, INLINE_PLOT_WIDTH_PX])
def test_no_line_crosses_a_label_when_drawn_wider_than_laid_out(width_px: int) -> None:
    # Laid out at the narrowest width, drawn at any wider one: labels keep their pixel size while lines spread.
    # The panel opened at the left edge (its label goes right of its line), cells ran within a pixel after it.
    opened = _frame([600.0, 700.0, 800.0, 30_000.0], ["panel opened", "[4]", "[5]", "[6]"])
    for frame in (opened, _crowd()):
        laid = layout_marks(frame, width_px, COMPACT_PLOT_HEIGHT_PX)
        assert any(laid.mark_labels), laid.mark_labels
        for scale in (1.0, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0):
            assert _lines_crossing_labels(laid, width_px * scale) == [], (scale, laid.mark_labels, laid.mark_tops)


def _cell_range(label: str) -> list[int]:
    first, _, last = label.strip("[]").partition("\u2013")
    return list(range(int(first), int(last or first) + 1))


def test_dense_cells_make_one_mark_with_their_range() -> None:
    frame = _frame([10_000.0, 10_100.0, 10_200.0, 40_000.0], ["[3]", "[4]", "[5]", "[6]"])
    grouped = group_marks(frame, COMPACT_PLOT_WIDTH_PX)
    assert grouped.mark_labels == ("[3\u20135]", "[6]")
    assert grouped.mark_x_ms.tolist() == [10_000.0, 40_000.0], "a group's line is where its first cell started"


def test_named_marks_are_never_grouped() -> None:
    # A Free among dense cells keeps its own line; the cells around it still make one group.
    frame = _frame([10_000.0, 10_100.0, 10_200.0], ["[3]", "free", "[4]"])
    grouped = group_marks(frame, COMPACT_PLOT_WIDTH_PX)
    assert grouped.mark_labels == ("[3\u20134]", "free")
    assert grouped.mark_x_ms.tolist() == [10_000.0, 10_100.0]


def test_marks_far_apart_are_all_labelled_and_drawn_full_height() -> None:
    frame = _frame([10_000.0, 30_000.0, 50_000.0], ["[1]", "[2]", "free"])
    laid = layout_marks(frame, INLINE_PLOT_WIDTH_PX, INLINE_PLOT_HEIGHT_PX)
    assert laid.mark_labels == ("[1]", "[2]", "free")
    assert laid.mark_tops == (1.0, 1.0, 1.0)


def test_a_label_with_no_room_on_the_left_goes_right_of_its_line() -> None:
    frame = _frame([100.0, 40_000.0], ["panel opened", "[3]"])
    laid = layout_marks(frame, INLINE_PLOT_WIDTH_PX, INLINE_PLOT_HEIGHT_PX)
    assert laid.mark_labels == ("panel opened", "[3]")
    assert laid.mark_label_right == (True, False)
    boxes = sorted(_label_boxes(laid, INLINE_PLOT_WIDTH_PX).values())
    assert boxes[0][1] + MARK_LABEL_GAP_PX <= boxes[1][0]


def test_a_label_with_no_room_on_either_side_is_left_off() -> None:
    frame = _frame([100.0, 40_000.0], ["panel opened", "[3]"])
    # "panel opened" goes right of its line; "[3]" fits on neither side of it then.
    assert layout_marks(frame, COMPACT_PLOT_WIDTH_PX, COMPACT_PLOT_HEIGHT_PX).mark_labels == ("panel opened", "")


def test_the_highest_curve_stays_under_the_labels_band() -> None:
    source = FakeSource(devices=0, host_rss_bytes=3 * GIB, host_total_bytes=64 * GIB)
    monitor = Monitor(source)
    panel = Panel(monitor, autostart=False, compact=True)
    monitor.sampler.sample_once()
    monitor.sampler.sample_once()
    assert panel.refresh()
    frame = panel._last_frame
    assert frame is not None
    top_px = (1 - float(np.nanmax(frame.y)) / frame.y_max) * COMPACT_PLOT_HEIGHT_PX
    assert top_px >= MARK_LABEL_BAND_PX


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


def test_the_view_draws_right_labels_with_their_own_mark_and_empties_it_after() -> None:
    source = FakeSource(devices=0, host_rss_bytes=3 * GIB, host_total_bytes=64 * GIB)
    monitor = Monitor(source)
    panel = Panel(monitor, autostart=False)
    laid = layout_marks(_frame([100.0, 40_000.0], ["panel opened", "[3]"]), INLINE_PLOT_WIDTH_PX, INLINE_PLOT_HEIGHT_PX)
    panel._show_marks(laid)
    assert list(panel._cell_labels.text) == ["", "[3]"]
    assert list(panel._cell_labels_right.text) == ["panel opened", ""] and panel._cell_labels_right.visible
    panel._show_marks(_frame([40_000.0], ["[3]"]))
    assert len(panel._cell_labels_right.x) == 0 and not panel._cell_labels_right.visible
    assert list(panel._cell_labels.text) == ["[3]"]
