"""Read a container another thread may be changing: a widget callback walks the namespace while a cell runs.

Iterating a dict, set or deque that changes size raises ``RuntimeError``; a list copy made by one C call
almost never sees a change, and when it does (the interpreter switched threads mid-copy, e.g. to run a
finalizer) the copy is simply taken again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import islice
from typing import TypeVar

__all__ = ["READ_ATTEMPTS", "stable_list"]

T = TypeVar("T")

READ_ATTEMPTS = 64  # each attempt is one C-level copy; a switch mid-copy needs a finalizer or GC to run


def stable_list(read: Callable[[], Iterable[T]], limit: int | None = None) -> list[T]:
    """A list of what ``read()`` yields (at most ``limit`` items), read again if the container changed under it.

    ``read`` is called once per attempt (``user_ns.items``, ``partial(dict.items, obj)``). After
    :data:`READ_ATTEMPTS` failed copies the last ``RuntimeError`` propagates.
    """
    attempt = 1
    while True:  # RuntimeError: "dictionary changed size during iteration", "deque mutated during iteration"
        try:
            return list(islice(read(), limit))
        except RuntimeError:  # noqa: PERF203 (this loop is the retry: it runs once unless the copy failed)
            if attempt >= READ_ATTEMPTS:
                raise
            attempt += 1
