"""Measure what widgets send to the browser: every comm message, sized as the kernel puts it on the wire.

Used by the panel's tests and ``benchmarks/bench_panel.py``. Widgets made inside :class:`CommRecorder`
get a comm that records instead of needing a kernel; each message is serialized by jupyter_client's
``Session`` with a realistic parent header, so the byte counts include the Jupyter message envelope.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is Python 3.11+

__all__ = ["CommMessage", "CommRecorder"]


class CommMessage(NamedTuple):
    at_s: float  # monotonic
    comm_id: str
    msg_type: str  # comm_open, comm_msg, comm_close
    method: str | None  # "update", "echo_update", ... for widget messages
    keys: tuple[str, ...]  # state keys an update carries
    nbytes: int
    thread: str


class CommRecorder:
    """Context manager: comms created inside record every message they publish."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.messages: list[CommMessage] = []
        self._saved: Callable[..., Any] | None = None
        from jupyter_client.session import Session

        self._session = Session(key=b"gpumem-traffic", username="user")
        self._parent = self._session.msg_header("execute_request")

    def __enter__(self) -> Self:
        import comm

        self._saved = comm.create_comm
        comm.create_comm = self._create
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        import comm

        if self._saved is not None:
            comm.create_comm = self._saved

    def _create(self, *args: Any, **kwargs: Any) -> Any:
        from comm.base_comm import BaseComm

        recorder = self

        class RecordingComm(BaseComm):
            def publish_msg(
                self,
                msg_type: str,
                data: dict[str, Any] | None = None,
                metadata: dict[str, Any] | None = None,
                buffers: Sequence[Any] | None = None,
                **keys: Any,
            ) -> None:
                recorder._record(self.comm_id, msg_type, data or {}, metadata or {}, buffers or [], keys)

        return RecordingComm(*args, **kwargs)

    def _record(
        self,
        comm_id: str,
        msg_type: str,
        data: dict[str, Any],
        metadata: dict[str, Any],
        buffers: Sequence[Any],
        keys: dict[str, Any],
    ) -> None:
        content = dict(data=data, comm_id=comm_id, **keys)
        message = self._session.msg(msg_type, content=content, parent={"header": self._parent}, metadata=metadata)
        frames = self._session.serialize(message, ident=[f"comm-{comm_id}".encode()])
        size = sum(len(frame) for frame in frames) + sum(memoryview(b).nbytes for b in buffers)
        state = data.get("state") if isinstance(data, dict) else None
        entry = CommMessage(
            at_s=time.monotonic(),
            comm_id=comm_id,
            msg_type=msg_type,
            method=data.get("method") if isinstance(data, dict) else None,
            keys=tuple(sorted(state)) if isinstance(state, dict) else (),
            nbytes=size,
            thread=threading.current_thread().name,
        )
        with self._lock:
            self.messages.append(entry)

    def snapshot(self) -> list[CommMessage]:
        with self._lock:
            return list(self.messages)

    def updates(self, since_s: float = 0.0) -> list[CommMessage]:
        """Widget state updates sent to the front end (not echoes of its own changes)."""
        return [m for m in self.snapshot() if m.msg_type == "comm_msg" and m.method == "update" and m.at_s >= since_s]

    def nbytes(self, since_s: float = 0.0, until_s: float = float("inf")) -> int:
        return sum(m.nbytes for m in self.snapshot() if since_s <= m.at_s <= until_s)
