"""Pure-JAX oracles for the attention kernels (DESIGN.md section 3).

The model's CPU path runs these, and kernel tests compare the Pallas kernels against them.
All attention is causal with grouped-query heads: query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)`` (the layout of HF's ``repeat_kv``), so group sizes that
are not powers of two (SmolLM2's 3) need no padding here.

KV page pool layout: ``k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim]``.
Token ``i`` of sequence ``s`` lives in page ``block_tables[s, i // page_size]`` at offset
``i % page_size``.
"""

import jax
import jax.numpy as jnp

# Query tokens of one prefill sequence are processed this many at a time; a decode (one query
# token) takes a single-query path so it does not pay for a whole block.
_PREFILL_BLOCK = 64


def _gather_kv(pages: jax.Array, block_table: jax.Array) -> jax.Array:
    """[KV, num_pages, page_size, D] gathered at block_table [P] -> [KV, P * page_size, D]."""
    kv_heads, _, page_size, head_dim = pages.shape
    return pages[:, block_table].reshape(kv_heads, -1, head_dim)


def _attend(q, k, v, q_pos, ctx_len, sm_scale):
    """q [N, H, D] at positions q_pos [N]; k, v [KV, L, D]; keys at positions < ctx_len.

    Returns [N, H, D] in q's dtype; softmax in float32.
    """
    n, num_heads, head_dim = q.shape
    kv_heads, length, _ = k.shape
    qg = q.reshape(n, kv_heads, num_heads // kv_heads, head_dim).astype(jnp.float32)
    scores = jnp.einsum("nkgd,kld->nkgl", qg, k.astype(jnp.float32)) * sm_scale
    key_pos = jnp.arange(length)
    mask = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] < ctx_len)
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("nkgl,kld->nkgd", probs, v.astype(jnp.float32))
    return out.reshape(n, num_heads, head_dim).astype(q.dtype)


def attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    block_tables: jax.Array,
    *,
    sm_scale: float | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention for one flattened ragged batch of prefill chunks and decodes.

    Args:
      q: [T, H, D] queries; tokens of sequence s are rows query_start_loc[s]:query_start_loc[s+1].
      k_pages, v_pages: [KV, num_pages, page_size, D] the page pool, already holding this step's
        keys and values.
      query_start_loc: [S + 1] int32, non-decreasing; padding sequences have zero query tokens.
      seq_lens: [S] int32, context length of each sequence after this step (tokens).
      block_tables: [S, P] int32 page ids; entries past a sequence's length are ignored.
      sm_scale: softmax scale, default D ** -0.5.
      interpret: unused here (the oracle is plain JAX); kept for the kernels' signature.

    Returns:
      [T, H, D] in q's dtype. Query i of sequence s sits at position
      seq_lens[s] - q_len(s) + i and sees keys at positions <= that (bottom-right aligned mask).
      Rows past query_start_loc[S] (padding tokens) are zero.
    """
    del interpret
    num_tokens, num_heads, head_dim = q.shape
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    block = min(_PREFILL_BLOCK, num_tokens)
    # Padding rows let every block slice stay in bounds; they are cut off at the end.
    q_pad = jnp.pad(q, ((0, block), (0, 0), (0, 0)))
    out = jnp.zeros_like(q_pad)

    def one_sequence(s, out):
        start = query_start_loc[s]
        q_len = query_start_loc[s + 1] - start
        ctx_len = seq_lens[s]
        k = _gather_kv(k_pages, block_tables[s])
        v = _gather_kv(v_pages, block_tables[s])

        def decode(out):
            q1 = jax.lax.dynamic_slice_in_dim(q_pad, start, 1)
            o = _attend(q1, k, v, (ctx_len - 1)[None], ctx_len, sm_scale)
            return jax.lax.dynamic_update_slice_in_dim(out, o, start, axis=0)

        def prefill(out):
            def one_block(b, out):
                offset = b * block
                qb = jax.lax.dynamic_slice_in_dim(q_pad, start + offset, block)
                idx = offset + jnp.arange(block)
                o = _attend(qb, k, v, ctx_len - q_len + idx, ctx_len, sm_scale)
                # The last block may run into the next sequence's rows: keep those as they are.
                old = jax.lax.dynamic_slice_in_dim(out, start + offset, block)
                o = jnp.where((idx < q_len)[:, None, None], o, old)
                return jax.lax.dynamic_update_slice_in_dim(out, o, start + offset, axis=0)

            return jax.lax.fori_loop(0, (q_len + block - 1) // block, one_block, out)

        return jax.lax.cond(q_len == 1, decode, prefill, out)

    out = jax.lax.fori_loop(0, block_tables.shape[0], one_sequence, out)
    return out[:num_tokens]


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
    k = k_pages[:, block_tables].reshape(kv_heads, num_seqs, -1, head_dim)
    v = v_pages[:, block_tables].reshape(kv_heads, num_seqs, -1, head_dim)
    qg = q.reshape(num_seqs, kv_heads, num_heads // kv_heads, head_dim).astype(jnp.float32)
    scores = jnp.einsum("skgd,ksld->skgl", qg, k.astype(jnp.float32)) * sm_scale
    mask = jnp.arange(k.shape[2])[None, :] < seq_lens[:, None]
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(seq_lens[:, None, None, None] > 0, probs, 0.0)
    out = jnp.einsum("skgl,ksld->skgd", probs, v.astype(jnp.float32))
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)


def write_kv(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's keys and values into their slots of the page pool (XLA scatter).

    Args:
      k_pages, v_pages: [KV, num_pages, page_size, D]; donate them to update in place.
      k, v: [T, KV, D] new keys and values.
      slot_mapping: [T] int32, page * page_size + offset; padding tokens point into page 0.

    Returns:
      The updated (k_pages, v_pages).
    """
    page_size = k_pages.shape[2]
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    k_pages = k_pages.at[:, pages, offsets].set(k.transpose(1, 0, 2).astype(k_pages.dtype))
    v_pages = v_pages.at[:, pages, offsets].set(v.transpose(1, 0, 2).astype(v_pages.dtype))
    return k_pages, v_pages
