"""A real Jupyter kernel driven message by message, so that a test can interrupt a running cell."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from _harness import JupyterEnv


class Reply(NamedTuple):
    """What one executed cell printed (stdout and stderr), its error name if any, and its status."""

    text: str
    error: str | None
    status: str
    traceback: str = ""


class Kernel:
    """One running kernel: ``run(code)`` executes a cell and collects its outputs until the kernel is idle."""

    def __init__(self, manager: Any, client: Any) -> None:
        self.manager = manager
        self.client = client

    def send(self, code: str) -> str:
        """Start a cell without waiting for it; returns the request's message id."""
        msg_id: str = self.client.execute(code, store_history=True)
        return msg_id

    def collect(self, msg_id: str, timeout: float = 60.0) -> Reply:
        """Every output of the cell ``msg_id`` until the kernel goes idle after it."""
        deadline = time.monotonic() + timeout
        parts: list[str] = []
        error: str | None = None
        traceback = ""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no idle status within {timeout} s; so far: {''.join(parts)!r}")
            try:
                msg = self.client.get_iopub_msg(timeout=left)
            except queue.Empty:
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                parts.append(content["text"])
            elif kind == "error":
                error = content["ename"]
                parts.append(f"{content['ename']}: {content['evalue']}\n")
                traceback = "\n".join(content.get("traceback", []))
            elif kind in ("execute_result", "display_data"):
                parts.append(content["data"].get("text/plain", "") + "\n")
            elif kind == "status" and content["execution_state"] == "idle":
                break
        while True:  # the reply to this request (an earlier one may still be queued)
            reply = self.client.get_shell_msg(timeout=max(deadline - time.monotonic(), 1.0))
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                return Reply("".join(parts), error, reply["content"]["status"], traceback)

    def run(self, code: str, timeout: float = 60.0) -> Reply:
        return self.collect(self.send(code), timeout)

    def interrupt(self) -> None:
        self.manager.interrupt_kernel()


@contextmanager
def running_kernel(jupyter_env: JupyterEnv, startup_timeout: float = 120.0) -> Iterator[Kernel]:
    """A fresh ``python3`` kernel from the isolated environment (``src/`` on its path), shut down afterwards."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    ksm = KernelSpecManager(kernel_dirs=[str(jupyter_env.kernels_dir)], ensure_native_kernel=False)
    manager = KernelManager(kernel_name=jupyter_env.kernel_name, kernel_spec_manager=ksm)
    manager.start_kernel(env=jupyter_env.env)
    client = manager.blocking_client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=startup_timeout)
        yield Kernel(manager, client)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
