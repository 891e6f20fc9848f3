"""The Pallas kernels compiled for the GPU (Triton) against the pure-JAX oracles.

Marked ``gpu`` and skipped where JAX sees no GPU. Shapes are larger than the interpret-mode
tests (CPU) and include the Llama-3-8B head layout of the benchmarks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.platforms import GPU, current_platform
from pallas_kernels import get_attention_fn, reference
from pallas_kernels.flash_attention import attention
from pallas_kernels.paged_attention import DecodeTuning, paged_attention
from pallas_kernels.testing import make_batch, rel_err, tolerance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]


def _rng():
    seed = int(np.random.SeedSequence().entropy % (2**32))
    return np.random.default_rng(seed), seed


@pytest.mark.parametrize("group,kv,head_dim,page_size", [
    (1, 4, 64, 16), (3, 3, 64, 16), (4, 8, 128, 16), (8, 2, 128, 32), (5, 2, 128, 64),
])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_paged_attention_gpu(group, kv, head_dim, page_size, dtype):
    rng, seed = _rng()
    lens = [1, page_size, page_size + 1, 1000, 3000, 77, 0]
    b = make_batch(rng, [1] * 6 + [0], lens, num_heads=group * kv, num_kv_heads=kv,
                   head_dim=head_dim, page_size=page_size, dtype=dtype, num_tokens=7,
                   pages_per_seq=-(-4096 // page_size))
    ref = reference.paged_attention(b.q, b.k_pages, b.v_pages, b.block_tables, b.seq_lens)
    split5 = DecodeTuning(num_splits=5, block_k=64, min_split_tokens=64)
    for tuning in (None, DecodeTuning(num_splits=1), split5):
        out = paged_attention(b.q, b.k_pages, b.v_pages, b.block_tables, b.seq_lens,
                              tuning=tuning)
        assert bool(jnp.isfinite(out).all()), f"seed {seed} {tuning}"
        err = rel_err(out, ref)
        assert err <= tolerance(dtype), f"seed {seed} {tuning}: rel err {err}"
        assert bool((out[6] == 0).all())


@pytest.mark.parametrize("group,kv,head_dim,page_size", [
    (1, 4, 64, 16), (3, 3, 64, 16), (4, 8, 128, 16), (8, 1, 128, 32), (3, 2, 128, 64),
    (2, 8, 256, 16),  # Gemma 2's head_dim
])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("split_decode,window,cap", [(True, None, None), (False, None, None),
                                                      (True, 700, None), (False, 37, None),
                                                      (True, 37, 0.5)])
def test_attention_gpu(group, kv, head_dim, page_size, dtype, split_decode, window, cap):
    rng, seed = _rng()
    ps = page_size
    pairs = [(1, 1), (1, ps), (1, ps + 1), (1, 1500), (ps + 3, ps + 3), (ps, 2 * ps),
             (ps + 1, ps + 6), (300, 1100), (700, 700), (1, 5)]
    rng.shuffle(pairs)
    q_lens, seq_lens = map(list, zip(*pairs))
    real = sum(q_lens)
    b = make_batch(rng, q_lens, seq_lens, num_heads=group * kv, num_kv_heads=kv,
                   head_dim=head_dim, page_size=ps, dtype=dtype, num_tokens=real + 37,
                   num_seqs=16, pages_per_seq=-(-2048 // ps))
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    out = attention(*b.args, split_decode=split_decode, **kw)
    ref = reference.attention(*b.args, **kw)
    n = b.num_real_tokens
    assert bool(jnp.isfinite(out).all()), f"seed {seed}"
    qsl = np.asarray(b.query_start_loc)
    for s in range(len(pairs)):
        e = rel_err(out[qsl[s]:qsl[s + 1]], ref[qsl[s]:qsl[s + 1]])
        assert e <= tolerance(dtype), f"seed {seed}: sequence {s} {pairs[s]} rel err {e}"
    assert bool((out[n:] == 0).all()), f"seed {seed}"


@pytest.mark.parametrize("max_q,group,kv,window,fp8", [
    (5, 4, 8, None, False), (9, 4, 8, None, True), (3, 4, 8, 700, False), (5, 7, 4, 37, True),
    (2, 1, 4, None, False),
])
def test_multi_token_decode_gpu(max_q, group, kv, window, fp8):
    """Verified drafts (1..max_q query tokens a sequence) through the compiled decode kernel,
    beside prompt chunks in the ragged kernel, against the reference; the 8B head layout and
    others."""
    rng, seed = _rng()
    pairs = [(1, 1), (max_q, max_q + 15), (2, 17), (max_q, 1500), (max_q - 1 or 1, 333),
             (1, 48), (300, 1100), (max_q + 1, 61), (3, 5), (max_q, 2048)]
    rng.shuffle(pairs)
    q_lens, seq_lens = map(list, zip(*pairs))
    b = make_batch(rng, q_lens, seq_lens, num_heads=group * kv, num_kv_heads=kv, head_dim=128,
                   page_size=16, dtype=jnp.bfloat16, fp8=fp8, num_tokens=sum(q_lens) + 29,
                   num_seqs=16, pages_per_seq=128)
    out = attention(*b.args, max_decode_q=max_q, sliding_window=window)
    ref = reference.attention(*b.args, sliding_window=window)
    assert bool(jnp.isfinite(out).all()), f"seed {seed}"
    qsl = np.asarray(b.query_start_loc)
    for s in range(len(pairs)):
        e = rel_err(out[qsl[s]:qsl[s + 1]], ref[qsl[s]:qsl[s + 1]])
        assert e <= tolerance(jnp.bfloat16), f"seed {seed}: sequence {s} {pairs[s]} rel err {e}"
    assert bool((out[b.num_real_tokens:] == 0).all()), f"seed {seed}"


@pytest.mark.parametrize("fp8,window", [(False, None), (True, None), (False, 100)])
def test_decode_only_gpu(fp8, window):
    """``decode_only`` compiled: rows 0..S-1 equal the mixed path's, padding rows zero."""
    rng, seed = _rng()
    lens = [1, 16, 17, 1000, 3000, 77, 255]
    b = make_batch(rng, [1] * len(lens), lens, num_heads=32, num_kv_heads=8, head_dim=128,
                   page_size=16, dtype=jnp.bfloat16, fp8=fp8, num_tokens=16, num_seqs=9,
                   pages_per_seq=256)
    mixed = attention(*b.args, sliding_window=window)
    fast = attention(*b.args, sliding_window=window, decode_only=True)
    n = len(lens)
    assert rel_err(fast[:n], mixed[:n]) <= 1e-3, f"seed {seed}"
    assert bool((fast[n:] == 0).all()), f"seed {seed}"


def test_get_attention_fn_gpu():
    platform = current_platform()
    assert platform is GPU
    assert get_attention_fn(platform.attention_backend, platform.interpret_pallas) is attention
