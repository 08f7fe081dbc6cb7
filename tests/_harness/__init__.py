"""Shared test harness for gpumem's suite, one module per concern.

``config``      REPO_ROOT, SRC_DIR and the default time limits
``artifacts``   ``test-artifacts/`` (``$GPUMEM_TEST_ARTIFACTS`` overrides), screenshots
``gpu``         the CUDA probe behind the ``gpu`` marker (``$GPUMEM_REQUIRE_GPU`` turns skips into failures)
``shell``       the in-process IPython shell, and waiting on its threads (``wait_until``)
``notebooks``   isolated Jupyter directories, notebooks run in real kernels
``servers``     JupyterLab / Notebook 7 servers
``chromium``    Playwright on Debian's chromium
``lab_page``    driving a notebook page: open it, run cells, wait for outputs, count its websocket bytes
``traffic``     :class:`CommRecorder`: every comm message widgets send, sized as the kernel puts it on the wire
``synthetic_trace``  a training loop's allocation history as ``torch.cuda.memory._snapshot()`` writes it
``host_pages``  fresh anonymous pages that surely grow the process's RSS (``fresh_pages``)

The last two are imported by module (``from _harness.traffic import CommRecorder``), also by benchmarks/.

Fixtures (registered by ``tests/conftest.py`` through ``pytest_plugins``, so any test can request them):

``ip``                 the in-process IPython shell, user namespace reset around every test
``jupyter_env``        (session) isolated Jupyter dirs + a ``python3`` kernelspec running ``sys.executable``
``jupyter_server``     (session) a running ``jupyter lab`` server -> :class:`JupyterServer`
``notebook_server``    (session) a running Notebook 7 (``jupyter notebook``) server -> :class:`JupyterServer`
``browser``            (module) Playwright ``Browser`` on Debian's chromium (skips when chromium is absent)
``browser_page``       a fresh Playwright ``Page`` (own context); screenshot + console log saved on failure
``artifacts_dir``      ``pathlib.Path`` of ``test-artifacts/`` (``$GPUMEM_TEST_ARTIFACTS`` overrides)

Helpers are imported from the package itself (``from _harness import run_cell_capture``).

Only the standard library and pytest are imported at module level: the GPU machine runs this suite
without Playwright, nbformat or a Jupyter server installed.
"""

from __future__ import annotations

from _harness.artifacts import artifacts_path, safe_name, save_screenshot
from _harness.chromium import (
    CHROMIUM_ARGS,
    assert_no_console_errors,
    capture_console,
    chromium_path,
    console_errors,
    console_messages,
)
from _harness.config import KERNEL_TIMEOUT, OUTPUT_TIMEOUT, REPO_ROOT, SERVER_START_TIMEOUT, SRC_DIR
from _harness.gpu import check_gpu_item, cuda_status, gpu_required
from _harness.host_pages import fresh_pages
from _harness.lab_page import (
    NOTEBOOK,
    KernelFrames,
    cell_outputs_text,
    cells,
    kernel_status,
    notebook_panel,
    open_notebook,
    run_cell,
    wait_for_cell_done,
    wait_for_kernel_idle,
    wait_for_output,
    wait_for_text,
)
from _harness.notebooks import JupyterEnv, cell_text, make_jupyter_env, make_notebook, notebook_text, run_notebook
from _harness.servers import JupyterServer, start_jupyter_server
from _harness.shell import (
    cpu_holders,
    gpumem_loaded,
    reset_shell,
    run_cell_capture,
    wait_until,
    walk_cpu_tensors,
)

__all__ = [
    "CHROMIUM_ARGS",
    "KERNEL_TIMEOUT",
    "NOTEBOOK",
    "OUTPUT_TIMEOUT",
    "REPO_ROOT",
    "SERVER_START_TIMEOUT",
    "SRC_DIR",
    "JupyterEnv",
    "JupyterServer",
    "KernelFrames",
    "artifacts_path",
    "assert_no_console_errors",
    "capture_console",
    "cell_outputs_text",
    "cell_text",
    "cells",
    "check_gpu_item",
    "chromium_path",
    "console_errors",
    "console_messages",
    "cpu_holders",
    "cuda_status",
    "fresh_pages",
    "gpu_required",
    "gpumem_loaded",
    "kernel_status",
    "make_jupyter_env",
    "make_notebook",
    "notebook_panel",
    "notebook_text",
    "open_notebook",
    "reset_shell",
    "run_cell",
    "run_cell_capture",
    "run_notebook",
    "safe_name",
    "save_screenshot",
    "start_jupyter_server",
    "wait_for_cell_done",
    "wait_for_kernel_idle",
    "wait_for_output",
    "wait_for_text",
    "wait_until",
    "walk_cpu_tensors",
]
