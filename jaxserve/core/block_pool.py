"""BlockPool: the KV pages of the pool, with reference counts and a free queue."""

from collections import deque


class BlockPool:
    """Hands out page ids 1..num_pages-1; page 0 is the null page that padding writes to.

    Raises:
      ValueError: at construction when there is no usable page.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self.free_pages = deque(range(1, num_pages))

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def allocate(self, n: int) -> list[int] | None:
        """n pages with reference count 1, or None (nothing taken) if fewer are free."""
        if n > len(self.free_pages):
            return None
        pages = [self.free_pages.popleft() for _ in range(n)]
        for p in pages:
            self.ref_counts[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; pages nobody references go back to the free queue."""
        for p in pages:
            self.ref_counts[p] -= 1
            if self.ref_counts[p] == 0:
                self.free_pages.append(p)

    def usage(self) -> float:
        """Fraction of usable pages referenced by live requests."""
        return 1.0 - self.num_free_pages / self.num_usable_pages
