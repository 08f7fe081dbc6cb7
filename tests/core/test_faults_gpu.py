"""On a real GPU, in real kernels: gpumem under backend:cudaMallocAsync, after a device-side assert, and
under a short loop that keeps what it makes.

Each test runs its own kernel (the allocator backend is chosen as torch loads, and a device-side assert
poisons the process's CUDA context until it ends), so the test process never initializes CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _harness import JupyterEnv, cell_text, make_notebook, run_notebook

pytestmark = pytest.mark.gpu


def _run(tmp_path: Path, jupyter_env: JupyterEnv, name: str, cells: list[str]) -> list[str]:
    notebook = make_notebook(tmp_path / f"{name}.ipynb", cells)
    nb = run_notebook(notebook, jupyter_env=jupyter_env, timeout=300, allow_errors=True)
    return [cell_text(cell) for cell in nb.cells]


def test_cuda_malloc_async_summary_trace_and_status(
    tmp_path: Path, jupyter_env: JupyterEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")  # the kernel inherits it
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    cells = [
        (
            "import torch\nfrom gpumem.core.readers.allocator_backend import allocator_backend\n"
            "b = allocator_backend()\n"
            "print('backend', b.name, b.from_torch, torch.cuda.is_initialized())"
        ),
        "%load_ext gpumem",
        "x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')",
        "%gpumem summary",
        "%%gpumem --trace\ny = torch.ones(1 << 20, device='cuda')",
        "%gpumem status",
        "%%gpumem\nparts = [torch.empty(600 << 20, dtype=torch.uint8, device='cuda') for _ in range(4)]\ndel x",
    ]
    out = _run(tmp_path, jupyter_env, "async", cells)
    assert "backend cudaMallocAsync True False" in out[0], out[0]  # asking did not initialize CUDA
    summary = out[3]
    assert "gpumem summary of cuda:0 (CUDA's stream-ordered allocator, cudaMallocAsync)" in summary, summary
    assert "allocated  " in summary and "1.0 GiB" in summary
    claims = ("large pool", "small pool", "segments  ", "512 B blocks", "largest free block", "empty_cache() frees")
    for claim in claims:
        assert claim not in summary, (claim, summary)
    assert "PyTorch's pools, segments, 512 B rounding, fragmentation and event counters do not apply" in summary
    trace = out[4]
    (line,) = [text for text in trace.splitlines() if "--trace" in text]
    assert line.startswith(
        "gpumem: --trace: allocation sites need PyTorch's native caching allocator, and this process uses "
        "CUDA's stream-ordered allocator, cudaMallocAsync"
    ), trace
    assert "restart the kernel with PYTORCH_CUDA_ALLOC_CONF unset or set to backend:native" in line
    assert "RuntimeError" not in trace and "recordHistory" not in trace and "Traceback" not in trace
    assert (
        "alloc    CUDA's stream-ordered allocator, cudaMallocAsync; settings: "
        "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync"
    ) in out[5], out[5]
    assert "fragment" not in out[6] and "expandable" not in out[6], out[6]


_COUNT_CALLS = """
import threading, time
import torch
calls = []  # (what, thread): every call into torch's CUDA allocator that gpumem could make

def _counted(name, call):
    def counted(*args, **kwargs):
        calls.append((name, threading.current_thread().name))
        return call(*args, **kwargs)
    return counted

torch._C._cuda_memoryStats = _counted("memory_stats", torch._C._cuda_memoryStats)
torch.cuda.memory_stats = _counted("memory_stats", torch.cuda.memory_stats)
torch.cuda.empty_cache = _counted("empty_cache", torch.cuda.empty_cache)
torch.cuda.reset_peak_memory_stats = _counted("reset_peaks", torch.cuda.reset_peak_memory_stats)
torch.cuda.memory_snapshot = _counted("memory_snapshot", torch.cuda.memory_snapshot)
"""


def test_a_device_side_assert_with_the_panel_open_and_automatic_mode_on(
    tmp_path: Path, jupyter_env: JupyterEnv
) -> None:
    cells = [
        _COUNT_CALLS,  # [1]
        "%load_ext gpumem\n%gpumem auto on",  # [2]
        "%gpumem monitor",  # [3]
        "import gpumem.panel.writer as gw\np = gw.open_panels()[-1]\np.set_state({'_view_count': 1})",  # [4]
        (
            "keep = torch.empty(256 << 20, dtype=torch.uint8, device='cuda')\nv = torch.zeros(2, device='cuda')\n"
            "time.sleep(1.5)"
        ),  # [5]
        "v[torch.tensor([5], device='cuda')]\ntorch.cuda.synchronize()",  # [6]: the device-side assert
        "n0 = len(calls)",  # [7]
        "time.sleep(3)",  # [8]: the sampler and the panel run on
        "print('calls after', len(calls) - n0, sorted(set(calls[n0:])))",  # [9]
        "%gpumem status",  # [10]
        "%gpumem free",  # [11]
        "%%gpumem\nw = 1",  # [12]
        (
            "time.sleep(2)\nhead = p._header.value\n"
            "print('header', 'in an error state since cell [6]' in head, 'Device used (NVML)' in head)"
        ),  # [13]
        (
            "from gpumem.core.monitoring.monitor import default_monitor\ns = default_monitor().snapshot()\n"
            "print('read', len(s.devices), s.host is not None, s.allocator)"
        ),  # [14]
    ]
    out = _run(tmp_path, jupyter_env, "assert", cells)
    failed = out[5]
    assert "device-side assert triggered" in failed, failed
    assert failed.count("is in an error state after this cell") == 1, failed
    assert "frozen at the last good reading: allocated 256.0 MiB" in failed, failed
    assert all("error state after this cell" not in text for number, text in enumerate(out) if number != 5), out
    assert "calls after 0 []" in out[8], out[8]  # neither the sampler nor the cell hooks called CUDA again
    assert "torch    unavailable: cuda:0 in an error state since cell [6]" in out[9], out[9]
    assert "nvml     ok" in out[9] and "device used" in out[9] and "host RAM RSS" in out[9], out[9]
    assert "CUDA could not be emptied: cuda:0 in an error state since cell [6]" in out[10], out[10]
    assert "CUDA figures frozen: CUDA is in an error state on cuda:0 since cell [6]" in out[11], out[11]
    assert "cuda:0   allocated" not in out[11], out[11]  # not ±0 B: unknown
    assert "header True True" in out[12], out[12]
    assert "read 1 True ()" in out[13], out[13]  # NVML and host still read, the allocator not


_LOOP = """
acc = []
for i in range(30):
    acc.append(torch.empty(64 << 20, dtype=torch.uint8, device='cuda'))
    time.sleep(0.05)
""".strip()
_FREEING = """
for i in range(30):
    t = torch.empty(64 << 20, dtype=torch.uint8, device='cuda')
    del t
    time.sleep(0.05)
""".strip()


def test_a_short_loop_that_keeps_what_it_makes_is_called_out(tmp_path: Path, jupyter_env: JupyterEnv) -> None:
    cells = [
        "import time, torch\nx = torch.zeros(1, device='cuda')",
        "%load_ext gpumem\n%gpumem auto on",
        _LOOP,  # automatic mode, the 1 Hz sampler: two samples at most
        _FREEING,
        "del acc",
        "%%gpumem\n" + _LOOP,  # a cell measured on purpose (sampled at 10 Hz)
        "%%gpumem\n" + _FREEING,
    ]
    out = _run(tmp_path, jupyter_env, "staircase", cells)
    assert "cuda:0 allocated memory rose step by step, +1.9 GiB in 30 allocations of ~64.0 MiB" in out[2], out[2]
    assert "`acc`" in out[2], out[2]
    assert "rose" not in out[3], out[3]
    assert "allocated memory rose" in out[5] and "`acc` grew most (+1.9 GiB)" in out[5], out[5]
    assert "allocated memory rose" not in out[6], out[6]
