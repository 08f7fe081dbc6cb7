"""A poisoned CUDA context in a real kernel with the panel open and automatic mode on: the fake allocator plays
the device (this machine has none), the error is torch's own; test_faults_gpu.py makes a real one on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from _harness import JupyterEnv, cell_text, make_notebook, run_notebook

pytestmark = pytest.mark.kernel

_SETUP = """
import time, torch
from gpumem.core.monitoring.monitor import Monitor, set_default_monitor
from gpumem.testing import MIB, FakeSource

class Counting(FakeSource):
    calls = 0
    def empty_cache(self):
        Counting.calls += 1
        super().empty_cache()
    def reset_peaks(self, devices):
        Counting.calls += 1
        super().reset_peaks(devices)

src = Counting()
set_default_monitor(Monitor(src))
boom = torch.AcceleratorError("CUDA error: device-side assert triggered\\nCUDA kernel errors might be reported late")
"""


def test_a_device_side_assert_in_a_kernel_with_the_panel_and_automatic_mode(
    tmp_path: Path, jupyter_env: JupyterEnv
) -> None:
    cells = [
        _SETUP,  # [1]
        "%load_ext gpumem\n%gpumem auto on",  # [2]
        "%gpumem monitor",  # [3]
        "import gpumem.panel.writer as gw\np = gw.open_panels()[-1]\np.set_state({'_view_count': 1})",  # [4]
        "h = src.allocate(256 * MIB)\nsrc.transient(512 * MIB)",  # [5]
        "raise boom",  # [6]
        "n0 = Counting.calls\nh2 = src.allocate(64 * MIB)\ntime.sleep(2.5)",  # [7]
        "print('calls after', Counting.calls - n0)",  # [8]
        "%gpumem status",  # [9]
        "%gpumem free",  # [10]
        "%%gpumem\nw = 1",  # [11]
        (
            "time.sleep(1.5)\nhead = p._header.value\n"
            "print('header', 'in an error state since cell [6]' in head, 'Device used (NVML)' in head)"
        ),  # [12]
    ]
    notebook = make_notebook(tmp_path / "fault.ipynb", cells)
    nb = run_notebook(notebook, jupyter_env=jupyter_env, timeout=180, allow_errors=True)
    out = [cell_text(cell) for cell in nb.cells]
    assert out[5].count("is in an error state after this cell") == 1, out[5]
    assert "frozen at the last good reading: allocated 256.0 MiB" in out[5], out[5]
    assert all("error state after this cell" not in text for number, text in enumerate(out) if number != 5), out
    assert "calls after 0" in out[7], out[7]
    assert "torch    unavailable: cuda:0 in an error state since cell [6]" in out[8], out[8]
    assert "nvml     ok" in out[8] and "device used" in out[8] and "host RAM RSS" in out[8], out[8]
    assert "CUDA could not be emptied: cuda:0 in an error state since cell [6]" in out[9], out[9]
    assert "CUDA figures frozen: CUDA is in an error state on cuda:0 since cell [6]" in out[10], out[10]
    assert "cuda:0   allocated" not in out[10], out[10]
    assert "header True True" in out[11], out[11]
