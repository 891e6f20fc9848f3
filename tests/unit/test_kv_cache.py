"""BlockPool and KVCacheManager: allocation, reference counts, hash chains, LRU eviction."""

import pytest

from jaxserve.core.block_pool import BlockPool
from jaxserve.core.kv_cache_manager import KVCacheManager, root_hash
from tests.unit.kv_fakes import make_request

PS = 4


def test_pool_allocates_usable_pages_and_refuses_too_many():
    pool = BlockPool(5)
    assert pool.num_usable_pages == 4 and pool.num_free_pages == 4
    got = pool.allocate(3)
    assert sorted(got) == [1, 2, 3] and 0 not in got
    assert [pool.ref_counts[p] for p in got] == [1, 1, 1]
    assert pool.allocate(2) is None and pool.num_free_pages == 1  # nothing taken
    pool.free(got)
    assert pool.num_free_pages == 4 and pool.usage() == 0.0
    with pytest.raises(ValueError):
        BlockPool(1)


def test_ref_counts_shared_page_freed_only_by_last_holder():
    pool = BlockPool(4)
    [p] = pool.allocate(1)
    pool.touch([p])
    assert pool.ref_counts[p] == 2 and pool.usage() == pytest.approx(1 / 3)
    pool.free([p])
    assert pool.ref_counts[p] == 1 and p not in pool.free_queue
    pool.free([p])
    assert pool.ref_counts[p] == 0 and p in pool.free_queue


def test_free_queue_order_lru_and_uncached_first():
    pool = BlockPool(7)
    a = pool.allocate(3)  # pages 1, 2, 3
    b = pool.allocate(3)  # pages 4, 5, 6
    for i, p in enumerate(a + b):
        if p != 3:  # page 3: a partly filled last page, no hash
            pool.cache_page(p, bytes([i]))
    pool.free(a)  # reverse order: 3 (uncached) to the front; 2, 1 to the back
    pool.free(b)  # 6, 5, 4 behind them
    assert list(pool.free_queue) == [3, 2, 1, 6, 5, 4]
    # A hit on page 1 takes it out; freeing it again makes it most recently used.
    pool.touch([1])
    pool.free([1])
    assert list(pool.free_queue) == [3, 2, 6, 5, 4, 1]
    # Eviction: uncached page first (no eviction), then least recently used cached pages.
    assert pool.allocate(3) == [3, 2, 6]
    assert bytes([1]) not in pool.cached and bytes([5]) not in pool.cached  # pages 2 and 6
    assert pool.page_hash[2] is None and pool.page_hash[6] is None
    assert pool.cached[bytes([0])] == 1  # still cached while free


def test_cache_page_keeps_the_first_holder_of_a_hash():
    pool = BlockPool(4)
    p, q = pool.allocate(2)
    assert pool.cache_page(p, b"h")
    assert not pool.cache_page(q, b"h")
    assert pool.cached[b"h"] == p and pool.page_hash[q] is None


def _computed(kv, req, n):
    """As the scheduler does after a step: n more tokens computed, full pages registered."""
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n
    kv.cache_full_pages(req)


def test_hash_chain_names_the_whole_prefix():
    kv = KVCacheManager(64, PS)
    r1 = make_request(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    r2 = make_request(2, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    r3 = make_request(3, [0, 2, 3, 4, 5, 6, 7, 8, 9])  # first page differs
    h1, h2, h3 = (kv._block_hashes(r, 2) for r in (r1, r2, r3))
    assert h1 == h2
    assert h1[0] != h3[0] and h1[1] != h3[1]  # same tokens in page 1, different parent
    r4 = make_request(4, [5, 6, 7, 8, 1, 2, 3, 4])
    assert kv._block_hashes(r4, 2)[1] != h1[0]  # same page tokens, different position
    assert len(set(h1)) == 2


def test_adapters_and_cache_salts_root_chains_of_their_own():
    roots = [root_hash(0), root_hash(1), root_hash(2), root_hash(0, "a"), root_hash(0, "b"),
             root_hash(1, "a"), root_hash(0, "\x01")]
    assert len(set(roots)) == len(roots)
    assert root_hash(1, "a") == root_hash(1, "a")


def test_prefix_hit_reuses_full_pages_and_never_the_last_token():
    kv = KVCacheManager(64, PS)
    a = make_request("a", list(range(10, 20)))  # 10 tokens: 2 full pages + 2
    _computed(kv, a, 10)
    assert a.num_registered_pages == 2
    b = make_request("b", list(range(10, 20)) + [99])
    hit = kv.get_computed_pages(b)
    assert hit == a.block_ids[:2]
    # The identical 8-token prompt may reuse only 1 page: its last token must be computed.
    c = make_request("c", list(range(10, 18)))
    assert kv.get_computed_pages(c) == a.block_ids[:1]
    assert kv.get_computed_pages(make_request("d", [10, 11, 12, 13])) == []
    # Taking the hit shares the pages.
    assert kv.allocate_slots(b, 3, hit)
    assert b.block_ids[:2] == hit and len(b.block_ids) == 3
    assert [kv.block_pool.ref_counts[p] for p in hit] == [2, 2]


def test_prefix_caching_off_finds_nothing():
    kv = KVCacheManager(64, PS, enable_caching=False)
    a = make_request("a", list(range(10, 20)))
    _computed(kv, a, 10)
    assert kv.block_pool.cached == {}
    assert kv.get_computed_pages(make_request("b", list(range(10, 21)))) == []


def test_freed_cached_pages_stay_reusable_until_evicted():
    kv = KVCacheManager(6, PS)  # 5 usable pages
    a = make_request("a", list(range(100, 112)))  # 3 pages
    _computed(kv, a, 12)
    pages = list(a.block_ids)
    kv.free(a)
    assert kv.usage() == 0.0  # cached but unreferenced: free
    b = make_request("b", list(range(100, 112)) + [7])
    assert kv.get_computed_pages(b) == pages
    # Evict: a 5-page request takes every free page, the cached ones included.
    big = make_request("big", list(range(500, 520)))
    assert kv.allocate_slots(big, 20)
    assert kv.get_computed_pages(b) == []
    assert kv.block_pool.cached == {}


def test_allocate_counts_hits_on_free_pages_as_taken():
    kv = KVCacheManager(5, PS)  # 4 usable pages
    a = make_request("a", list(range(8)) + [50])
    _computed(kv, a, 9)  # 3 pages, 2 of them cached
    kv.free(a)
    b = make_request("b", list(range(8)) + list(range(60, 70)))  # needs 2 hit + 3 new pages
    hit = kv.get_computed_pages(b)
    assert len(hit) == 2
    # 4 free pages, 2 of them the hits: 2 left for 3 new pages -> refuse, nothing taken.
    assert not kv.allocate_slots(b, 10, hit)
    assert b.block_ids == [] and kv.block_pool.num_free_pages == 4
    assert all(kv.block_pool.ref_counts[p] == 0 for p in hit)
    assert kv.allocate_slots(b, 8, hit)  # 2 hit + 2 new pages fit
    assert len(b.block_ids) == 4 and kv.usage() == 1.0


def test_pages_filled_during_decode_become_cacheable():
    kv = KVCacheManager(64, PS)
    a = make_request("a", [1, 2, 3])
    _computed(kv, a, 3)
    assert a.num_registered_pages == 0
    a.all_token_ids.append(4)  # sampled
    _computed(kv, a, 1)  # decode step computes token 4's K/V: page 0 full
    assert a.num_registered_pages == 1
    b = make_request("b", [1, 2, 3, 4, 5])
    assert kv.get_computed_pages(b) == a.block_ids[:1]
