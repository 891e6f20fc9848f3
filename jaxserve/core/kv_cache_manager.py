"""KVCacheManager: which pages each request holds, grown as its tokens are scheduled."""

from jaxserve.core.block_pool import BlockPool
from jaxserve.core.request import Request


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.block_pool = BlockPool(num_pages)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more K/V of request; False (nothing taken) if pages ran out."""
        total = request.num_computed_tokens + num_new_tokens
        needed = -(-total // self.page_size) - len(request.block_ids)
        if needed <= 0:
            return True
        pages = self.block_pool.allocate(needed)
        if pages is None:
            return False
        request.block_ids.extend(pages)
        return True

    def free(self, request: Request) -> None:
        self.block_pool.free(request.block_ids)
        request.block_ids = []

    def usage(self) -> float:
        return self.block_pool.usage()
