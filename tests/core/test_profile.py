"""``%%gpumem --profile`` on CPU in the real shell with real torch: the operators that allocated, with
their input shapes and net bytes; what profiling cost; one line and the cell runs where it cannot."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from _harness import gpumem_loaded, run_cell_capture
from gpumem.core.diagnoses.profile import MANY_OPERATOR_CALLS, CellProfiler, ProfileCost, ProfileReport, operator_rows

MATRIX_BYTES = 1000 * 1000 * 4  # one float32 1000x1000 tensor


@pytest.fixture
def shell(ip: Any) -> Iterator[Any]:
    with gpumem_loaded(ip) as loaded:
        yield loaded


def _profile_text(cap: Any) -> str:
    texts = [output.data.get("text/plain", "") for output in cap.outputs]
    found = [text for text in texts if text.startswith("gpumem profile of")]
    assert len(found) == 1, texts
    return found[0]


def _row(text: str, operator: str, shapes: str) -> list[str]:
    for line in text.splitlines():
        if line.strip().startswith(operator + " ") and shapes in line:
            return line.split()
    raise AssertionError(f"no row for {operator} {shapes} in:\n{text}")


def test_profile_lists_the_cpu_operators_that_allocated(shell: Any) -> None:
    torch = pytest.importorskip("torch")
    shell.user_ns["torch"] = torch
    result, cap = run_cell_capture(shell, "%%gpumem --profile\na = torch.randn(1000, 1000)\nb = a @ a")
    assert result.success, cap.stderr
    text = _profile_text(cap)
    assert text.startswith("gpumem profile of cell [1]: operators by memory, CPU")
    mm = _row(text, "aten::mm", "1000x1000, 1000x1000")
    assert " ".join(mm).count("3.8 MiB") == 2, mm  # 4,000,000 B, self and total
    randn = _row(text, "aten::randn", "")
    assert "3.8 MiB" in " ".join(randn)  # its total: the empty tensor it fills
    assert "Profiling recorded" in text
    assert "added about" in text
    assert "host memory changed by" in text
    assert "<td>aten::mm</td>" in cap.outputs[-1].data["text/html"]
    assert shell.user_ns["b"].shape == (1000, 1000)  # the cell ran as a cell
    assert not torch.autograd.profiler._is_profiler_enabled


def test_rows_carry_exact_bytes_from_the_profiler() -> None:
    torch = pytest.importorskip("torch")
    profiler = CellProfiler()
    assert profiler.start() is None
    kept = torch.empty(MATRIX_BYTES // 4)
    report = profiler.stop(cell=3)
    assert report is not None
    del kept
    empty = [row for row in report.rows if row.name == "aten::empty"]
    assert empty and empty[0].self_cpu_bytes == MATRIX_BYTES
    assert empty[0].cpu_bytes == MATRIX_BYTES
    assert report.cost.operator_calls >= 1
    assert report.cost.stop_s >= 0
    assert report.cost.group_s >= 0


def test_without_torch_one_line_and_the_cell_runs(shell: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # type: ignore[arg-type]
    result, cap = run_cell_capture(shell, "%%gpumem --profile\nvalue = 41 + 1")
    assert result.success
    assert shell.user_ns["value"] == 42
    assert cap.stdout.count("gpumem: --profile:") == 1
    assert "PyTorch is not installed in this Python environment; the cell runs without a profile" in cap.stdout


def test_field_names_of_older_torch_are_read() -> None:
    """torch before 2.4 calls the device fields cuda_memory_usage / self_cuda_memory_usage."""
    old = SimpleNamespace(
        key="aten::empty",
        input_shapes=[[], []],
        count=2,
        self_cpu_memory_usage=0,
        cpu_memory_usage=0,
        self_cuda_memory_usage=1024,
        cuda_memory_usage=2048,
    )
    new = SimpleNamespace(
        key="aten::mm",
        input_shapes=[[4, 4], [4, 4]],
        count=1,
        self_cpu_memory_usage=64,
        cpu_memory_usage=64,
        self_device_memory_usage=4096,
        device_memory_usage=4096,
    )
    rows = operator_rows([old, new])
    assert [(row.name, row.self_device_bytes, row.device_bytes) for row in rows] == [
        ("aten::mm", 4096, 4096),
        ("aten::empty", 1024, 2048),
    ]
    assert rows[0].input_shapes == "4x4, 4x4"
    assert rows[1].input_shapes == ""


def test_report_text_is_exact() -> None:
    rows = operator_rows(
        [
            SimpleNamespace(
                key="aten::empty",
                input_shapes=[],
                count=1,
                self_cpu_memory_usage=0,
                cpu_memory_usage=0,
                self_device_memory_usage=2 << 20,
                device_memory_usage=2 << 20,
            ),
            SimpleNamespace(
                key="aten::sum",
                input_shapes=[[8], []],
                count=1,
                self_cpu_memory_usage=-4,
                cpu_memory_usage=4,
                self_device_memory_usage=0,
                device_memory_usage=0,
            ),
            SimpleNamespace(key="aten::view", input_shapes=[[8], []], count=3),
        ]
    )
    report = ProfileReport(rows, ProfileCost(0.25, 0.5, 100 << 20, 110 << 20, 5), cuda=True, top=15, cell=7)
    assert repr(report).splitlines() == [
        "gpumem profile of cell [7]: operators by memory, CPU and CUDA",
        "  operator     input shapes  calls  self CPU  total CPU  self CUDA  total CUDA",
        "  aten::empty                    1       0 B        0 B    2.0 MiB     2.0 MiB",
        "  aten::sum    8, -              1      -4 B        4 B        0 B         0 B",
        (
            "Bytes are net: allocated minus freed inside the call (negative: it freed more); self is the operator "
            "alone, total adds the operators it called."
        ),
        (
            "Profiling recorded 5 operator calls and added about 0.75 s after the cell (stopping 0.25 s, reading back "
            "0.50 s), besides slowing each operator while it ran; host memory changed by 10.0 MiB while profiling "
            "(the cell's own use included)."
        ),
    ]


def test_a_failing_cell_is_profiled_and_the_profiler_stopped(shell: Any) -> None:
    torch = pytest.importorskip("torch")
    shell.user_ns["torch"] = torch
    result, cap = run_cell_capture(shell, "%%gpumem --profile\nkept = torch.ones(1000, 1000)\nraise ValueError('no')")
    assert isinstance(result.error_in_exec, ValueError)
    assert "aten::ones" in _profile_text(cap)
    assert not torch.autograd.profiler._is_profiler_enabled


def test_the_users_own_profiler_is_left_alone(shell: Any) -> None:
    torch = pytest.importorskip("torch")
    shell.user_ns["torch"] = torch
    with torch.profiler.profile() as theirs:
        result, cap = run_cell_capture(shell, "%%gpumem --profile\nx = torch.ones(10)")
        assert result.success
        assert torch.autograd.profiler._is_profiler_enabled
    assert cap.stdout.count("gpumem: --profile: a PyTorch profiler is already running in this process") == 1
    assert any(event.key == "aten::ones" for event in theirs.key_averages())


def test_unload_inside_a_profiled_cell_stops_the_profiler(shell: Any) -> None:
    torch = pytest.importorskip("torch")
    shell.user_ns["torch"] = torch
    result, _cap = run_cell_capture(shell, "%%gpumem --profile\nx = torch.ones(10)\n%unload_ext gpumem")
    assert result.success
    assert not torch.autograd.profiler._is_profiler_enabled
    assert shell.run_cell("%load_ext gpumem").success  # the fixture unloads it again


@pytest.mark.parametrize("auto", ["off", "on"])
def test_profile_under_time(shell: Any, auto: str) -> None:
    """%%time above %%gpumem: the magic runs the body (auto off) or adopts the measured cell (auto on)."""
    torch = pytest.importorskip("torch")
    shell.user_ns["torch"] = torch
    assert shell.run_cell(f"%gpumem auto {auto}").success
    result, cap = run_cell_capture(
        shell, "%%time\n%%gpumem --profile\nm = torch.randn(1000, 1000) @ torch.ones(1000, 1000)"
    )
    assert result.success, cap.stderr
    assert "aten::mm" in _profile_text(cap)
    assert not torch.autograd.profiler._is_profiler_enabled


@pytest.mark.parametrize("auto", ["off", "on"])
def test_profile_by_run_cell_magic(shell: Any, auto: str) -> None:
    torch = pytest.importorskip("torch")
    shell.user_ns["torch"] = torch
    assert shell.run_cell(f"%gpumem auto {auto}").success
    cell = "get_ipython().run_cell_magic('gpumem', '--profile', 'm = torch.randn(1000, 1000) @ torch.ones(1000, 1000)')"
    result, cap = run_cell_capture(shell, cell)
    assert result.success, cap.stderr
    assert "aten::mm" in _profile_text(cap)
    assert _profile_text(cap).count("gpumem profile of") == 1
    assert not torch.autograd.profiler._is_profiler_enabled


def test_many_calls_advise_a_shorter_cell() -> None:
    report = ProfileReport([], ProfileCost(1.0, 2.0, None, None, MANY_OPERATOR_CALLS), cuda=False, top=5, cell=None)
    assert report.cost_text() == (
        "Profiling recorded 1,000,000 operator calls and added about 3.00 s after the cell (stopping 1.00 s, "
        "reading back 2.00 s), besides slowing each operator while it ran. The profiler keeps every call in host "
        "memory until the cell ends: profile a shorter cell (a few steps of the loop) to keep that down."
    )
    assert repr(report).splitlines()[1] == "No operator allocated more than it freed during its call."


def test_a_slow_end_of_cell_advises_a_shorter_cell_too() -> None:
    slow = ProfileReport([], ProfileCost(2.5, 26.0, None, None, 265_199), cuda=False, top=5, cell=None)
    assert slow.cost_text().endswith(
        "Both grow with the number of calls the profiler recorded: "
        "profile a shorter cell (a few steps of the loop) for a faster answer."
    )
    quick = ProfileReport([], ProfileCost(0.25, 0.5, None, None, 5_000), cuda=False, top=5, cell=None)
    assert quick.cost_text().endswith("besides slowing each operator while it ran.")
