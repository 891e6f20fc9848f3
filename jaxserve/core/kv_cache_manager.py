"""KVCacheManager: which pages each request holds, grown as its tokens are scheduled, and the
automatic prefix cache (vLLM V1's design).

Block hashes. Page i of a request (tokens ``[i*page_size, (i+1)*page_size)``) is keyed by
``sha256(hash of page i-1 || token ids of page i as little-endian int32)``; page 0 chains from a
fixed root, or under a LoRA adapter from a root of that adapter's (``root_hash``): K/V computed
under one adapter differ from the base model's and another adapter's. The chain makes a page's
key name its whole prefix and adapter, so equal keys mean equal K/V. A request's ``cache_salt``
(vLLM's) is mixed into its root too: only requests with the same salt share pages, so a tenant
cannot learn from cache hits (time to first token) what another tenant's prompts hold.
Why SHA-256 rather than Python's ``hash`` of a tuple: ``hash`` is 64 bits and not collision
resistant, and a collision here silently serves another prompt's K/V (a wrong answer, or a way to
read across tenants with crafted prompts); SHA-256 costs about 1.4 us per page here (a
1,000-token prompt: ~90 us, once per request), which the scheduler can afford. vLLM offers
SHA-256 for the same reason.

Only full pages are cached, and a page is registered only after the step that computed its K/V
(``cache_full_pages``, called from ``Scheduler.update``): a lookup never finds K/V that are not in
the pool yet. Pages filled during decode become cacheable the same way.
"""

import hashlib
from array import array

from jaxserve.core.block_pool import BlockPool
from jaxserve.core.request import Request

_ROOT_HASH = hashlib.sha256(b"jaxserve-prefix-cache-v1").digest()


def root_hash(lora_int_id: int, cache_salt: str | None = None) -> bytes:
    """The key page 0 chains from: the fixed root, or for LoRA adapter ``lora_int_id`` (> 0;
    ids are never reused) and / or a ``cache_salt`` the root's hash with them (the id has a
    fixed width, so the salt after it is unambiguous)."""
    if lora_int_id == 0 and cache_salt is None:
        return _ROOT_HASH
    key = _ROOT_HASH + b"lora" + lora_int_id.to_bytes(8, "little")
    if cache_salt is not None:
        key += b"salt" + cache_salt.encode("utf-8", "surrogatepass")
    return hashlib.sha256(key).digest()


def hash_page(parent: bytes, token_ids) -> bytes:
    """Block hash of one full page chained from its parent page's hash."""
    return hashlib.sha256(parent + array("i", token_ids).tobytes()).digest()


class KVCacheManager:
    """Args:
      num_pages: pages in the pool, the null page included.
      page_size: tokens per page.
      enable_caching: automatic prefix caching on/off.
    """

    def __init__(self, num_pages: int, page_size: int, enable_caching: bool = True):
        self.page_size = page_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_pages)

    def _block_hashes(self, request: Request, num_pages: int) -> list[bytes]:
        """The request's block hashes for its first num_pages full pages (computed once each)."""
        hashes = request.block_hashes
        ps = self.page_size
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else root_hash(request.lora_int_id, request.cache_salt)
        for i in range(len(hashes), num_pages):
            parent = hash_page(parent, tokens[i * ps : (i + 1) * ps])
            hashes.append(parent)
        return hashes

    def get_computed_pages(self, request: Request) -> list[int]:
        """The longest run of cached full pages that starts the request's tokens. The last token
        is never covered (it must be computed to have logits to sample from), so at most
        ``(num_tokens - 1) // page_size`` pages. Takes no references."""
        if not self.enable_caching:
            return []
        max_pages = (request.num_tokens - 1) // self.page_size
        if max_pages <= 0:
            return []
        get = self.block_pool.cached.get
        pages = []
        for h in self._block_hashes(request, max_pages)[:max_pages]:
            p = get(h)
            if p is None:
                break
            pages.append(p)
        return pages

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_pages: list[int] | None = None
    ) -> bool:
        """Make room for num_new_tokens more K/V of request, after taking ``computed_pages``
        (prefix-cache hits from ``get_computed_pages``, for a request with no pages yet) as its
        first pages. False, with nothing taken, if pages ran out."""
        pool = self.block_pool
        ps = self.page_size
        n_hit = len(computed_pages) if computed_pages else 0
        total = request.num_computed_tokens + n_hit * ps + num_new_tokens
        needed = -(-total // ps) - len(request.block_ids) - n_hit
        if n_hit:
            # Hits on free pages take them out of the free queue: they are no longer available.
            rc = pool.ref_counts
            free_hits = sum(1 for p in computed_pages if rc[p] == 0)
            if needed > len(pool.free_queue) - free_hits:
                return False
            pool.touch(computed_pages)
            request.block_ids.extend(computed_pages)
        if needed <= 0:
            return True
        pages = pool.allocate(needed)
        if pages is None:
            return False
        request.block_ids.extend(pages)
        return True

    def fork(self, parent: Request, children: list[Request]) -> list[tuple[int, int]] | None:
        """Give each child (another choice of the same prompt) the parent's prompt pages: the
        full ones shared (one more reference each), the partly filled last one as a page of its
        own, which the caller fills by copying the parent's (the returned (source, destination)
        pairs). None, with nothing taken, if pages ran out. The parent holds exactly its
        prompt's pages (its prompt is computed in the step being scheduled)."""
        full, partial = divmod(parent.num_prompt_tokens, self.page_size)
        pool = self.block_pool
        own = pool.allocate(len(children)) if partial else []
        if own is None:
            return None
        shared = parent.block_ids[:full]
        copies = []
        for child, page in zip(children, own or [None] * len(children)):
            pool.touch(shared)
            child.block_ids = list(shared)
            if page is not None:
                child.block_ids.append(page)
                copies.append((parent.block_ids[full], page))
        return copies

    def cache_full_pages(self, request: Request) -> None:
        """Register every full page of request whose tokens are known and whose K/V are
        computed by the steps scheduled so far (a later step that reads them runs after those)."""
        n_full = min(request.num_computed_tokens, request.num_tokens) // self.page_size
        start = request.num_registered_pages
        if n_full <= start or not self.enable_caching:
            return
        hashes = self._block_hashes(request, n_full)
        cache_page = self.block_pool.cache_page
        block_ids = request.block_ids
        for i in range(start, n_full):
            cache_page(block_ids[i], hashes[i])
        request.num_registered_pages = n_full

    def free(self, request: Request) -> None:
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.num_registered_pages = 0

    def usage(self) -> float:
        return self.block_pool.usage()
