"""The in-process IPython shell that most tests use (the ``ip`` fixture), reset like a fresh kernel."""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # pragma: no cover
    from IPython.core.extensions import ExtensionManager
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import CapturedIO


_shell_state: dict[str, Any] = {}


def _ipython_shell() -> InteractiveShell:
    """The process-wide ``InteractiveShell`` (created once, with in-memory history, no colours)."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    if InteractiveShell.initialized():
        return InteractiveShell.instance()
    if "ipythondir" not in _shell_state:
        _shell_state["ipythondir"] = tempfile.mkdtemp(prefix="gpumem-ipython-")
        os.environ.setdefault("IPYTHONDIR", _shell_state["ipythondir"])
    cfg = Config()
    cfg.HistoryManager.hist_file = ":memory:"
    cfg.InteractiveShell.colors = "nocolor"
    shell: InteractiveShell = InteractiveShell.instance(config=cfg)
    return shell


def _clear_exception_state(shell: InteractiveShell) -> None:
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            with contextlib.suppress(AttributeError):
                delattr(sys, name)
    with contextlib.suppress(AttributeError):
        shell.InteractiveTB.tb = None
    shell.last_execution_result = None


def _extensions(shell: InteractiveShell) -> ExtensionManager:
    manager: ExtensionManager | None = shell.extension_manager
    assert manager is not None  # made by InteractiveShell.__init__
    return manager


def _snapshot(shell: InteractiveShell) -> dict[str, Any]:
    # IPython 9 registers some magics lazily (%load_ext, %time, ...): a stub that loads its class on
    # first use, once. Restoring a stub after that load would break the magic for later tests.
    load_lazy = getattr(shell.magics_manager, "load_all_lazy_magics", None)
    if load_lazy is not None:
        load_lazy()
    return {
        "extensions": set(_extensions(shell).loaded),
        "events": {name: list(cbs) for name, cbs in shell.events.callbacks.items()},
        "magics": {kind: dict(table) for kind, table in shell.magics_manager.magics.items()},
        "input_transformers": list(shell.input_transformers_post),
        "ast_transformers": list(shell.ast_transformers),
        # gpumem keeps settings made at run time in the shell's config (so that a reload keeps them).
        "gpumem_config": copy.deepcopy(shell.config["GpuMem"]) if "GpuMem" in shell.config else None,
    }


def _restore(shell: InteractiveShell, snap: dict[str, Any]) -> None:
    # Unload what the test loaded (gives extensions the chance to stop threads), then put back the
    # hooks a misbehaving unload may have left behind.
    extensions = _extensions(shell)
    for name in sorted(set(extensions.loaded) - snap["extensions"]):
        with contextlib.suppress(Exception):
            extensions.unload_extension(name)
        extensions.loaded.discard(name)
    for name, cbs in snap["events"].items():
        shell.events.callbacks[name][:] = cbs
    for kind, table in snap["magics"].items():
        shell.magics_manager.magics[kind].clear()
        shell.magics_manager.magics[kind].update(table)
    shell.input_transformers_post[:] = snap["input_transformers"]
    shell.ast_transformers[:] = snap["ast_transformers"]
    shell.config.pop("GpuMem", None)
    if snap["gpumem_config"] is not None:
        shell.config["GpuMem"] = snap["gpumem_config"]


def reset_shell(shell: InteractiveShell) -> None:
    """Reset the user namespace, output cache, remembered exception and execution count of ``shell``.

    Like a fresh kernel: the next cell is ``In[1]``/``Out[1]``. (A new history session; the history
    database is in memory, so this costs nothing.)
    """
    shell.reset(new_session=True)  # type: ignore[no-untyped-call]
    _clear_exception_state(shell)
    gc.collect()


@pytest.fixture
def ip() -> Iterator[InteractiveShell]:
    """The session's in-process ``InteractiveShell``; ``get_ipython()`` returns it.

    Every test starts with an empty user namespace and output cache and execution count 1, as in a
    fresh kernel; extensions the test loaded are unloaded afterwards and event callbacks, magics,
    transformers and the ``GpuMem`` section of the shell's config restored.
    """
    shell = _ipython_shell()
    snap = _snapshot(shell)
    reset_shell(shell)
    try:
        yield shell
    finally:
        _restore(shell, snap)
        reset_shell(shell)


def cpu_holders(namespace: Mapping[str, Any], device: str, names: Collection[str] | None) -> Any:
    """A holder finder for the cell tracker that looks for CPU tensors (CI has no CUDA tensors to find)."""
    from gpumem.core.holders import find_holders

    if names is None:
        return find_holders(namespace, device="cpu")
    return find_holders(namespace, device="cpu", names=names, include_hidden=False)


def walk_cpu_tensors() -> None:
    """Let the loaded extension attribute CPU tensors."""
    from gpumem.ipython import extension

    state = extension.get_state()
    assert state is not None
    state.tracker.holder_finder = cpu_holders


@contextlib.contextmanager
def gpumem_loaded(shell: InteractiveShell, source: Any = None) -> Iterator[InteractiveShell]:
    """``shell`` with gpumem loaded over a monitor of ``source`` (the real system when None), unloaded after."""
    from gpumem.core.monitoring.monitor import Monitor, set_default_monitor

    set_default_monitor(Monitor() if source is None else Monitor(source))
    assert shell.run_cell("%load_ext gpumem").success  # type: ignore[no-untyped-call]
    try:
        yield shell
    finally:
        shell.run_cell("%unload_ext gpumem")  # type: ignore[no-untyped-call]
        set_default_monitor(None)


@pytest.fixture
def fake_monitor() -> Iterator[Any]:
    """A monitor over gpumem's fake allocator as the default one (what the extension loads), for the test."""
    from gpumem.core.monitoring.monitor import Monitor, set_default_monitor
    from gpumem.testing import FakeSource

    monitor = Monitor(FakeSource())
    set_default_monitor(monitor)
    try:
        yield monitor
    finally:
        set_default_monitor(None)


@pytest.fixture
def gpu(ip: InteractiveShell) -> Iterator[InteractiveShell]:
    """The shell with ``torch`` and ``MIB`` in its namespace, CUDA initialized on device 0, its cache emptied and
    gpumem loaded.

    Afterwards the namespace is reset and the cache emptied again, so the next test starts from the
    same allocator state.
    """
    torch = pytest.importorskip("torch")
    ip.user_ns.update(torch=torch, MIB=1 << 20)
    assert ip.run_cell("torch.zeros(1, device='cuda:0'); torch.cuda.synchronize(0)").success  # type: ignore[no-untyped-call]
    gc.collect()
    torch.cuda.empty_cache()
    try:
        with gpumem_loaded(ip):
            yield ip
    finally:
        ip.reset(new_session=False)  # type: ignore[no-untyped-call]
        gc.collect()
        torch.cuda.empty_cache()


def run_cell_capture(shell: InteractiveShell, code: str, *, raise_on_error: bool = False) -> tuple[Any, CapturedIO]:
    """Run ``code`` like a notebook cell; return ``(ExecutionResult, CapturedIO)``.

    ``CapturedIO`` has ``.stdout``, ``.stderr`` and ``.outputs`` (rich ``display()`` outputs, each with
    ``.data`` mapping MIME type -> content, e.g. ``cap.outputs[0].data["text/html"]``).
    """
    from IPython.utils.capture import capture_output

    with capture_output(display=True) as cap:
        result = shell.run_cell(code, store_history=True)  # type: ignore[no-untyped-call]
    if raise_on_error:
        result.raise_error()
    return result, cap


def wait_until(predicate: Callable[[], Any], timeout_s: float = 10.0, poll_s: float = 0.02) -> Any:
    """``predicate()``'s first true value, polled while the panel's and sampler's threads work; fails after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"condition not met in {timeout_s:g} s")
