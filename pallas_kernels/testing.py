"""Random ragged batches over a paged KV pool, for kernel tests and benchmarks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_quant
from pallas_kernels.kv_quant import QuantizedPages

# Unreferenced pages and slots past a sequence's length hold this (finite, so a kernel that
# forgets a mask gives a visibly wrong answer instead of a NaN that the oracle shares).
POISON = 30.0


@dataclasses.dataclass
class Batch:
    """One flattened ragged batch (docs/architecture.md, "Attention ops") with its page pool."""

    q: jax.Array  # [T, H, D]
    k_pages: jax.Array | QuantizedPages  # [KV, num_pages, page_size, D]
    v_pages: jax.Array | QuantizedPages
    query_start_loc: jax.Array  # [S + 1] int32
    seq_lens: jax.Array  # [S] int32
    block_tables: jax.Array  # [S, P] int32
    num_real_tokens: int

    @property
    def args(self):
        return (self.q, self.k_pages, self.v_pages, self.query_start_loc, self.seq_lens,
                self.block_tables)


def make_batch(
    rng: np.random.Generator,
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype=jnp.float32,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    pages_per_seq: int | None = None,
    extra_pages: int = 3,
    fp8: bool = False,
    kv_scale: float = 1.0,
) -> Batch:
    """A batch of sequences with the given query lengths and context lengths (after the step).

    Pads T to ``num_tokens`` and S to ``num_seqs`` (padding sequences: q_len 0, seq_len 0) and
    the block-table width to ``pages_per_seq`` (padding entries: page 0). Pages are handed out
    in a random order from 1 up; page 0 and every slot no sequence owns hold ``POISON``.
    K/V values are standard normal times ``kv_scale``; ``fp8`` stores the pool as
    ``kv_quant.QuantizedPages`` (q stays in ``dtype``).
    """
    assert len(q_lens) == len(seq_lens)
    assert all(0 <= q <= s for q, s in zip(q_lens, seq_lens))
    num_seqs = num_seqs or len(q_lens)
    q_lens = list(q_lens) + [0] * (num_seqs - len(q_lens))
    seq_lens = list(seq_lens) + [0] * (num_seqs - len(seq_lens))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    real = int(qsl[-1])
    num_tokens = num_tokens or real
    assert num_tokens >= real
    need = [-(-s // page_size) for s in seq_lens]
    pages_per_seq = pages_per_seq or max(1, max(need))
    num_pages = 1 + sum(need) + extra_pages
    perm = rng.permutation(np.arange(1, num_pages))
    block_tables = np.zeros((num_seqs, pages_per_seq), np.int32)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k = np.full(shape, POISON, np.float32)
    v = np.full(shape, -POISON, np.float32)
    used = 0
    for s in range(num_seqs):
        pages = perm[used:used + need[s]]
        used += need[s]
        block_tables[s, :need[s]] = pages
        for i in range(seq_lens[s]):
            page, off = pages[i // page_size], i % page_size
            k[:, page, off] = rng.standard_normal((num_kv_heads, head_dim))
            v[:, page, off] = rng.standard_normal((num_kv_heads, head_dim))
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    k, v = k * kv_scale, v * kv_scale
    pool = (lambda x: kv_quant.quantize_pages(jnp.asarray(x))) if fp8 else (
        lambda x: jnp.asarray(x, dtype))
    return Batch(
        q=jnp.asarray(q, dtype),
        k_pages=pool(k),
        v_pages=pool(v),
        query_start_loc=jnp.asarray(qsl),
        seq_lens=jnp.asarray(seq_lens, jnp.int32),
        block_tables=jnp.asarray(block_tables),
        num_real_tokens=real,
    )


def rel_err(out: jax.Array, ref: jax.Array) -> float:
    """||out - ref|| / ||ref|| in float32."""
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def tolerance(dtype) -> float:
    """Relative-error bound on GPU: float32 (tf32 dots, here and in XLA) and bfloat16 operands."""
    return 5e-3 if jnp.dtype(dtype) == jnp.float32 else 2e-2
