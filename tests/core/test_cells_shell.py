"""The cell findings in a real IPython shell: host memory kept on every re-run (real RSS, real numpy and
torch CPU tensors), the by-kind line, a staircase seen by the real sampler thread, kept graphs and gradients."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from _harness import cpu_holders, run_cell_capture
from gpumem.core.monitoring.monitor import Monitor, set_default_monitor
from gpumem.core.sampling.sampler import DEFAULT_RATE_HZ
from gpumem.ipython import extension as _extension
from gpumem.testing import MIB, FakeSource


def _load(ip: Any, monitor: Monitor | None) -> None:
    set_default_monitor(monitor)
    assert ip.run_cell("%load_ext gpumem").success


def _unload(ip: Any) -> None:
    ip.run_cell("%unload_ext gpumem")
    set_default_monitor(None)
    for name in ("kept", "acc", "losses", "model", "optimizer"):
        ip.user_ns.pop(name, None)
    gc.collect()


@pytest.fixture
def real_shell(ip: Any) -> Iterator[Any]:
    """The extension on this machine's real memory source (no CUDA here: host RSS only)."""
    _load(ip, None)
    try:
        yield ip
    finally:
        _unload(ip)


@pytest.fixture
def fake() -> FakeSource:
    return FakeSource()


@pytest.fixture
def fake_shell(ip: Any, fake: FakeSource) -> Iterator[Any]:
    """The extension on a fake allocator sampled at 100 Hz, attributing CPU tensors (CI has no CUDA tensors)."""
    _load(ip, Monitor(fake, rate_hz=100))
    state = _extension.get_state()
    assert state is not None
    state.tracker.holder_finder = cpu_holders
    ip.user_ns.update(src=fake, MIB=MIB)
    try:
        yield ip
    finally:
        _unload(ip)


def _outputs(cap: Any) -> str:
    return "\n".join(output.data.get("text/plain", "") for output in cap.outputs) + cap.stdout


@pytest.mark.parametrize(
    "make", ["np.ones(96 * MIB // 8)", "torch.ones(96 * MIB // 4)"], ids=["numpy array", "CPU tensor"]
)
def test_host_memory_kept_on_every_rerun_is_a_leak(real_shell: Any, make: str) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    real_shell.user_ns.update(np=np, torch=torch, MIB=MIB, kept=[])
    run_cell_capture(real_shell, "import gc; gc.collect()")  # an earlier test's garbage, not freed mid-run
    run_cell_capture(real_shell, "%gpumem auto on")
    seen = [_outputs(run_cell_capture(real_shell, f"kept.append({make})")[1]) for _ in range(5)]
    assert "possible leak" not in seen[0] + seen[1]
    # Said from the third run on; on a loaded machine one run's RSS may grow less than it kept (pages the
    # process had already touched are reused), which delays it by a run or two, never makes it early.
    warning = "this cell has run {} times and each of the last 3 runs left host memory (RSS)"
    said = [n + 1 for n, text in enumerate(seen) if f"possible leak on re-run: {warning.format(n + 1)}" in text]
    assert said and said[0] >= 3, seen  # the third run at the earliest
    real_shell.user_ns["kept"].clear()
    # The same cell that frees what it made is no leak, however often it runs.
    seen = [_outputs(run_cell_capture(real_shell, f"x = {make}\ndel x")[1]) for _ in range(4)]
    assert "possible leak" not in "".join(seen)


def test_the_report_has_a_by_kind_line(fake_shell: Any) -> None:
    torch = pytest.importorskip("torch")
    fake_shell.user_ns["torch"] = torch
    cell = (
        "%%gpumem\n"
        "model = torch.nn.Linear(512, 512)\n"
        "optimizer = torch.optim.AdamW(model.parameters())\n"
        "model(torch.randn(4, 512)).sum().backward()\n"
        "optimizer.step()\n"
        "h = src.allocate(8 * MIB)"
    )
    _result, cap = run_cell_capture(fake_shell, cell)
    text = _outputs(cap)
    assert (
        "by kind (since the start of the cell): parameters +1.0 MiB, gradients +1.0 MiB, optimizer state +2.0 MiB"
        in (text)
    )
    (html,) = [o.data["text/html"] for o in cap.outputs if "gpumem-report" in o.data.get("text/html", "")]
    assert '<div class="kinds">by kind (since the start of the cell): parameters +1.0 MiB' in html


def test_a_staircase_seen_by_the_sampler_is_named(fake_shell: Any) -> None:
    cell = (
        "%%gpumem\n"
        "import time\n"
        "acc = []\n"
        "for _ in range(12):\n"
        "    acc.append(src.allocate(8 * MIB))\n"
        "    time.sleep(0.05)"
    )
    _result, cap = run_cell_capture(fake_shell, cell)
    text = _outputs(cap)
    assert "cuda:0 allocated memory rose in 12 steps of ~8.0 MiB (+96.0 MiB) over " in text
    assert "never fell: something accumulates per iteration" in text
    cell = "%%gpumem\nfor _ in range(12):\n    h = src.allocate(8 * MIB)\n    time.sleep(0.05)\n    src.free(h)"
    _result, cap = run_cell_capture(fake_shell, cell)
    assert "never fell" not in _outputs(cap)


def test_kept_losses_and_gradients_are_named_with_the_fix(fake_shell: Any) -> None:
    torch = pytest.importorskip("torch")
    fake_shell.user_ns.update(torch=torch, w=torch.randn(256, 256, requires_grad=True), x=torch.randn(256, 256))
    cell = "%%gpumem\nlosses = [torch.relu(x @ w).sum() for _ in range(4)]\nh = src.allocate(8 * MIB)"
    text = _outputs(run_cell_capture(fake_shell, cell)[1])
    assert "by kind (since the start of the cell): activations +1.0 MiB" in text
    assert "1.0 MiB of saved activations: store `.item()` for a number or `.detach()` for a tensor instead" in text
    state = _extension.get_state()
    assert state is not None
    state.tracker.pattern_min_bytes = MIB
    fake_shell.user_ns.update(model=torch.nn.Linear(512, 512))
    cell = (
        "%%gpumem\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model(torch.randn(4, 512)).sum().backward()\n"
        "optimizer.step()\n"
        "g = src.allocate(8 * MIB)"
    )
    text = _outputs(run_cell_capture(fake_shell, cell)[1])
    assert "gradients are kept after the cell (1.0 MiB: `model` 1.0 MiB); optimizer.zero_grad(set_to_none=True)" in text


def test_automatic_mode_names_kinds_of_cells_that_rebind_no_tensor(fake_shell: Any) -> None:
    torch = pytest.importorskip("torch")
    fake_shell.user_ns["torch"] = torch
    run_cell_capture(fake_shell, "%config GpuMem.threshold = 1048576")
    run_cell_capture(fake_shell, "%gpumem auto on")
    setup = "model = torch.nn.Linear(1024, 1024)\noptimizer = torch.optim.AdamW(model.parameters())\n"
    run_cell_capture(fake_shell, setup + "h1 = src.allocate(2 * MIB)")
    # `x` alone would explain the growth, so a walk of the changed names would look no further: the gradients
    # are found because the cell changed allocated memory by 1 MiB or more (a whole walk then).
    cell = "x = torch.zeros(2 * MIB // 4)\nmodel(torch.randn(4, 1024)).sum().backward()\nh2 = src.allocate(2 * MIB)"
    text = _outputs(run_cell_capture(fake_shell, cell)[1])
    assert "; by kind gradients +4.0 MiB, other tensors +2.0 MiB" in text, text
    text = _outputs(run_cell_capture(fake_shell, "optimizer.step()\nh3 = src.allocate(2 * MIB)")[1])
    assert "; by kind optimizer state +8.0 MiB" in text, text
    state = _extension.get_state()
    assert state is not None
    walks = dict(state.tracker.walks)
    assert _outputs(run_cell_capture(fake_shell, "n = 1")[1]) == ""  # memory did not change: no walk, no line
    assert state.tracker.walks == walks
    history = _outputs(run_cell_capture(fake_shell, "%gpumem history")[1])
    assert "by kind" in history and "optimizer state +8.0 MiB" in history and "gradients +4.0 MiB" in history


def test_kinds_changed_by_earlier_unmeasured_cells_say_since_when(fake_shell: Any) -> None:
    """Cells that change no memory are not walked: the next walk's kinds include what they moved (here
    `x` from a name to IPython's Out), so that cell's line and history row must say since when."""
    torch = pytest.importorskip("torch")
    fake_shell.user_ns["torch"] = torch
    run_cell_capture(fake_shell, "%config GpuMem.threshold = 1048576")
    run_cell_capture(fake_shell, "%gpumem auto on")
    result, _cap = run_cell_capture(fake_shell, "x = torch.zeros(2 * MIB // 4)\nh1 = src.allocate(2 * MIB)")
    walked = result.execution_count
    run_cell_capture(fake_shell, "x")  # Out[...] now holds it too
    run_cell_capture(fake_shell, "del x")  # only Out does: the kind changed, memory did not
    text = _outputs(run_cell_capture(fake_shell, "h2 = src.allocate(2 * MIB)")[1])
    assert f"; by kind (since cell [{walked}]): held by IPython +2.0 MiB, other tensors -2.0 MiB" in text, text
    # The cell right after a walk: its kinds are its own, said without a "since".
    text = _outputs(run_cell_capture(fake_shell, "y = torch.zeros(2 * MIB // 4)\nh3 = src.allocate(2 * MIB)")[1])
    assert "; by kind other tensors +2.0 MiB" in text, text
    history = _outputs(run_cell_capture(fake_shell, "%gpumem history")[1])
    assert f"since cell [{walked}]: held by IPython +2.0 MiB (+1 more)" in history, history
    assert "  other tensors +2.0 MiB  " in history, history


def test_a_cell_measured_on_purpose_is_sampled_at_the_fastest_rate_and_others_are_not(ip: Any) -> None:
    """Automatic mode keeps the idle rate; a %%gpumem cell asks for 10 Hz while it runs, and gives it back."""
    fake = FakeSource()
    monitor = Monitor(fake)
    _load(ip, monitor)
    try:
        ip.user_ns["sampler"] = monitor.sampler
        assert ip.run_cell("%%gpumem\ninside = sampler.rate_hz").success
        assert ip.user_ns["inside"] == 10
        assert monitor.running and monitor.sampler.rate_hz == DEFAULT_RATE_HZ
        assert ip.run_cell("%gpumem auto on").success
        assert ip.run_cell("inside = sampler.rate_hz").success
        assert ip.user_ns["inside"] == DEFAULT_RATE_HZ
        assert ip.run_cell("%%gpumem\nraise ValueError('a failing cell gives its rate back too')").success is False
        assert monitor.sampler.rate_hz == DEFAULT_RATE_HZ
    finally:
        ip.user_ns.pop("sampler", None)
        _unload(ip)
