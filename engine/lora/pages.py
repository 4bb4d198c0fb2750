"""Which pages of the GPU adapter pool are free: pages of rank rows, handed out by count.

An adapter of rank r needs ceil(r / PAGE_RANK) pages (engine/lora/slots.py lays them out). Any free
pages serve, so the pool never fails for fragmentation while it has room; lowest ids first and whole
runs when one fits, so an adapter's pages are usually contiguous and load in one copy.
"""

from __future__ import annotations

import bisect


def pages_for_rank(rank: int, page_rank: int) -> int:
    """Pages an adapter of `rank` occupies (0 for an adapter that targets nothing)."""
    return -(-rank // page_rank)


def runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive stretches of a page list as (index in the list, first page, count).

    [4, 5, 6, 9, 2] -> [(0, 4, 3), (3, 9, 1), (4, 2, 1)]: three copies load that adapter.
    """
    out: list[tuple[int, int, int]] = []
    for i, page in enumerate(pages):
        if out and out[-1][1] + out[-1][2] == page:
            start, first, count = out[-1]
            out[-1] = (start, first, count + 1)
        else:
            out.append((i, page, 1))
    return out


class PageAllocator:
    """A free list of `num_pages` page ids."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be positive (got {num_pages})")
        self.num_pages = num_pages
        self._free = list(range(num_pages))  # sorted

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` free pages: the first run of `count` consecutive ones if there is one, else the lowest."""
        if count > len(self._free):
            raise RuntimeError(
                f"{count} pages wanted but only {len(self._free)} of {self.num_pages} are free"
            )
        free = self._free
        for i in range(len(free) - count + 1):
            if count and free[i + count - 1] - free[i] == count - 1:
                taken = free[i : i + count]
                del free[i : i + count]
                return taken
        taken = free[:count]
        del free[:count]
        return taken

    def free(self, pages: list[int]) -> None:
        for page in pages:
            i = bisect.bisect_left(self._free, page)
            if not 0 <= page < self.num_pages or (i < len(self._free) and self._free[i] == page):
                raise RuntimeError(f"page {page} freed twice or not of this pool")
            self._free.insert(i, page)
