"""The panel's holders view and reclaim buttons, in-process: a real IPython shell, real CPU tensors.

The allocator is a FakeSource (no GPU here), so the figures are the storages' own bytes; the browser
test (tests/e2e/test_holders_browser.py) clicks the same buttons in JupyterLab and Notebook 7, and
tests/core/test_reclaim_gpu.py checks the allocator's bytes on a GPU.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from _harness import run_cell_capture, wait_until
from gpumem.core.holders import find_holders
from gpumem.core.monitoring.monitor import Monitor
from gpumem.panel.holders_view import TOP_ROWS, build_holders, render_holders
from gpumem.panel.routing import widget_comms
from gpumem.panel.widget import Panel, close_all
from gpumem.testing import GIB, MIB, FakeSource

torch = pytest.importorskip("torch")

FLOATS = 1_000_000  # 3.8 MiB a tensor


@pytest.fixture(autouse=True)
def _clean_panels() -> Iterator[None]:
    yield
    close_all()


@pytest.fixture
def monitor() -> Iterator[Monitor]:
    found = Monitor(FakeSource(devices=1, total_bytes=80 * GIB, context_bytes=500 * MIB))
    yield found
    found.stop()


def _text(html_text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html_text)).replace("&#x27;", "'").strip()


def cell(ip: Any, code: str) -> Any:
    result, _ = run_cell_capture(ip, code)
    return result


def _buttons(panel: Panel) -> list[str]:
    return [b.description for b in panel._holders.buttons if b.layout.display != "none"]


def test_the_view_collapses_to_the_top_holders_and_counts_shared_storage_once(ip: Any) -> None:
    cell(ip, "import torch\n" + "\n".join(f"t{i} = torch.ones({FLOATS} * {i + 1})" for i in range(TOP_ROWS + 2)))
    cell(ip, "alias = t0[:10]")
    report = find_holders(ip.user_ns, device="all", shell=ip)
    model = build_holders(report, [], "all")
    assert [row.name for row in model.rows[:2]] == [f"t{TOP_ROWS + 1}", f"t{TOP_ROWS}"]
    assert sum(row.nbytes for row in model.rows) == 4 * FLOATS * sum(range(1, TOP_ROWS + 3))  # t0 once
    short = _text(render_holders(model, expanded=False))
    assert "t0" not in short and f"t{TOP_ROWS + 1}" in short
    full = render_holders(model, expanded=True)
    assert "t0" in _text(full) and 'role="img" aria-label="memory by kind: ' in full


def test_release_out_from_the_panel_label_before_result_after(ip: Any, monitor: Monitor) -> None:
    cell(ip, "import torch")
    number = cell(ip, f"torch.ones({FLOATS})").execution_count
    cell(ip, f"w = Out[{number}].untyped_storage()._weak_ref()")
    panel = Panel(monitor, autostart=False, shell=ip)
    panel.refresh_holders(wait=True)
    assert panel.refresh()
    assert _buttons(panel)[0] == f"Release Out[{number}]: 3.8 MiB"
    assert "returns" not in panel._holders.buttons[0].tooltip  # no CUDA device: storage bytes, said so
    assert "releases 3.8 MiB of host tensor storage" in panel._holders.buttons[0].tooltip
    panel._holders.buttons[0].click()
    wait_until(lambda: "as promised" in panel._holders.result.value)
    assert torch.UntypedStorage._expired(ip.user_ns["w"])
    assert f"Release Out[{number}]: 1 storage freed" in _text(panel._holders.result.value)
    wait_until(lambda: not any(text.startswith("Release Out") for text in _buttons(panel)))


def test_unbind_asks_first_and_says_what_else_holds_the_storage(ip: Any, monitor: Monitor) -> None:
    cell(ip, f"import torch\nbig = torch.ones({FLOATS})\nview = big[:5]")
    panel = Panel(monitor, autostart=False, shell=ip)
    panel.refresh_holders(wait=True)
    assert panel.refresh()
    pane = panel._holders
    assert set(pane.names.options) >= {"big"}
    pane.names.value = "big"
    pane.unbind.click()
    wait_until(lambda: pane.confirm_row.layout.display == "flex" or (panel.refresh() and False))
    assert "also held by view" in _text(pane.confirm_text.value) and "big" in ip.user_ns
    pane.cancel.click()
    wait_until(lambda: panel.refresh() and pane.confirm_row.layout.display == "none")
    pane.names.value = "big"
    pane.confirm.click()
    wait_until(lambda: "del big" in pane.result.value or (panel.refresh() and False))
    assert "big" not in ip.user_ns and "view" in ip.user_ns


def test_holders_walk_again_after_a_cell_while_shown(ip: Any, monitor: Monitor) -> None:
    panel = Panel(monitor, autostart=False, shell=ip)
    panel._views.changed("page-1", 0, 1)
    cell(ip, f"import torch\nfresh = torch.ones({FLOATS})")
    wait_until(lambda: panel.refresh() and "fresh" in panel._holders.view.value)


def test_every_holders_widget_is_routed_with_the_panel(monitor: Monitor) -> None:
    panel = Panel(monitor, autostart=False)
    comms = {id(comm) for comm in widget_comms(panel)}
    pane = panel._holders
    parts = [pane.refresh_button, pane.more, *pane.buttons, pane.names, pane.unbind, pane.confirm, pane.cancel]
    assert all(id(part.comm) in comms for part in parts)


def test_an_action_clicked_while_a_cell_runs_is_answered_within_a_second(ip: Any, monitor: Monitor) -> None:
    cell(ip, "import torch, time\nmodel = torch.nn.Linear(1000, 1000)\nmodel(torch.ones(2, 1000)).sum().backward()")
    panel = Panel(monitor, autostart=False, shell=ip)
    panel.refresh_holders(wait=True)
    assert panel.refresh()
    index = next(i for i, text in enumerate(_buttons(panel)) if text.startswith("Drop model's gradients"))
    answered: list[float] = []

    def click() -> None:
        time.sleep(0.3)
        began = time.perf_counter()
        panel._holders.buttons[index].click()
        wait_until(lambda: "as promised" in panel._holders.result.value or (panel.refresh() and False))
        answered.append(time.perf_counter() - began)

    clicker = threading.Thread(target=click)
    clicker.start()
    cell(ip, "time.sleep(2.0)")
    clicker.join()
    assert answered and answered[0] < 1.0, answered
    assert ip.user_ns["model"].weight.grad is None


def test_a_measured_cells_report_is_one_pick_away(ip: Any) -> None:
    from _harness import gpumem_loaded

    with gpumem_loaded(ip):
        cell(ip, f"%%gpumem\nimport torch\nkept = torch.ones({FLOATS})")
        panel = Panel(autostart=False, shell=ip)
        panel._views.changed("page-1", 0, 1)
        cell(ip, "%%gpumem\nsmall = 1")
        choice = panel._cells.choice
        wait_until(lambda: panel.refresh() and len(choice.options) >= 3)
        labels = [label for label, _ in choice.options]
        assert labels[1].startswith("[") and "small = 1" in labels[1] and "import torch  host +" in labels[2]
        choice.value = choice.options[2][1]
        wait_until(lambda: panel.refresh() and "import torch" in panel._cells.report.value)
        assert "gpumem-report" in panel._cells.report.value
    assert panel._cells.choice.options  # unloading closes the panel; the source is gone with the extension
    from gpumem.panel.cell_source import cell_records

    assert cell_records() == ()


def test_after_an_out_of_memory_error_the_panel_shows_the_explanation(ip: Any, monitor: Monitor) -> None:
    from gpumem.core.diagnoses import oom
    from gpumem.panel.cell_source import note_oom

    message = "CUDA out of memory. Tried to allocate 1.50 GiB (GPU 0; 79.19 GiB total capacity)"
    report = oom.explain(torch.OutOfMemoryError(message), source=FakeSource())
    panel = Panel(monitor, autostart=False, shell=ip)
    panel._views.changed("page-1", 0, 1)
    try:
        note_oom(report)
        cell(ip, "x = 1")
        wait_until(lambda: panel.refresh() and "Out of memory" in panel._cells.oom.value)
        assert "1.5 GiB" in _text(panel._cells.oom.value) and panel._cells.oom.layout.display == "block"
        shown = panel._cells.oom.value
        cell(ip, "y = 2")  # the same explanation is not drawn again
        wait_until(lambda: panel.refresh() and panel._cells.oom.value == shown)
    finally:
        note_oom(None)


def test_standing_conditions_are_listed_with_their_cell_and_go_once_fixed(ip: Any, monitor: Monitor) -> None:
    cell(ip, "import torch")
    number = cell(ip, f"torch.ones({FLOATS})").execution_count
    cell(ip, "w = torch.ones(3, requires_grad=True)\nloss = (w * 2).sum()")
    handle = monitor.source.allocate(75 * GIB)  # the fake device 94% full
    panel = Panel(monitor, autostart=False, shell=ip)
    panel.refresh_holders(wait=True)
    assert panel.refresh()
    shown = panel._cells.conditions
    lines = re.findall(r"<li>(.*?)</li>", shown.value)
    assert shown.layout.display == "block" and len(lines) == 3, lines
    assert (
        _text(lines[0]) == f"IPython holds 3.8 MiB in Out[{number}] (cell [{number}]) — Release Out[{number}]: 3.8 MiB"
    )
    assert _text(lines[1]).startswith("loss keeps an autograd graph alive — store `.item()`")
    assert _text(lines[2]).startswith("cuda:0 is 94% full — ")
    monitor.source.free(handle)  # to the fake allocator's cache: the device stays as full
    panel.reclaim("outputs")  # its button's action, which empties the cache too; then the walk again
    assert panel.refresh()
    assert [_text(line).split(" —")[0] for line in re.findall(r"<li>(.*?)</li>", shown.value)] == [
        "loss keeps an autograd graph alive"
    ]
    cell(ip, "del loss")
    panel.refresh_holders(wait=True)
    assert panel.refresh()
    assert shown.value == "", _text(shown.value)
    assert shown.layout.display == "none"
