"""The front end's messages to gpumem's widgets and status comms are handled while a cell runs.

A real ipykernel, spoken to as JupyterLab speaks to it (jupyter_client, the front end's session id in
every header): a Free click and a sidebar request sent 1 s into a cell that sleeps for 8 s must be
answered before that cell ends, and the views of a page that went away must stop counting. The
browser does the same in tests/e2e/test_panel_browser.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from _harness import JupyterEnv

pytestmark = pytest.mark.kernel

CELL_S = 8.0
# The click goes out 1 s into the cell; this is "at once" with a margin for a loaded 2-core machine.
ANSWER_WITHIN_S = 3.0


@pytest.fixture
def kernel(jupyter_env: JupyterEnv) -> Iterator[Any]:
    """A client of a fresh kernel; its channels started, the kernel ready."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    ksm = KernelSpecManager(kernel_dirs=[str(jupyter_env.kernels_dir)], ensure_native_kernel=False)
    manager = KernelManager(kernel_name=jupyter_env.kernel_name, kernel_spec_manager=ksm)
    manager.start_kernel()
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=90)
        yield client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def _run(client: Any, code: str) -> str:
    """Run ``code`` to the end; its printed text (a failure raises with the traceback)."""
    printed: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            printed.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            printed.append("\n".join(msg["content"]["traceback"]))

    reply = client.execute_interactive(code, timeout=60, output_hook=hook)
    text = "".join(printed)
    assert reply["content"]["status"] == "ok", text
    return text


def _comm_msg(client: Any, comm_id: str, data: dict[str, Any], session: str | None = None) -> None:
    """Send what a front end sends on a comm (no subshell id: the kernel decides where it goes)."""
    msg = client.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
    if session is not None:
        msg["header"]["session"] = session
    client.shell_channel.send(msg)


def _comm_open(client: Any, target: str, data: dict[str, Any], session: str) -> str:
    comm_id = uuid.uuid4().hex
    msg = client.session.msg("comm_open", {"comm_id": comm_id, "target_name": target, "data": data})
    msg["header"]["session"] = session
    client.shell_channel.send(msg)
    return comm_id


def _answered_while_running(client: Any, send: Any, answered: Any) -> tuple[float, float]:
    """Start the long cell, ``send()`` 1 s into it; seconds from sending to the first iopub message
    for which ``answered(msg)`` holds, and to the cell's end."""
    cell = client.execute(f"import time\ntime.sleep({CELL_S})")
    started = None
    sent_at = answer_at = end_at = None
    deadline = time.monotonic() + CELL_S + 60
    while end_at is None and time.monotonic() < deadline:
        if started is not None and sent_at is None and time.monotonic() - started >= 1.0:
            send()
            sent_at = time.monotonic()
        try:
            msg = client.get_iopub_msg(timeout=0.05)
        except Exception:
            continue
        is_cell = msg["parent_header"].get("msg_id") == cell
        if is_cell and msg["msg_type"] == "status":
            if msg["content"]["execution_state"] == "busy":
                started = time.monotonic()
            elif msg["content"]["execution_state"] == "idle":
                end_at = time.monotonic()
        elif sent_at is not None and answer_at is None and answered(msg):
            answer_at = time.monotonic()
    assert sent_at is not None and end_at is not None, "the long cell did not run"
    assert answer_at is not None, f"not answered while the cell ran ({end_at - sent_at:.1f} s after sending)"
    return answer_at - sent_at, end_at - sent_at


def _widget_text(msg: dict[str, Any], comm_id: str) -> str:
    content = msg["content"]
    if msg["msg_type"] != "comm_msg" or content.get("comm_id") != comm_id:
        return ""
    return str((content.get("data") or {}).get("state", {}).get("value", ""))


def test_first_free_click_during_a_cell_is_answered_at_once(kernel: Any) -> None:
    ids = _run(
        kernel,
        "import gpumem\npanel = gpumem.Panel(window='1min')\n"
        "print(panel._free_button.model_id, panel._message.model_id)",
    ).split()
    button, message = ids
    click = {"method": "custom", "content": {"event": "click"}}
    answer_s, end_s = _answered_while_running(
        kernel, lambda: _comm_msg(kernel, button, click), lambda msg: "Free" in _widget_text(msg, message)
    )
    assert answer_s < ANSWER_WITHIN_S, f"Free answered {answer_s:.1f} s after the click (cell ended at {end_s:.1f} s)"
    assert answer_s < end_s
    # The click was handled on the subshell gpumem owns, which the kernel lists.
    out = _run(
        kernel,
        "from gpumem.panel.routing import owned_subshell_id\n"
        "print(owned_subshell_id() in get_ipython().kernel.shell_channel_thread.manager.list_subshell())",
    )
    assert out.strip() == "True"


def test_sidebar_request_during_a_cell_and_unload_leaves_no_subshell(kernel: Any) -> None:
    _run(kernel, "%load_ext gpumem")
    page = uuid.uuid4().hex
    status = _comm_open(kernel, "gpumem.status", {"request": "snapshot"}, page)
    _run(kernel, "pass")  # the comm_open is handled

    def docked(msg: dict[str, Any]) -> bool:
        data = msg["content"].get("data") or {}
        return msg["msg_type"] == "comm_msg" and msg["content"].get("comm_id") == status and "sidebar_model_id" in data

    answer_s, end_s = _answered_while_running(
        kernel, lambda: _comm_msg(kernel, status, {"request": "sidebar"}, page), docked
    )
    assert answer_s < ANSWER_WITHIN_S, f"sidebar answered {answer_s:.1f} s after the request (cell: {end_s:.1f} s)"
    out = _run(
        kernel,
        "from gpumem.panel.routing import owned_subshell_id\n"
        "manager = get_ipython().kernel.shell_channel_thread.manager\n"
        "owned = owned_subshell_id()\nprint('before', owned in manager.list_subshell())\n"
        "%unload_ext gpumem\nimport time; time.sleep(0.5)\n"
        "print('after', owned_subshell_id(), owned in manager.list_subshell())",
    )
    assert "before True" in out
    assert "after None False" in out


def test_views_of_a_page_that_said_bye_stop_counting(kernel: Any) -> None:
    """Page A shows the panel once and is reloaded: page B starts from A's count, shows it once,
    then clears it. Without A's bye, ipywidgets' count would stay at 1 with no view anywhere."""
    ids = _run(kernel, "%load_ext gpumem\nimport gpumem\npanel = gpumem.Panel(window='1min')\nprint(panel.model_id)")
    panel = ids.split()[-1]
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    status_a = _comm_open(kernel, "gpumem.status", {"request": "snapshot"}, first)
    _comm_open(kernel, "gpumem.status", {"request": "snapshot"}, second)

    def views(count: int, session: str) -> None:
        _comm_msg(kernel, panel, {"method": "update", "state": {"_view_count": count}, "buffer_paths": []}, session)

    _run(
        kernel,
        "import time\ndef probe(count, shown):\n    deadline = time.monotonic() + 10\n"
        "    while (panel._view_count, panel._views.shown()) != (count, shown) and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n    print(panel._view_count, panel._views.shown(), panel.visible)",
    )
    views(1, first)
    views(2, second)
    assert _run(kernel, "probe(2, 2)").split() == ["2", "2", "True"]
    _comm_msg(kernel, status_a, {"request": "bye"}, first)  # page A goes away
    views(1, second)  # page B clears its output
    assert _run(kernel, "probe(1, 0)").split() == ["1", "0", "False"]
