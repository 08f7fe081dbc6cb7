"""The read-only panel of a loaded session: the live panel's frame and header builders over the exported
timeline and the figures at export, in the same widgets, with no thread and no sampler."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _harness import gpumem_loaded
from gpumem.core.readers.readings import DeviceInfo
from gpumem.core.sampling.timeline import Timeline
from gpumem.core.sessions.session_file import SessionData, capture_session, read_session, write_session
from gpumem.panel.loaded import LoadedPanel, close_loaded
from gpumem.testing import GIB, MIB, FakeSource

H200 = DeviceInfo(0, 0, "NVIDIA H200", "", "", 140 * GIB)


def _recorded(tmp_path: Path, *, cuda: bool = True) -> SessionData:
    """A session as export writes it and load reads it: 90 s of samples, a staircase, then a drop; marks."""
    source = FakeSource(devices=1, total_bytes=140 * GIB, nvml=cuda)
    timeline = Timeline()
    for step in range(300):
        time_s = 1000.0 + step * 0.3
        allocated = (400 + 224 * min(max(step - 100, 0), 100) // 5) * MIB if step < 250 else 400 * MIB
        values = {"host/rss": float(GIB + step * MIB)}
        if cuda:
            values |= {"cuda:0/allocated": allocated, "cuda:0/reserved": 6 * GIB if step < 280 else GIB}
            values["cuda:0/used"] = values["cuda:0/reserved"] + 500 * MIB
        timeline.append(time_s, values)
        if step % 50 == 0:
            timeline.add_mark(time_s, str(step // 50 + 3))
    timeline.add_mark(1084.0, "free")
    if cuda:
        source.allocate(400 * MIB)
    else:
        source.cuda_initialized = False
    data = capture_session(timeline, [], snapshot=source.snapshot(), devices=[H200] if cuda else [])
    write_session(data, tmp_path / "run.json")
    return read_session(tmp_path / "run.json")


def test_the_cuda_curves_marks_and_figures_of_the_recording(tmp_path: Path) -> None:
    threads = threading.active_count()
    panel = LoadedPanel(_recorded(tmp_path), "run.json")
    try:
        assert threading.active_count() == threads  # nothing samples, nothing pushes
        assert list(panel._curves.labels) == ["allocated", "reserved", "device used (all processes)"]
        y = np.asarray(panel._curves.y)
        assert y.shape[0] == 3
        allocated = y[0][np.isfinite(y[0])]
        assert allocated.max() == pytest.approx((400 + 224 * 20) / 1024, rel=1e-4)  # GiB: the staircase's top
        assert allocated[-1] == pytest.approx(400 / 1024, rel=1e-4)
        # [3] sits at the left edge: its label has no room there
        assert list(panel._cell_labels.text) == ["", "[4]", "[5]", "[6]", "[7]", "[8]", "free"]
        header = panel._header.value
        assert "cuda:0 · NVIDIA H200 · 140.0 GiB" in header
        assert "peak recorded" in header
        assert "≥ 4.8 GiB" in header  # the curve's top, a lower bound
        assert "400.0 MiB" in header  # allocated at export
        assert "Host memory" not in header
        assert panel._actions.layout.display == "none"  # no Free, Pause or Reset peak on a recording
        assert panel._message.value.count("Recorded session run.json, 90 s, read-only") == 1
    finally:
        panel.close()


def test_the_window_counts_back_from_the_recordings_end(tmp_path: Path) -> None:
    panel = LoadedPanel(_recorded(tmp_path), "run.json")
    try:
        whole = panel._x_scale.min, panel._x_scale.max
        assert whole == (None, None)  # the scale fits the drawn points: the whole recording
        first = np.asarray(panel._curves.x)[0]
        panel._window.value = "1 min"  # as a click on the control
        assert panel.options.window_s == 60.0
        x = np.asarray(panel._curves.x)
        assert (x[0] - first) / np.timedelta64(1, "s") == pytest.approx(89.7 - 60.0)  # 60 s back from the end
        assert (x[-1] - x[0]) / np.timedelta64(1, "s") == pytest.approx(60.0)
    finally:
        panel.close()


def test_a_host_only_recording_shows_the_host_curve_and_says_why(tmp_path: Path) -> None:
    panel = LoadedPanel(_recorded(tmp_path, cuda=False), "cpu.json")
    try:
        assert list(panel._curves.labels) == ["host RSS"]
        assert "No CUDA device is in use: the recorded session used none." in panel._header.value
    finally:
        panel.close()


def test_an_older_export_without_figures_or_store_still_draws(tmp_path: Path) -> None:
    data = _recorded(tmp_path)
    older = SessionData(data.timeline, data.marks, data.cells, data.wall_offset_s, data.exported_wall_s)
    panel = LoadedPanel(older, "old.json")
    try:
        assert list(panel._curves.labels) == ["allocated", "reserved", "device used (all processes)"]
        assert "older than the figures at export" in panel._header.value
    finally:
        panel.close()


def test_unload_closes_every_loaded_panel(tmp_path: Path) -> None:
    panels = [LoadedPanel(_recorded(tmp_path), "run.json") for _ in range(2)]
    close_loaded()
    assert all(panel.comm is None for panel in panels)


def test_unloading_the_extension_closes_loaded_panels(ip: Any, tmp_path: Path) -> None:
    with gpumem_loaded(ip, FakeSource()):
        panel = LoadedPanel(_recorded(tmp_path), "run.json")
        assert ip.run_cell("%unload_ext gpumem").success
        assert panel.comm is None
        assert ip.run_cell("%load_ext gpumem").success  # loaded again for the fixture's own unload
