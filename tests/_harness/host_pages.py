"""Host memory a test can count on: fresh anonymous pages, each written, so the process's RSS grows by them.

A tensor's memory may come from a heap an earlier test left resident (the C allocator reuses it): RSS
then does not move, and a test of host figures that allocates a tensor proves nothing or fails.
"""

from __future__ import annotations

import mmap

__all__ = ["fresh_pages"]


def fresh_pages(size: int) -> mmap.mmap:
    """``size`` bytes of new anonymous pages, each written: resident until the mapping is closed."""
    pages = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        pages[offset] = 1
    return pages
