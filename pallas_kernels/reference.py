"""Pure-JAX oracles for the attention kernels (docs/architecture.md, "Attention ops").

The model's CPU path runs these, and kernel tests compare the Pallas kernels against them.
All attention is causal with grouped-query heads: query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)`` (the layout of HF's ``repeat_kv``), so group sizes that
are not powers of two (SmolLM2's 3) need no padding here.

KV page pool layout: ``k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim]``, or
the FP8 pool of ``kv_quant.QuantizedPages`` (same shape; read back through its scales).
Token ``i`` of sequence ``s`` lives in page ``block_tables[s, i // page_size]`` at offset
``i % page_size``.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import read_pages

# Query tokens of one prefill sequence are processed this many at a time.
_QUERY_BLOCK = 64
# Keys are read this many pages at a time, only as far as a sequence's context reaches, so the
# cost follows the real lengths and not the block table's padded width.
_KV_CHUNK_PAGES = 16


def _init_softmax(rows: int, kv_heads: int, group: int, head_dim: int):
    """Running max, denominator and accumulator of an online softmax over key chunks."""
    return (
        jnp.full((rows, kv_heads, group), -jnp.inf, jnp.float32),
        jnp.zeros((rows, kv_heads, group), jnp.float32),
        jnp.zeros((rows, kv_heads, group, head_dim), jnp.float32),
    )


def _softmax_step(carry, s, weighted_values):
    """Fold one chunk of masked scores s [R, KV, G, L] into the running softmax;
    weighted_values(p) is p @ V for that chunk, [R, KV, G, D]."""
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(axis=-1))
    # Rows that have seen no key yet keep m = -inf; exp(-inf - -inf) would be nan.
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    scale = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
    return m_new, l * scale + p.sum(axis=-1), acc * scale[..., None] + weighted_values(p)


def _finish_softmax(carry, num_heads: int, head_dim: int):
    _, l, acc = carry
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(-1, num_heads, head_dim)


def _window_start(pos, sliding_window: int | None):
    """The first key position a query at ``pos`` sees: 0, or with a sliding window of W keys
    (HF's ``kv_idx > q_idx - W``) pos - W + 1."""
    return 0 if sliding_window is None else jnp.maximum(pos - sliding_window + 1, 0)


def _capped(s, soft_cap: float | None):
    """Scaled scores capped at C tanh(s / C) (Gemma 2's attention-logit soft-capping)."""
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def _attend_block(q, q_pos, k_pages, v_pages, block_table, ctx_len, sm_scale, sliding_window,
                  soft_cap):
    """Attention of one query block over one sequence's paged keys.

    Args:
      q: [N, H, D] queries at positions q_pos [N]; a query sees keys at positions <= its own
        (and, with ``sliding_window`` W, > its own - W).
      k_pages, v_pages: [KV, num_pages, page_size, D].
      block_table: [P'] int32, P' a multiple of _KV_CHUNK_PAGES.
      ctx_len: keys at positions >= ctx_len are never read.

    Returns:
      [N, H, D] float32.
    """
    n, num_heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    chunk = _KV_CHUNK_PAGES * page_size
    qg = q.reshape(n, kv_heads, -1, head_dim).astype(jnp.float32) * sm_scale
    last = jnp.minimum(jnp.max(q_pos) + 1, ctx_len)
    first = _window_start(q_pos, sliding_window)

    def body(c, carry):
        pages = jax.lax.dynamic_slice_in_dim(block_table, c * _KV_CHUNK_PAGES, _KV_CHUNK_PAGES)
        k = read_pages(k_pages, pages).reshape(kv_heads, chunk, head_dim)
        v = read_pages(v_pages, pages).reshape(kv_heads, chunk, head_dim)
        key_pos = c * chunk + jnp.arange(chunk)
        mask = ((key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] < ctx_len)
                & (key_pos[None, :] >= jnp.reshape(first, (-1, 1))))
        s = jnp.where(mask[:, None, None, :],
                      _capped(jnp.einsum("nkgd,kld->nkgl", qg, k), soft_cap), -jnp.inf)
        return _softmax_step(carry, s, lambda p: jnp.einsum("nkgl,kld->nkgd", p, v))

    init = _init_softmax(n, kv_heads, num_heads // kv_heads, head_dim)
    carry = jax.lax.fori_loop(jnp.min(first) // chunk, (last + chunk - 1) // chunk, body, init)
    return _finish_softmax(carry, num_heads, head_dim)


def _decode_all(q, k_pages, v_pages, tables, seq_lens, sm_scale, sliding_window, soft_cap):
    """Every sequence's one query [S, H, D] (at position seq_lens - 1) at once, key chunks read
    for all sequences together up to the longest length (from the earliest window start).
    Returns [S, H, D] float32."""
    num_seqs, num_heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    chunk = _KV_CHUNK_PAGES * page_size
    qg = q.reshape(num_seqs, kv_heads, -1, head_dim).astype(jnp.float32) * sm_scale
    first = _window_start(seq_lens - 1, sliding_window)

    def body(c, carry):
        pages = jax.lax.dynamic_slice_in_dim(tables, c * _KV_CHUNK_PAGES, _KV_CHUNK_PAGES, axis=1)
        k = read_pages(k_pages, pages).reshape(kv_heads, num_seqs, chunk, head_dim)
        v = read_pages(v_pages, pages).reshape(kv_heads, num_seqs, chunk, head_dim)
        key_pos = c * chunk + jnp.arange(chunk)[None, :]
        mask = (key_pos < seq_lens[:, None]) & (key_pos >= jnp.reshape(first, (-1, 1)))
        s = jnp.where(mask[:, None, None, :],
                      _capped(jnp.einsum("skgd,ksld->skgl", qg, k), soft_cap), -jnp.inf)
        return _softmax_step(carry, s, lambda p: jnp.einsum("skgl,ksld->skgd", p, v))

    init = _init_softmax(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    # Sequences without a decode have length 0: they start no earlier than the others.
    start = jnp.min(jnp.where(seq_lens > 0, first, jnp.iinfo(jnp.int32).max)) // chunk
    carry = jax.lax.fori_loop(jnp.minimum(start, (jnp.max(seq_lens) + chunk - 1) // chunk),
                              (jnp.max(seq_lens) + chunk - 1) // chunk, body, init)
    return _finish_softmax(carry, num_heads, head_dim)


def attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    block_tables: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    interpret: bool = False,
    decode_only: bool = False,
    max_decode_q: int = 1,
) -> jax.Array:
    """Causal attention for one flattened ragged batch of prefill chunks and decodes.

    Args:
      q: [T, H, D] queries; tokens of sequence s are rows query_start_loc[s]:query_start_loc[s+1].
      k_pages, v_pages: [KV, num_pages, page_size, D] the page pool, already holding this step's
        keys and values.
      query_start_loc: [S + 1] int32, non-decreasing; padding sequences have zero query tokens.
      seq_lens: [S] int32, context length of each sequence after this step (tokens).
      block_tables: [S, P] int32 page ids; entries past a sequence's length are never read.
      sm_scale: softmax scale, default D ** -0.5.
      sliding_window: W keys a query sees at most (itself and the W - 1 before it; HF's
        ``kv_idx > q_idx - W``); None: all before it.
      logits_soft_cap: C caps the scaled scores at C tanh(x / C) before the softmax (Gemma 2's
        ``attn_logit_softcapping``); None: no cap.
      interpret, decode_only, max_decode_q: unused here (the oracle is plain JAX, and the same for every
        batch); kept for the kernels' signature.

    Returns:
      [T, H, D] in q's dtype. Query i of sequence s sits at position
      seq_lens[s] - q_len(s) + i and sees keys at positions <= that (bottom-right aligned mask)
      and, with a window, > that - W. Rows past query_start_loc[S] (padding tokens) are zero.
    """
    del interpret, decode_only, max_decode_q
    q, query_start_loc, seq_lens, block_tables = map(
        jnp.asarray, (q, query_start_loc, seq_lens, block_tables)
    )
    num_tokens, num_heads, head_dim = q.shape
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    block = min(_QUERY_BLOCK, num_tokens)
    # Padding rows let every block slice stay in bounds; they are cut off at the end.
    q_pad = jnp.pad(q, ((0, block), (0, 0), (0, 0)))
    out = jnp.zeros(q_pad.shape, jnp.float32)
    width = -(-block_tables.shape[1] // _KV_CHUNK_PAGES) * _KV_CHUNK_PAGES
    tables = jnp.pad(block_tables, ((0, 0), (0, width - block_tables.shape[1])))

    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    # Decodes (one query) all at once; a sequence of other length reads no keys there.
    rows = query_start_loc[:-1]
    o = _decode_all(q[jnp.minimum(rows, num_tokens - 1)], k_pages, v_pages, tables,
                    jnp.where(q_lens == 1, seq_lens, 0), sm_scale, sliding_window,
                    logits_soft_cap)
    rows = jnp.where(q_lens == 1, rows, num_tokens + block)
    out = out.at[rows].set(o, mode="drop")

    def one_sequence(s, out):
        start = query_start_loc[s]
        q_len = query_start_loc[s + 1] - start
        ctx_len = seq_lens[s]

        def one_block(b, out):
            offset = b * block
            qb = jax.lax.dynamic_slice_in_dim(q_pad, start + offset, block)
            idx = offset + jnp.arange(block)
            q_pos = ctx_len - q_len + jnp.minimum(idx, q_len - 1)
            o = _attend_block(qb, q_pos, k_pages, v_pages, tables[s], ctx_len, sm_scale,
                              sliding_window, logits_soft_cap)
            # The last block may run into the next sequence's rows: keep those as they are.
            old = jax.lax.dynamic_slice_in_dim(out, start + offset, block)
            o = jnp.where((idx < q_len)[:, None, None], o, old)
            return jax.lax.dynamic_update_slice_in_dim(out, o, start + offset, axis=0)

        n_blocks = jnp.where(q_len > 1, (q_len + block - 1) // block, 0)
        return jax.lax.fori_loop(0, n_blocks, one_block, out)

    out = jax.lax.fori_loop(0, block_tables.shape[0], one_sequence, out)[:num_tokens]
    return out.astype(q.dtype)


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention: one query token per sequence over the paged KV pool.

    Args:
      q: [S, H, D] the query of each sequence's newest token (at position seq_lens[s] - 1).
      k_pages, v_pages: [KV, num_pages, page_size, D].
      block_tables: [S, P] int32 page ids.
      seq_lens: [S] int32 context lengths (tokens), including the newest token; a sequence with
        length 0 yields zeros.
      sm_scale: softmax scale, default D ** -0.5.
      interpret: unused here; kept for the kernels' signature.

    Returns:
      [S, H, D] in q's dtype.
    """
    del interpret
    num_seqs, num_heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    k = read_pages(k_pages, block_tables).reshape(kv_heads, num_seqs, -1, head_dim)
    v = read_pages(v_pages, block_tables).reshape(kv_heads, num_seqs, -1, head_dim)
    qg = q.reshape(num_seqs, kv_heads, num_heads // kv_heads, head_dim).astype(jnp.float32)
    scores = jnp.einsum("skgd,ksld->skgl", qg, k) * sm_scale
    mask = jnp.arange(k.shape[2])[None, :] < seq_lens[:, None]
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(seq_lens[:, None, None, None] > 0, probs, 0.0)
    out = jnp.einsum("skgl,ksld->skgd", probs, v)
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)

