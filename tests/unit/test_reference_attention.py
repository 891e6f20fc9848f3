"""The pure-JAX oracles against a plain numpy loop over sequences, on random ragged batches."""

import numpy as np
import pytest

from jaxserve.models.llama import write_kv
from pallas_kernels.reference import attention, paged_attention


def naive(q, k_pages, v_pages, qsl, seq_lens, block_tables, window=None, scale=None, cap=None):
    """Per sequence: gather its keys densely, softmax with the bottom-right causal mask (and,
    with a window W, only the W keys up to the query's own position), scores times ``scale``
    (default D ** -0.5) and capped at cap tanh(x / cap) where given."""
    kv_heads, _, page_size, d = k_pages.shape
    group = q.shape[1] // kv_heads
    out = np.zeros_like(q)
    for s in range(len(seq_lens)):
        q_len, ctx = qsl[s + 1] - qsl[s], seq_lens[s]
        if q_len == 0:
            continue
        pos = np.arange(ctx)
        k = k_pages[:, block_tables[s][pos // page_size], pos % page_size]  # [KV, ctx, D]
        v = v_pages[:, block_tables[s][pos // page_size], pos % page_size]
        for i in range(q_len):
            qp = ctx - q_len + i
            lo = 0 if window is None else max(qp - window + 1, 0)
            for h in range(q.shape[1]):
                sc = k[h // group, lo : qp + 1] @ q[qsl[s] + i, h] * (scale or d**-0.5)
                if cap is not None:
                    sc = cap * np.tanh(sc / cap)
                p = np.exp(sc - sc.max())
                out[qsl[s] + i, h] = (p / p.sum()) @ v[h // group, lo : qp + 1]
    return out


def random_batch(rng, q_lens, ctx_lens, heads=6, kv_heads=2, d=16, page=4, num_pages=200, width=64):
    tokens = sum(q_lens)
    q = rng.standard_normal((tokens + 3, heads, d)).astype(np.float32)  # 3 padding rows
    k_pages = rng.standard_normal((kv_heads, num_pages, page, d)).astype(np.float32)
    v_pages = rng.standard_normal((kv_heads, num_pages, page, d)).astype(np.float32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    qsl = np.concatenate([qsl, [tokens]]).astype(np.int32)  # one padding sequence
    seq_lens = np.array(list(ctx_lens) + [0], np.int32)
    pages = rng.permutation(np.arange(1, num_pages))
    tables = np.zeros((len(seq_lens), width), np.int32)
    used = 0
    for s, ctx in enumerate(ctx_lens):
        n = -(-ctx // page)
        tables[s, :n] = pages[used : used + n]
        used += n
    return q, k_pages, v_pages, qsl, seq_lens, tables


@pytest.mark.parametrize("seed", [0, 1])
def test_attention_matches_naive_on_ragged_mixed_batch(seed):
    rng = np.random.default_rng(seed)
    # Decodes (q_len 1) at lengths 1, a page, a page plus one, long; prefill chunks with and
    # without a cached prefix, one longer than a query block and one crossing KV chunks.
    q_lens = [1, 1, 1, 1, 7, 70, 3, 130]
    ctx_lens = [1, 4, 5, 200, 7, 90, 67, 250]
    batch = random_batch(rng, q_lens, ctx_lens)
    ours = np.asarray(attention(*batch))
    ref = naive(*batch)
    np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=2e-5)
    assert not ours[sum(q_lens):].any()


def test_paged_attention_matches_naive():
    rng = np.random.default_rng(2)
    ctx = [1, 4, 5, 63]
    q, k_pages, v_pages, qsl, seq_lens, tables = random_batch(rng, [1] * 4, ctx)
    ours = np.asarray(paged_attention(q[:5], k_pages, v_pages, tables, seq_lens))
    ref = naive(q[:5], k_pages, v_pages, qsl, seq_lens, tables)
    np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=2e-5)
    assert not ours[4].any()  # the zero-length sequence


def test_write_kv_lands_in_slots():
    rng = np.random.default_rng(3)
    k_pages = np.zeros((2, 8, 4, 3), np.float32)
    k = rng.standard_normal((3, 2, 3)).astype(np.float32)
    slots = np.array([5, 6, 29], np.int32)
    new_k, new_v = write_kv(k_pages, k_pages, k, k, slots)
    new_k = np.asarray(new_k)
    for t, slot in enumerate(slots):
        np.testing.assert_array_equal(new_k[:, slot // 4, slot % 4], k[t])
    assert np.count_nonzero(new_k) == k.size


def test_attention_decode_only_batch_matches_naive():
    # All q_len <= 1 takes the vectorized decode path; a sequence without a query sits between
    # two decodes, and contexts cross several 16-page key chunks.
    rng = np.random.default_rng(4)
    q, k_pages, v_pages, qsl, seq_lens, tables = random_batch(
        rng, [1, 0, 1, 1], [3, 9, 130, 64], num_pages=200, width=40
    )
    ours = np.asarray(attention(q, k_pages, v_pages, qsl, seq_lens, tables))
    ref = naive(q, k_pages, v_pages, qsl, seq_lens, tables)
    np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=2e-5)
    assert not ours[3:].any()


@pytest.mark.parametrize("window", [1, 5, 70, 300])
def test_sliding_window_matches_naive(window):
    # Windows shorter than a page, than a query block, than a key chunk, and longer than every
    # context (then the same as none); decodes and prefill chunks with cached prefixes.
    rng = np.random.default_rng(5)
    batch = random_batch(rng, [1, 1, 7, 70, 130], [4, 200, 7, 90, 250])
    ours = np.asarray(attention(*batch, sliding_window=window))
    np.testing.assert_allclose(ours, naive(*batch, window=window), rtol=2e-5, atol=2e-5)
    if window == 300:
        np.testing.assert_allclose(ours, np.asarray(attention(*batch)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window", [None, 5])
def test_soft_cap_and_scale_match_naive(window):
    # Gemma 2's attention: scores times query_pre_attn_scalar ** -0.5, capped at 50 tanh(x / 50);
    # large queries so that the cap bends many scores.
    rng = np.random.default_rng(6)
    q, *rest = random_batch(rng, [1, 1, 7, 70], [4, 200, 7, 90])
    batch = (8.0 * q, *rest)
    ours = np.asarray(attention(*batch, sm_scale=0.3, logits_soft_cap=5.0, sliding_window=window))
    ref = naive(*batch, window=window, scale=0.3, cap=5.0)
    np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=2e-5)
    assert not np.allclose(ref, naive(*batch, window=window, scale=0.3), atol=1e-2)
