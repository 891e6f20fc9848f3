"""BlockPool: the KV pages of the pool, with reference counts, a free queue and the prefix cache.

In the manner of vLLM V1's BlockPool:

* ``ref_counts[p]`` counts the live requests that hold page ``p``.
* The free queue holds every page with reference count 0, in eviction order: ``allocate`` takes
  pages from its front. A freed page that carries a block hash (a full page whose K/V the prefix
  cache knows) goes to the back, so cached pages are evicted least recently used first; a freed
  page without a hash (a request's partly filled last page) goes to the front, since reusing it
  evicts nothing. A request frees its pages in reverse order, so its tail pages, the least likely
  to be shared, are evicted before its head pages.
* ``cached`` maps a block hash to the page holding those K/V. A cached page stays reusable while
  it sits in the free queue; it leaves the cache when ``allocate`` takes it for new K/V (eviction).
* Page 0 is the null page that padding tokens write to: never handed out.

The free queue is an OrderedDict (page -> None): O(1) pop from the front, append at either end,
and removal from the middle (a cache hit on a free page), like vLLM's doubly linked list.
"""

from collections import OrderedDict


class BlockPool:
    """Hands out page ids 1..num_pages-1.

    Raises:
      ValueError: at construction when there is no usable page.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.cached: dict[bytes, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_pages))

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages no live request references (cached ones included: they can be evicted)."""
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int] | None:
        """n pages with reference count 1, or None (nothing taken) if fewer are free. Pages taken
        from the queue that held cached K/V leave the prefix cache."""
        queue = self.free_queue
        if n > len(queue):
            return None
        pages = []
        for _ in range(n):
            p, _ = queue.popitem(last=False)
            h = self.page_hash[p]
            if h is not None:
                self.page_hash[p] = None
                if self.cached.get(h) == p:
                    del self.cached[h]
            self.ref_counts[p] = 1
            pages.append(p)
        return pages

    def touch(self, pages: list[int]) -> None:
        """Take one more reference to each page (prefix-cache hits); free ones leave the queue."""
        rc = self.ref_counts
        for p in pages:
            if rc[p] == 0:
                del self.free_queue[p]
            rc[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page, last page first; pages nobody references go back to
        the free queue (see the module docstring for where)."""
        rc, queue, page_hash = self.ref_counts, self.free_queue, self.page_hash
        for p in reversed(pages):
            rc[p] -= 1
            if rc[p] == 0:
                queue[p] = None
                if page_hash[p] is None:
                    queue.move_to_end(p, last=False)

    def cache_page(self, page: int, block_hash: bytes) -> bool:
        """Record that ``page`` holds the K/V keyed by ``block_hash``. False when another page
        already holds them (two requests computed the same page at once): this one stays
        uncached and is reused first once freed."""
        holder = self.cached.get(block_hash)
        if holder is not None:
            return holder == page
        self.cached[block_hash] = page
        self.page_hash[page] = block_hash
        return True

    def usage(self) -> float:
        """Fraction of usable pages referenced by live requests (cached free pages count as free)."""
        return 1.0 - len(self.free_queue) / self.num_usable_pages
