"""The panel's holders view on a real CUDA GPU: a button's promised bytes, its measured result, and the
out-of-memory explanation shown in the panel after a cell dies of it."""

from __future__ import annotations

import re
from typing import Any

import pytest

from _harness import run_cell_capture, wait_until

pytestmark = pytest.mark.gpu


def test_release_out_on_the_gpu_and_the_oom_explanation(gpu: Any) -> None:
    from gpumem.panel.widget import Panel, close_all

    number = run_cell_capture(gpu, "torch.ones(2**26, device='cuda:0')")[0].execution_count
    panel = Panel(autostart=False, shell=gpu)
    try:
        panel._views.changed("page-1", 0, 1)
        panel.refresh_holders(wait=True)
        assert panel.refresh()
        button = next(b for b in panel._holders.buttons if b.description.startswith("Release Out["))
        assert button.description == f"Release Out[{number}]: 256.0 MiB", button.description
        # To the device: the tensor's 256 MiB segment and any other segment of the cache then wholly free (the
        # action returns the cache): the promise names it, and the result must be that figure.
        promised = re.search(r"returns 256\.0 MiB to the allocator and ([\d.]+ [KMG]iB) to the device", button.tooltip)
        assert promised is not None, button.tooltip
        button.click()
        wait_until(lambda: panel.refresh() and "Release Out" in panel._holders.result.value, timeout_s=30.0)
        text = re.sub(r"<[^>]+>", "", panel._holders.result.value)
        assert f"256.0 MiB back to the allocator, {promised.group(1)} to the device" in text, text
        assert "as promised" in text, text
        failed, _ = run_cell_capture(gpu, "torch.empty(2**50, device='cuda:0')")
        assert not failed.success
        wait_until(lambda: panel.refresh() and "Out of memory" in panel._cells.oom.value, timeout_s=30.0)
    finally:
        close_all()
