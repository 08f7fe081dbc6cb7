"""The size settings (``c.GpuMem.host_leak_min_bytes``, ``pattern_min_bytes``) in a real shell: sizes as text."""

from __future__ import annotations

from typing import Any

import pytest

from _harness import run_cell_capture
from gpumem.core.monitoring.monitor import Monitor
from gpumem.ipython import extension as _extension

MIB = 1 << 20


def test_sizes_in_the_config_reach_the_tracker(ip: Any, fake_monitor: Monitor) -> None:
    ip.config.GpuMem.host_leak_min_bytes = "64MiB"
    ip.config.GpuMem.pattern_min_bytes = 2048
    try:
        assert ip.run_cell("%load_ext gpumem").success
        state = _extension.get_state()
        assert state is not None
        assert state.tracker.host_leak_min_bytes == 64 * MIB
        assert state.tracker.pattern_min_bytes == 2048
        assert ip.run_cell("%config GpuMem.pattern_min_bytes = '1 GiB'").success
        assert state.tracker.pattern_min_bytes == 1 << 30
        assert ip.run_cell("%config GpuMem.host_leak_min_bytes = 4096").success
        assert state.tracker.host_leak_min_bytes == 4096
    finally:
        ip.run_cell("%unload_ext gpumem")
        del ip.config["GpuMem"]


def test_a_bad_size_is_refused_alone_in_one_line(
    ip: Any, fake_monitor: Monitor, capsys: pytest.CaptureFixture[str]
) -> None:
    ip.config.GpuMem.host_leak_min_bytes = "lots"
    ip.config.GpuMem.pattern_min_bytes = "8MiB"
    try:
        assert ip.run_cell("%load_ext gpumem").success
        state = _extension.get_state()
        assert state is not None
        assert state.tracker.host_leak_min_bytes == 32 * MIB  # the default
        assert state.tracker.pattern_min_bytes == 8 * MIB  # the other setting applies
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if "host_leak_min_bytes" in line]
        assert len(lines) == 1, err
        assert lines[0].startswith("gpumem: ignoring GpuMem.host_leak_min_bytes = 'lots' (the other settings apply)")
        assert "expected a size such as 64MiB" in lines[0]
        assert "Traceback" not in err
        run_cell_capture(ip, "%config GpuMem.pattern_min_bytes = 0")
        assert state.tracker.pattern_min_bytes == 8 * MIB  # below the minimum: refused, the value kept
    finally:
        ip.run_cell("%unload_ext gpumem")
        del ip.config["GpuMem"]


def test_a_bad_size_at_run_time_is_one_logged_line_and_the_value_kept(
    ip: Any, fake_monitor: Monitor, caplog: pytest.LogCaptureFixture
) -> None:
    try:
        assert ip.run_cell("%load_ext gpumem").success
        state = _extension.get_state()
        assert state is not None
        caplog.clear()
        _result, cap = run_cell_capture(ip, "%config GpuMem.pattern_min_bytes = '12 parsecs'")
        assert cap.stdout + cap.stderr == ""
        (record,) = caplog.records
        message = record.getMessage()
        assert "pattern_min_bytes: expected a size such as 64MiB, 1GiB or 500MB, not '12 parsecs'" in message
        assert len(message.splitlines()) == 1 and record.exc_info is None
        assert state.tracker.pattern_min_bytes == 64 * MIB
    finally:
        ip.run_cell("%unload_ext gpumem")
        ip.config.pop("GpuMem", None)


@pytest.mark.parametrize("value", [1e300, 1 << 61, "2EiB"])
def test_a_size_past_one_exbibyte_is_refused_as_a_number_too(
    ip: Any, fake_monitor: Monitor, capsys: pytest.CaptureFixture[str], value: Any
) -> None:
    """'2 EiB' as text is refused as a typo; the same size as a number (a config file's 1e300) is too."""
    ip.config.GpuMem.host_leak_min_bytes = value
    try:
        assert ip.run_cell("%load_ext gpumem").success
        state = _extension.get_state()
        assert state is not None
        assert state.tracker.host_leak_min_bytes == 32 * MIB  # the default
        err = capsys.readouterr().err
        assert err.startswith("gpumem: ignoring GpuMem.host_leak_min_bytes"), err
        assert "Traceback" not in err
    finally:
        ip.run_cell("%unload_ext gpumem")
        del ip.config["GpuMem"]
