"""Pallas attention kernels in interpret mode (CPU) against the pure-JAX oracles.

Fresh random ragged inputs each run (the seed is in the failure message). Interpret mode
starts every Pallas output as NaN, so "all finite" proves that every element was written;
unreferenced KV slots hold a finite poison value, so a missing mask shows as a wrong answer.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import kv_quant
from pallas_kernels import reference
from pallas_kernels.flash_attention import PrefillTuning, attention, decode_query_tokens
from pallas_kernels.paged_attention import DecodeTuning, paged_attention
from pallas_kernels.testing import make_batch, rel_err


def _rng():
    seed = int(np.random.SeedSequence().entropy % (2**32))
    return np.random.default_rng(seed), seed


def _tol(dtype):
    # Interpret mode computes the dots in the operand dtype: float32 is exact up to rounding.
    return 1e-5 if jnp.dtype(dtype) == jnp.float32 else 2e-2


DECODE_CASES = [
    # group, num_kv_heads, head_dim, page_size, dtype, tuning
    (1, 2, 64, 16, jnp.float32, None),
    (3, 2, 64, 16, jnp.float32, DecodeTuning(block_k=16, num_splits=3, min_split_tokens=16)),
    (4, 2, 128, 32, jnp.bfloat16, None),
    (8, 1, 128, 64, jnp.float32, DecodeTuning(num_splits=2, min_split_tokens=16)),
    (3, 3, 128, 16, jnp.bfloat16, DecodeTuning(block_k=32, num_splits=4, min_split_tokens=16)),
]


@pytest.mark.parametrize("group,kv,head_dim,page_size,dtype,tuning", DECODE_CASES)
def test_paged_attention_matches_reference(group, kv, head_dim, page_size, dtype, tuning):
    rng, seed = _rng()
    long = 4 * page_size + int(rng.integers(1, page_size))
    lens = [1, page_size, page_size + 1, long]
    b = make_batch(rng, [1] * 4, lens, num_heads=group * kv, num_kv_heads=kv,
                   head_dim=head_dim, page_size=page_size, dtype=dtype,
                   num_seqs=5, pages_per_seq=6)
    # Padding sequence 4 has seq_len 0: the oracle gives zeros there, so must we.
    q = b.q[:5] if b.q.shape[0] >= 5 else jnp.pad(b.q, ((0, 5 - b.q.shape[0]), (0, 0), (0, 0)))
    out = paged_attention(q, b.k_pages, b.v_pages, b.block_tables, b.seq_lens,
                          interpret=True, tuning=tuning)
    ref = reference.paged_attention(q, b.k_pages, b.v_pages, b.block_tables, b.seq_lens)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert bool(jnp.isfinite(out).all()), f"unwritten output (seed {seed})"
    assert rel_err(out, ref) <= _tol(dtype), f"seed {seed}: rel err {rel_err(out, ref)}"
    assert bool((out[4] == 0).all()), f"seed {seed}"


ATTENTION_CASES = [
    # group, num_kv_heads, head_dim, page_size, dtype, split_decode, prefill tuning
    # (max_programs: one slot per head walks every query block; 3 slots walk them zig-zag)
    (1, 2, 64, 16, jnp.float32, True, PrefillTuning(block_q=16, block_k=16, max_programs=2)),
    (3, 2, 64, 16, jnp.float32, True, PrefillTuning(block_q=16, block_k=32, max_programs=18)),
    (4, 2, 128, 32, jnp.bfloat16, True, None),
    (8, 1, 128, 16, jnp.float32, False, PrefillTuning(block_q=32, block_k=16)),
    (3, 1, 128, 64, jnp.bfloat16, True, PrefillTuning(block_q=16)),
]


@pytest.mark.parametrize("group,kv,head_dim,page_size,dtype,split,ptune", ATTENTION_CASES)
def test_attention_mixed_batch_matches_reference(group, kv, head_dim, page_size, dtype, split,
                                                 ptune):
    rng, seed = _rng()
    ps = page_size
    long = 3 * ps + int(rng.integers(1, ps))
    # (q_len, seq_len): decodes at 1, a page, a page + 1 and long contexts; a whole prompt; a
    # chunk exactly a page over a cached prefix; a page + 1 chunk; a long chunk over a prefix
    # that ends mid-page.
    pairs = [(1, 1), (1, ps), (1, ps + 1), (1, long), (ps + 3, ps + 3), (ps, 2 * ps),
             (ps + 1, ps + 1 + 5), (long - 7, long)]
    rng.shuffle(pairs)
    q_lens, seq_lens = map(list, zip(*pairs))
    real = sum(q_lens)
    b = make_batch(rng, q_lens, seq_lens, num_heads=group * kv, num_kv_heads=kv,
                   head_dim=head_dim, page_size=ps, dtype=dtype, num_tokens=real + 5,
                   num_seqs=len(pairs) + 2, pages_per_seq=5)
    out = attention(*b.args, interpret=True, split_decode=split, prefill_tuning=ptune)
    ref = reference.attention(*b.args)
    n = b.num_real_tokens
    assert out.shape == b.q.shape and out.dtype == b.q.dtype
    assert bool(jnp.isfinite(out).all()), f"unwritten output (seed {seed})"
    err = rel_err(out[:n], ref[:n])
    assert err <= _tol(dtype), f"seed {seed}: rel err {err}"
    # Per sequence too, so one short sequence cannot hide behind the long ones.
    qsl = np.asarray(b.query_start_loc)
    for s in range(len(pairs)):
        lo, hi = qsl[s], qsl[s + 1]
        e = rel_err(out[lo:hi], ref[lo:hi])
        assert e <= _tol(dtype), f"seed {seed}: sequence {s} {pairs[s]} rel err {e}"
    assert bool((out[n:] == 0).all()), f"padding rows not zero (seed {seed})"


def test_attention_pure_decode_and_empty_batch():
    rng, seed = _rng()
    b = make_batch(rng, [1, 1, 1], [1, 17, 40], num_heads=6, num_kv_heads=2, head_dim=64,
                   page_size=16, num_tokens=4, num_seqs=4, pages_per_seq=4)
    out = attention(*b.args, interpret=True)
    ref = reference.attention(*b.args)
    assert rel_err(out[:3], ref[:3]) <= 1e-5, f"seed {seed}"
    assert bool((out[3] == 0).all())
    # Nothing scheduled at all (every sequence padding): all rows are padding, all zero.
    zero = attention(b.q, b.k_pages, b.v_pages, jnp.zeros(5, jnp.int32), jnp.zeros(4, jnp.int32),
                     b.block_tables, interpret=True)
    assert bool((zero == 0).all())


@pytest.mark.parametrize("tuning", [
    None,
    DecodeTuning(block_k=64, num_splits=2, min_split_tokens=16),
    DecodeTuning(block_k=32, num_splits=5, min_split_tokens=32),
    DecodeTuning(block_k=16, num_splits=8, min_split_tokens=16),
])
def test_decode_splits_cut_each_sequence_by_its_length(tuning):
    """Each sequence's keys are cut among the splits by its own length, not the table's width:
    sequences far shorter than the table, one shorter than a split, and one that fills the
    table (its last split's last tile passes the table's end: page ids are clamped there)."""
    rng, seed = _rng()
    lens = [1, 40, 150, 288, 17, 0]
    b = make_batch(rng, [1] * 5 + [0], lens, num_heads=8, num_kv_heads=2, head_dim=64,
                   page_size=16, num_tokens=6, pages_per_seq=18)
    out = paged_attention(b.q, b.k_pages, b.v_pages, b.block_tables, b.seq_lens,
                          interpret=True, tuning=tuning)
    ref = reference.paged_attention(b.q, b.k_pages, b.v_pages, b.block_tables, b.seq_lens)
    assert bool(jnp.isfinite(out).all()), f"unwritten output (seed {seed})"
    assert rel_err(out, ref) <= 1e-5, f"seed {seed}: rel err {rel_err(out, ref)}"
    assert bool((out[5] == 0).all())


def test_decode_query_tokens_fit_the_decode_tile():
    assert decode_query_tokens(4, 4) == 5 and decode_query_tokens(15, 4) == 16
    assert decode_query_tokens(16, 4) == 1 and decode_query_tokens(8, 8) == 1
    assert decode_query_tokens(0, 3) == 1


@pytest.mark.parametrize("max_q,group,kv,window,dtune,fp8", [
    (5, 3, 2, None, None, False),
    (3, 4, 2, None, DecodeTuning(block_k=16, num_splits=3, min_split_tokens=16), False),
    (9, 1, 3, 13, DecodeTuning(block_k=32, num_splits=2, min_split_tokens=16), False),
    (5, 3, 2, 21, None, True),
    (2, 8, 1, None, DecodeTuning(block_k=16, num_splits=4, min_split_tokens=16), True),
])
def test_multi_token_decode_matches_reference(max_q, group, kv, window, dtune, fp8):
    """Sequences of 1 to max_decode_q query tokens (verified drafts) through the decode kernel,
    with prompt chunks beside them through the ragged kernel: every row as the reference,
    across key blocks, KV splits, windows and page edges (the last tokens straddling one)."""
    rng, seed = _rng()
    pairs = [(1, 1), (max_q, max_q + 15), (2, 17), (max_q, 70), (max_q - 1 or 1, 33),
             (1, 48), (19, 19), (max_q + 1, 61), (3, 5)]
    pairs = [(min(q, s), s) for q, s in pairs]
    rng.shuffle(pairs)
    q_lens, seq_lens = map(list, zip(*pairs))
    b = make_batch(rng, q_lens, seq_lens, num_heads=group * kv, num_kv_heads=kv, head_dim=64,
                   page_size=16, dtype=jnp.bfloat16 if fp8 else jnp.float32, fp8=fp8,
                   num_tokens=sum(q_lens) + 3, num_seqs=len(pairs) + 1, pages_per_seq=5)
    out = attention(*b.args, interpret=True, max_decode_q=max_q, decode_tuning=dtune,
                    sliding_window=window, prefill_tuning=PrefillTuning(block_q=16))
    ref = reference.attention(*b.args, sliding_window=window)
    assert bool(jnp.isfinite(out).all()), f"unwritten output (seed {seed})"
    qsl = np.asarray(b.query_start_loc)
    for s in range(len(pairs)):
        lo, hi = qsl[s], qsl[s + 1]
        e = rel_err(out[lo:hi], ref[lo:hi])
        assert e <= (2e-2 if fp8 else 1e-5), f"seed {seed}: sequence {s} {pairs[s]} rel err {e}"
    assert bool((out[b.num_real_tokens:] == 0).all()), f"padding rows not zero (seed {seed})"


@pytest.mark.parametrize("fp8,window", [(False, None), (True, None), (False, 20)])
def test_decode_only_equals_the_mixed_path(fp8, window):
    """``decode_only`` (one decode launch over rows 0..S-1, T > S padding rows) gives the mixed
    path's output on a decode-only batch, padding sequences and rows zero."""
    rng, seed = _rng()
    b = make_batch(rng, [1, 1, 1, 1, 1], [1, 17, 40, 33, 64], num_heads=6, num_kv_heads=2,
                   head_dim=64, page_size=16, num_tokens=8, num_seqs=7, pages_per_seq=5,
                   fp8=fp8)
    mixed = attention(*b.args, interpret=True, sliding_window=window)
    fast = attention(*b.args, interpret=True, sliding_window=window, decode_only=True)
    assert rel_err(fast[:5], mixed[:5]) <= 1e-6, f"seed {seed}"
    assert bool((fast[5:] == 0).all()), f"padding rows not zero (seed {seed})"
    with pytest.raises(ValueError, match="S <= T"):
        attention(b.q[:6], *b.args[1:], interpret=True, decode_only=True)


def test_sm_scale_and_mixed_dtypes():
    rng, seed = _rng()
    b = make_batch(rng, [5, 1], [9, 30], num_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    out = attention(*b.args, sm_scale=0.3, interpret=True)
    ref = reference.attention(*b.args, sm_scale=0.3)
    assert rel_err(out, ref) <= 1e-5, f"seed {seed}"
    # float32 queries over a bfloat16 pool: computed in the pool's dtype, returned in q's.
    kb, vb = b.k_pages.astype(jnp.bfloat16), b.v_pages.astype(jnp.bfloat16)
    out = attention(b.q, kb, vb, *b.args[3:], interpret=True)
    ref = reference.attention(b.q, kb, vb, *b.args[3:])
    assert out.dtype == jnp.float32 and rel_err(out, ref) <= 2e-2, f"seed {seed}"


def test_shape_errors():
    rng, _ = _rng()
    b = make_batch(rng, [2], [2], num_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    with pytest.raises(ValueError):
        attention(b.q, b.k_pages, b.v_pages[:, :, :, :32], *b.args[3:], interpret=True)
    with pytest.raises(ValueError):
        attention(b.q[:, :3], b.k_pages, b.v_pages, *b.args[3:], interpret=True)
    with pytest.raises(ValueError):
        attention(*b.args[:3], b.query_start_loc[:1], b.seq_lens, b.block_tables, interpret=True)


def test_get_attention_fn():
    assert pallas_kernels.get_attention_fn("reference") is reference.attention
    assert pallas_kernels.get_attention_fn("pallas") is attention
    fn = pallas_kernels.get_attention_fn("pallas", interpret=True)
    assert isinstance(fn, functools.partial) and fn.keywords == {"interpret": True}
    with pytest.raises(ValueError):
        pallas_kernels.get_attention_fn("auto")


def test_fp8_quantize_fits_every_row_and_never_overflows():
    rng, seed = _rng()
    # Rows from 1e-6 to 1e6 in magnitude (e4m3fn alone tops out at 448), and an all-zero row.
    mags = 10.0 ** rng.uniform(-6, 6, size=(64, 1))
    x = (rng.standard_normal((64, 128)) * mags).astype(np.float32)
    x[0] = 0.0
    values, scales = kv_quant.quantize(jnp.asarray(x))
    assert values.dtype == jnp.float8_e4m3fn and scales.shape == (64,)
    back = np.asarray(kv_quant.dequantize(values, scales))
    assert np.isfinite(back).all(), f"seed {seed}"
    # 3 mantissa bits: each value within 2^-4 of its row's largest magnitude.
    amax = np.abs(x).max(axis=1, keepdims=True)
    assert (np.abs(back - x) <= amax * 2.0**-4 + 1e-30).all(), f"seed {seed}"
    assert (back[0] == 0).all()


@pytest.mark.parametrize("kv_scale", [1e-4, 1.0, 1e3])
def test_fp8_pool_kernels_match_reference(kv_scale):
    """Both kernels (interpret mode) on an FP8 pool against the reference on the same pool; at
    1e3 the K/V values are far above e4m3fn's 448 and must still come out finite; at 1e-4 the
    value scales are far below float16's normal range (the kernels' dots run in float16)."""
    rng, seed = _rng()
    pairs = [(1, 1), (1, 17), (1, 40), (19, 19), (16, 32), (23, 40)]
    q_lens, seq_lens = map(list, zip(*pairs))
    b = make_batch(rng, q_lens, seq_lens, num_heads=8, num_kv_heads=2, head_dim=64,
                   page_size=16, dtype=jnp.bfloat16, num_tokens=sum(q_lens) + 3,
                   num_seqs=len(pairs) + 1, pages_per_seq=4, fp8=True, kv_scale=kv_scale)
    out = attention(*b.args, interpret=True, prefill_tuning=PrefillTuning(block_q=16))
    ref = reference.attention(*b.args)
    n = b.num_real_tokens
    assert out.dtype == jnp.bfloat16 and bool(jnp.isfinite(out).all()), f"seed {seed}"
    assert rel_err(out[:n], ref[:n]) <= 2e-2, f"seed {seed}: {rel_err(out[:n], ref[:n])}"
    assert bool((out[n:] == 0).all())
    dq = b.q[jnp.asarray(np.asarray(b.query_start_loc[:len(pairs)]))]
    dec = paged_attention(dq, b.k_pages, b.v_pages, b.block_tables[:len(pairs)],
                          b.seq_lens[:len(pairs)], interpret=True)
    dref = reference.paged_attention(dq, b.k_pages, b.v_pages, b.block_tables[:len(pairs)],
                                     b.seq_lens[:len(pairs)])
    assert rel_err(dec, dref) <= 2e-2, f"seed {seed}"


def test_fp8_reference_reads_the_dequantized_pool():
    """The reference on an FP8 pool equals the reference on that pool dequantized to float32,
    and stays close to the unquantized pool (per-token scales keep the error small)."""
    rng, seed = _rng()
    kw = dict(num_heads=6, num_kv_heads=2, head_dim=64, page_size=16, num_seqs=4,
              pages_per_seq=3)
    b8 = make_batch(np.random.default_rng(seed), [5, 1, 1], [21, 30, 9], fp8=True, **kw)
    b32 = make_batch(np.random.default_rng(seed), [5, 1, 1], [21, 30, 9], **kw)
    deq = [kv_quant.dequantize(p.values, p.scales) for p in (b8.k_pages, b8.v_pages)]
    out8 = reference.attention(*b8.args)
    assert rel_err(out8, reference.attention(b8.q, *deq, *b8.args[3:])) <= 1e-6, f"seed {seed}"
    assert rel_err(out8, reference.attention(*b32.args)) <= 5e-2, f"seed {seed}"


@pytest.mark.parametrize("window,split,ptune,dtune,fp8", [
    (1, True, PrefillTuning(block_q=16, block_k=16, max_programs=2), None, False),
    (13, True, PrefillTuning(block_q=16, block_k=32, max_programs=18),
     DecodeTuning(block_k=16, num_splits=3, min_split_tokens=16), False),
    (40, False, PrefillTuning(block_q=16, block_k=16), None, False),
    (21, True, PrefillTuning(block_q=16), DecodeTuning(num_splits=2, min_split_tokens=16), True),
    (500, True, None, None, False),  # longer than every context: the same as none
])
def test_sliding_window_matches_reference(window, split, ptune, dtune, fp8):
    """Windows shorter than a page, a key block and a KV split, over decodes and prefill
    chunks with cached prefixes (some splits then wholly before the window)."""
    rng, seed = _rng()
    pairs = [(1, 1), (1, 16), (1, 17), (1, 75), (19, 19), (16, 48), (23, 70), (5, 61)]
    q_lens, seq_lens = map(list, zip(*pairs))
    b = make_batch(rng, q_lens, seq_lens, num_heads=6, num_kv_heads=2, head_dim=64,
                   page_size=16, dtype=jnp.bfloat16 if fp8 else jnp.float32, fp8=fp8,
                   num_tokens=sum(q_lens) + 3, num_seqs=len(pairs) + 1, pages_per_seq=5)
    out = attention(*b.args, interpret=True, split_decode=split, prefill_tuning=ptune,
                    decode_tuning=dtune, sliding_window=window)
    ref = reference.attention(*b.args, sliding_window=window)
    n, tol = b.num_real_tokens, 2e-2 if fp8 else 1e-5
    assert bool(jnp.isfinite(out).all()), f"unwritten output (seed {seed})"
    qsl = np.asarray(b.query_start_loc)
    for s in range(len(pairs)):
        e = rel_err(out[qsl[s]:qsl[s + 1]], ref[qsl[s]:qsl[s + 1]])
        assert e <= tol, f"seed {seed}: sequence {s} {pairs[s]} rel err {e}"
    assert bool((out[n:] == 0).all())
    if window == 500:
        assert rel_err(ref[:n], reference.attention(*b.args)[:n]) <= 1e-6


@pytest.mark.parametrize("split,fp8", [(True, False), (False, False), (True, True)])
def test_soft_cap_matches_reference(split, fp8):
    """Gemma 2's attention-logit soft-capping and its own softmax scale, with a sliding window,
    in both kernels (large queries: the cap bends most scores)."""
    rng, seed = _rng()
    pairs = [(1, 1), (1, 17), (1, 75), (19, 19), (23, 70)]
    q_lens, seq_lens = map(list, zip(*pairs))
    b = make_batch(rng, q_lens, seq_lens, num_heads=6, num_kv_heads=2, head_dim=64,
                   page_size=16, dtype=jnp.bfloat16 if fp8 else jnp.float32, fp8=fp8,
                   num_tokens=sum(q_lens) + 3, num_seqs=len(pairs) + 1, pages_per_seq=5)
    args = (8.0 * b.q, *b.args[1:])
    kw = dict(sm_scale=0.2, logits_soft_cap=3.0, sliding_window=40)
    out = attention(*args, interpret=True, split_decode=split,
                    decode_tuning=DecodeTuning(block_k=16, num_splits=2, min_split_tokens=16),
                    **kw)
    ref = reference.attention(*args, **kw)
    n, tol = b.num_real_tokens, 2e-2 if fp8 else 1e-5
    assert rel_err(out[:n], ref[:n]) <= tol, f"seed {seed}"
    uncapped = reference.attention(*args, sm_scale=0.2, sliding_window=40)
    assert rel_err(uncapped[:n], ref[:n]) > 0.1
