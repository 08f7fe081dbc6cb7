"""free(deep=...) in a real IPython shell with real CPU tensors, checked with weak references."""

from __future__ import annotations

import sys
import threading
import time
import weakref
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from _harness import run_cell_capture

torch = pytest.importorskip("torch")

from gpumem.core.cleanup import FreeResult, free  # noqa: E402
from gpumem.ipython.memory_magics import magic_free  # noqa: E402
from gpumem.testing import FakeSource  # noqa: E402

MIB = 1 << 20


def cell(ip: Any, code: str) -> Any:
    result, _ = run_cell_capture(ip, code)
    return result


def alive(ip: Any, name: str) -> bool:
    ref: weakref.ref[Any] = ip.user_ns[name]
    return ref() is not None


def test_tensor_kept_only_by_out_is_freed_by_deep_free_only(ip: Any) -> None:
    cell(ip, "import torch, weakref")
    n = cell(ip, "torch.zeros(10_000)").execution_count
    cell(ip, f"ref = weakref.ref(Out[{n}])")
    shallow = free(shell=ip, source=FakeSource())
    assert alive(ip, "ref")
    assert any(item.startswith(f"Out[{n}]") for item in shallow.kept)
    deep = free(deep=True, shell=ip, source=FakeSource())
    assert not alive(ip, "ref")
    assert f"Out[{n}]" in deep.released[0] and f"_{n}" in deep.released[0]
    assert n not in ip.user_ns["Out"] and f"_{n}" not in ip.user_ns and f"_{n}" not in ip.user_ns_hidden


def test_underscore_aliases_reset_and_output_cache_keeps_working(ip: Any) -> None:
    cell(ip, "import torch, weakref")
    cell(ip, "torch.zeros(100)")
    cell(ip, "ref = weakref.ref(_)")
    free(deep=True, shell=ip, source=FakeSource())
    assert not alive(ip, "ref")
    assert ip.user_ns["_"] == "" and ip.displayhook._ == ""
    cell(ip, "41 + 1")
    assert ip.user_ns["_"] == 42  # IPython still updates _ after a deep free


def test_outputs_without_tensors_stay(ip: Any) -> None:
    cell(ip, "import torch")
    n = cell(ip, "'kept'").execution_count
    cell(ip, "torch.zeros(10)")
    free(deep=True, shell=ip, source=FakeSource())
    assert ip.user_ns["Out"] == {n: "kept"}
    assert ip.user_ns[f"_{n}"] == "kept"


def test_named_variable_that_is_also_out_stays_and_is_reported(ip: Any) -> None:
    cell(ip, "import torch, weakref")
    cell(ip, "x = torch.zeros(1000)\nx")
    cell(ip, "ref = weakref.ref(x)")
    result = free(deep=True, shell=ip, source=FakeSource())
    assert alive(ip, "ref")
    assert ip.user_ns["x"] is ip.user_ns["ref"]()
    assert any("still held by x" in item for item in result.released)


def test_tensor_kept_only_by_exception_frames_is_freed(ip: Any) -> None:
    cell(ip, "import torch, weakref\nrefs = []")
    failed = cell(
        ip, "def step():\n    act = torch.zeros(50_000)\n    refs.append(weakref.ref(act))\n    1 / 0\nstep()"
    )
    assert isinstance(failed.error_in_exec, ZeroDivisionError)
    assert ip.user_ns["refs"][0]() is not None
    result = free(deep=True, shell=ip, source=FakeSource())
    assert ip.user_ns["refs"][0]() is None
    assert any(item.startswith("last exception") for item in result.released)
    assert isinstance(sys.last_value, ZeroDivisionError)  # what failed is still known
    with capture_output() as captured:
        ip.run_cell("%tb")
    assert "ZeroDivisionError" in captured.stdout + captured.stderr


def test_exception_holding_a_tensor_in_its_arguments_is_dropped(ip: Any) -> None:
    cell(ip, "import torch, weakref\nrefs = []")
    cell(ip, "t = torch.zeros(1000)\nrefs.append(weakref.ref(t))\nerr = ValueError(t)\ndel t\nraise err")
    cell(ip, "del err")
    assert ip.user_ns["refs"][0]() is not None
    free(deep=True, shell=ip, source=FakeSource())
    assert ip.user_ns["refs"][0]() is None


def test_exception_held_by_a_user_name_is_not_modified(ip: Any) -> None:
    cell(ip, "import torch, sys")
    cell(ip, "def step():\n    act = torch.zeros(5000)\n    1 / 0\nstep()")
    cell(ip, "saved = sys.last_value")
    result = free(deep=True, shell=ip, source=FakeSource())
    assert ip.user_ns["saved"].__traceback__ is not None
    assert any("user variable" in item for item in result.kept)


def test_free_from_another_thread_while_a_cell_runs_leaves_the_namespace(ip: Any) -> None:
    cell(ip, "import torch, weakref, threading, gpumem\nresults = []")
    n = cell(ip, "torch.zeros(1000)").execution_count
    cell(ip, f"ref = weakref.ref(Out[{n}])")
    cell(
        ip, "def step():\n    act = torch.zeros(5000)\n    refs.append(weakref.ref(act))\n    1 / 0\nrefs = []\nstep()"
    )
    before = dict(ip.user_ns)
    ran = cell(
        ip,
        "worker = threading.Thread(target=lambda: results.append(gpumem.free(deep=True)))\n"
        "worker.start()\nworker.join()",
    )
    assert ran.success
    result = ip.user_ns["results"][0]
    assert all(ip.user_ns.get(name) is value for name, value in before.items() if not name.startswith("_i"))
    del before
    assert n in ip.user_ns["Out"] and alive(ip, "ref")
    assert any(item.startswith(f"Out[{n}]: a cell is running") for item in result.kept)
    assert ip.user_ns["refs"][0]() is None  # the last exception's frames were released
    free(deep=True, shell=ip, source=FakeSource())
    assert not alive(ip, "ref")


def test_free_from_another_thread_when_idle_releases_the_output_cache(ip: Any) -> None:
    cell(ip, "import torch, weakref")
    n = cell(ip, "torch.zeros(1000)").execution_count
    cell(ip, f"ref = weakref.ref(Out[{n}])")
    worker = threading.Thread(target=lambda: free(deep=True, shell=ip, source=FakeSource()))
    worker.start()
    worker.join()
    assert not alive(ip, "ref")
    assert f"_{n}" not in ip.user_ns


def test_concurrent_calls_are_serialized() -> None:
    source = FakeSource()
    results: list[FreeResult] = []
    threads = [threading.Thread(target=lambda: results.append(free(source=source))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 3


def test_reclaimed_per_device_from_the_source() -> None:
    source = FakeSource(devices=2)
    kept = source.allocate(10 * MIB, device=1)
    gone = source.allocate(30 * MIB, device=1)
    source.free(gone, device=1)
    result = free(source=source)
    assert [d.device for d in result.devices] == [0, 1]
    device = result.devices[1]
    assert device.allocated_reclaimed_bytes == 0
    assert device.reserved_before_bytes == 40 * MIB and device.reserved_after_bytes == 10 * MIB
    assert result.reserved_reclaimed_bytes == 30 * MIB
    assert "cuda:1" in result.describe() and "-30.0 MiB" in result.describe()
    source.free(kept, device=1)


def test_without_cuda_the_result_says_so() -> None:
    result = free(source=FakeSource(cuda_initialized=False))
    assert result.devices == ()
    assert "no CUDA device is initialized" in result.note


def test_magic_free_prints_and_rejects_bad_options(ip: Any) -> None:
    cell(ip, "import torch")
    n = cell(ip, "torch.zeros(10)").execution_count
    with capture_output(display=True) as captured:
        magic_free(ip, "--deep")
    text = captured.outputs[0].data["text/plain"]
    assert "gpumem free --deep" in text and f"Out[{n}]" in text
    with pytest.raises(UsageError):
        magic_free(ip, "--deeper")


def test_deep_free_from_a_thread_while_another_keeps_changing_the_namespace(ip: Any) -> None:
    cell(ip, "import torch")
    cell(ip, "torch.zeros(100)")  # an output-cache entry with a tensor, so the deep path has work to do
    ip.user_ns.update({f"name_{index}": index for index in range(20_000)})
    ip.user_ns.update({f"tensor_{index}": torch.zeros(4) for index in range(50)})
    errors: list[BaseException] = []
    calls = 0
    stop = threading.Event()

    def churn() -> None:  # adds 500 names one by one, then removes them: the size changes at every step
        index = 0
        while not stop.is_set():
            name = f"churn_{index % 500}"
            if index // 500 % 2:
                ip.user_ns.pop(name, None)
            else:
                ip.user_ns[name] = torch.zeros(1)
            index += 1

    def free_in_a_loop() -> None:
        nonlocal calls
        deadline = time.monotonic() + 5.0
        while calls < 200 and time.monotonic() < deadline:
            try:
                free(deep=True, shell=ip, source=FakeSource())
            except BaseException as error:
                errors.append(error)
            calls += 1

    mutator = threading.Thread(target=churn)
    mutator.start()
    try:
        worker = threading.Thread(target=free_in_a_loop)
        worker.start()
        worker.join()
    finally:
        stop.set()
        mutator.join()
    assert calls > 0
    assert errors == []
