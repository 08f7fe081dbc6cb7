"""Pausing Python's cyclic garbage collector around work that builds many small acyclic objects.

A holder walk (tens of thousands of roots and edges) or an allocation trace (a snapshot of millions of
dicts) triggers collections that traverse the whole heap again and again: a tenth of a walk's time,
more than half of a large trace's analysis. The pause is process-wide, so it lasts only for that work.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection inside the block; the collector is on again after it, unless it was off before."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
