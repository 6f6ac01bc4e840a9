"""The page pool: which KV pages are free, and which request holds which.

Host-side bookkeeping for the device's page array (see attention.py); page 0 is the reserved
dummy page that padded rows write to, so it is never handed out.
"""

from __future__ import annotations

import collections


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        assert num_pages >= 2, num_pages
        self.num_pages, self.page_size = num_pages, page_size
        self._free = collections.deque(range(1, num_pages))

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of allocatable pages in use."""
        return 1.0 - len(self._free) / (self.num_pages - 1)

    def pages_needed(self, block_table: list[int], num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(block_table))

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Appends pages so `block_table` covers `num_tokens`; False (and no change) if too few are free."""
        needed = self.pages_needed(block_table, num_tokens)
        if needed > len(self._free):
            return False
        block_table.extend(self._free.popleft() for _ in range(needed))
        return True

    def free(self, block_table: list[int]) -> None:
        self._free.extend(block_table)
        block_table.clear()
