"""The page pool: free KV pages, reference counts, and automatic prefix caching.

Host-side bookkeeping for the device's page array (see attention.py). Page 0 is the reserved dummy
page that padded rows write to, so it is never handed out.

Prefix caching (vLLM V1's scheme): only full pages are cached. A page's hash chains its parent
page's hash with its own token ids, so equal hashes mean equal whole prefixes. `_cached` maps hash
-> page. A page whose last holder finishes keeps its hash and goes to the back of the free queue;
allocation takes from the front and evicts the hash then, so cached pages are reused least recently
freed first. A request's pages are freed tail first, so a prefix's last pages are evicted before its
first ones (which more requests are likely to share).
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

PageHash = bytes


def hash_page(parent: PageHash | None, token_ids: list[int]) -> PageHash:
    data = (parent or b"") + np.asarray(token_ids, np.int64).tobytes()
    return hashlib.sha256(data).digest()


class PagePool:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        assert num_pages >= 2, num_pages
        self.num_pages, self.page_size = num_pages, page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.page_hashes: list[PageHash | None] = [None] * num_pages
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(1, num_pages))
        self._cached: dict[PageHash, int] = {}
        self.num_queried_tokens = 0  # prefix-cache statistics, in tokens
        self.num_hit_tokens = 0

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - 1 - len(self._free)

    @property
    def num_cached_pages(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of allocatable pages held by requests (cached-but-free pages count as free)."""
        return self.num_used_pages / (self.num_pages - 1)

    # -- prefix cache -------------------------------------------------------------------------------

    def page_hashes_of(self, token_ids: list[int], known: list[PageHash], extra_key: str | None = None
                       ) -> list[PageHash]:
        """Extends `known` (the hashes of the first pages) to cover every full page of `token_ids`.
        extra_key (a request's LoRA adapter) seeds the chain: pages computed under different keys hold
        different K/V for the same tokens, so their hashes never match."""
        hashes = list(known)
        seed = None if extra_key is None else hashlib.sha256(extra_key.encode()).digest()
        for start in range(len(hashes) * self.page_size, len(token_ids) - self.page_size + 1, self.page_size):
            hashes.append(hash_page(hashes[-1] if hashes else seed, token_ids[start:start + self.page_size]))
        return hashes

    def lookup(self, hashes: list[PageHash], max_pages: int) -> list[int]:
        """Takes a reference on the longest cached prefix (at most `max_pages` pages); returns its pages."""
        if not self.enable_prefix_caching:
            return []
        pages = []
        for page_hash in hashes[:max_pages]:
            page = self._cached.get(page_hash)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self.ref_counts[page] == 0:
                del self._free[page]
            self.ref_counts[page] += 1
        self.num_queried_tokens += min(len(hashes), max_pages) * self.page_size
        self.num_hit_tokens += len(pages) * self.page_size
        return pages

    def cache_full_pages(self, page_table: list[int], hashes: list[PageHash]) -> None:
        """Registers the request's full pages (one hash each) so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        for page, page_hash in zip(page_table, hashes):
            if self.page_hashes[page] is None and page_hash not in self._cached:
                self.page_hashes[page] = page_hash
                self._cached[page_hash] = page

    # -- allocation ---------------------------------------------------------------------------------

    def pages_needed(self, page_table: list[int], num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(page_table))

    def grow(self, page_table: list[int], num_tokens: int) -> bool:
        """Appends pages so `page_table` covers `num_tokens`; False (and no change) if too few are free."""
        needed = self.pages_needed(page_table, num_tokens)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            page, _ = self._free.popitem(last=False)
            if self.page_hashes[page] is not None:  # evict the least recently freed cached page
                del self._cached[self.page_hashes[page]]
                self.page_hashes[page] = None
            self.ref_counts[page] = 1
            page_table.append(page)
        return True

    def shrink(self, page_table: list[int], num_tokens: int) -> bool:
        """Frees the pages past those that hold `num_tokens` (speculative drafts that were rejected);
        whether there were any."""
        keep = -(-num_tokens // self.page_size)
        if len(page_table) <= keep:
            return False
        tail = page_table[keep:]
        del page_table[keep:]
        self.free(tail)
        return True

    def free(self, page_table: list[int]) -> None:
        """Drops the request's references, tail first; unreferenced pages stay cached until evicted."""
        for page in reversed(page_table):
            self.ref_counts[page] -= 1
            assert self.ref_counts[page] >= 0, page
            if self.ref_counts[page] == 0:
                self._free[page] = None
        page_table.clear()

    def reset_prefix_cache(self) -> None:
        for page_hash, page in self._cached.items():
            self.page_hashes[page] = None
        self._cached.clear()
