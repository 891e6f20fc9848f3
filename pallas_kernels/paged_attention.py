"""Decode paged attention in Pallas (Triton backend), with flash-decoding KV splits.

One query token per sequence attends over that sequence's pages of the KV page pool
(docs/architecture.md, "Attention ops"). One Pallas program handles one (sequence, KV head,
KV split): it
loads the query rows of all query heads that share the KV head (the GQA group, padded to 16 rows for
the tensor cores), then streams the split's pages ``block_k`` tokens at a time, keeping an
online softmax in float32. Splits of one sequence are combined exactly afterwards from their
running max ``m`` and denominator ``l`` (log-sum-exp merge), in plain XLA.

The split count, tile size and Triton launch parameters are static and chosen from the shapes
(see ``DecodeTuning``). Each sequence's keys are cut among the splits at run time, from its
length: a short sequence in a block table as wide as the longest context still spreads over
the splits (at least ``min_split_tokens`` keys each), and splits past its length exit at once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import kv_quant
from pallas_kernels.kv_quant import QuantizedPages, queries_for
from pallas_kernels.online_softmax import (
    MASK_VALUE,
    merge_columns,
    online_softmax_init,
    online_softmax_output,
    online_softmax_step,
    scaled_scores,
)

# Rows of the query tile: Triton's tensor-core dot needs at least 16 on each side.
MIN_TILE_ROWS = 16
# Streaming multiprocessors of an H100/H200; the split heuristic aims to fill them several times.
NUM_SMS = 132
PROGRAMS_TARGET = 2 * NUM_SMS
# The fewest keys a split gets by default: four bfloat16 tiles, the floor the splits had when
# they were cut from the block table's width.
MIN_SPLIT_TOKENS = 256


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """Static tile and launch parameters of the decode kernel (None = chosen from shapes).

    Attributes:
        block_k: KV tokens per inner-loop step; a multiple of page_size (rounded up to one).
        num_splits: KV splits per sequence (flash-decoding), the most a sequence's keys are
            cut into; 1 normalises inside the kernel.
        min_split_tokens: the fewest keys a split of a sequence gets (rounded up to whole
            tiles); a shorter sequence uses fewer splits.
        num_warps: Triton warps per program.
        num_stages: Triton software-pipelining depth of the KV loop.
    """

    block_k: int | None = None
    num_splits: int | None = None
    min_split_tokens: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


def resolve_decode_tuning(
    num_seqs: int,
    num_kv_heads: int,
    pages_per_seq: int,
    page_size: int,
    head_dim: int,
    tuning: DecodeTuning | None = None,
    quantized: bool = False,
) -> DecodeTuning:
    """Fills the unset fields of ``tuning`` for these shapes (``quantized``: an FP8 pool);
    returns a complete DecodeTuning."""
    tuning = tuning or DecodeTuning()
    # bfloat16: 64 tokens. FP8: 256 while the programs fit in about two waves (b64: 2.76
    # against 2.34 TB/s at 128), else 128 (b256: 2.92 against 2.81); H200, docs/performance.md.
    default_block_k = 64
    if quantized:
        default_block_k = 256 if num_seqs * num_kv_heads <= 4 * NUM_SMS else 128
    block_k = max(pl.next_power_of_2(tuning.block_k or default_block_k), page_size)
    max_tokens = pages_per_seq * page_size
    min_split_tokens = tuning.min_split_tokens or MIN_SPLIT_TOKENS
    num_splits = tuning.num_splits
    if num_splits is None:
        # Enough programs to fill the SMs (two resident per SM at the default tile); no more
        # than the longest context can fill; measured in docs/performance.md.
        want = pl.cdiv(PROGRAMS_TARGET, max(1, num_seqs * num_kv_heads))
        num_splits = max(1, min(want, max_tokens // max(block_k, min_split_tokens)))
    num_splits = max(1, min(num_splits, pl.cdiv(max_tokens, block_k)))
    return DecodeTuning(
        block_k=block_k,
        num_splits=num_splits,
        min_split_tokens=min_split_tokens,
        num_warps=tuning.num_warps or 4,
        num_stages=tuning.num_stages or 3,
    )


def token_slots(block_table_row, tokens, page_size: int):
    """Rows of the flattened pool ``[num_pages * page_size, D]`` that hold ``tokens`` [n] of a
    sequence whose pages are ``block_table_row`` (a ref, or a callable from page index to page
    id). Gathering a K/V tile row by row from these slots is 1.5x faster on the H200 than
    gathering whole pages and reshaping [pages, page_size, D] to [tokens, D] (the reshape
    makes Triton convert the tile's layout; docs/performance.md)."""
    return block_table_row(tokens // page_size) * page_size + tokens % page_size


def load_kv(k_ref, v_ref, scale_refs, slots, dtype):
    """K and V rows ``slots`` [n] of a flattened pool (``flat_pool``) -> (k [n, D], v, k_scale
    [1, n] f32 or None, v_scale [n] f32 or None), v as column groups (``online_softmax``):
    (v [n, D],), or for an FP8 pool (``scale_refs`` = its per-row scale refs) its (even, odd)
    columns, each [n, D / 2]. FP8 values are widened to dtype and the scales come back for the
    caller to fold into the scores and the probabilities (``kv_quant``)."""
    k, v = k_ref[slots], v_ref[slots]
    if not scale_refs:
        return k, (v,), None, None
    ks_ref, vs_ref = scale_refs
    k = kv_quant.from_storage(k).astype(dtype)
    return k, kv_quant.widen_pairs(v, dtype), ks_ref[slots][None, :], vs_ref[slots]


def _decode_kernel(
    seq_lens_ref,  # [S] int32 (whole array)
    *refs,  # query_lens_ref [S] int32 (whole array) if multi_query, then:
    # block_tables_ref [P] int32, this sequence's row; q_ref [Gp, D];
    # k_ref [num_pages * page_size, D], this KV head's pool, flattened; v_ref likewise (FP8:
    # uint16 pairs [..., D / 2], kv_quant.as_pairs); (ks_ref, vs_ref [num_pages * page_size]
    # if quantized); o_ref [Gp, D]; then (m_ref [Gp], l_ref [Gp]) when the KV length is split
    sm_scale: float,
    block_k: int,
    page_size: int,
    num_splits: int,
    min_split_tokens: int,
    quantized: bool,
    sliding_window: int | None,
    soft_cap: float | None,
    group: int,
    multi_query: bool,
):
    query_lens_ref, refs = (refs[0], refs[1:]) if multi_query else (None, refs)
    block_tables_ref, q_ref, k_ref, v_ref, *refs = refs
    scale_refs, (o_ref, *stat_refs) = (refs[:2], refs[2:]) if quantized else ((), refs)
    seq = pl.program_id(0)
    split = pl.program_id(2)
    rows, head_dim = q_ref.shape

    seq_len = seq_lens_ref[seq]
    q_len, row_end = 1, None
    if query_lens_ref is not None:
        # Row r is query token r // group of the sequence's q_len, at position seq_len - q_len
        # + r // group: it sees the keys before row_end (rows past q_len see them all, unused).
        q_len = query_lens_ref[seq]
        row_end = seq_len - q_len + 1 + jnp.arange(rows, dtype=jnp.int32) // group  # [Gp]
    first_key = 0
    if sliding_window is not None:  # the first row's window's first key
        first_key = jnp.maximum(seq_len - q_len + 1 - sliding_window, 0)
    # The keys the rows see, cut into whole tiles among the splits at run time.
    per_split = pl.cdiv(pl.cdiv(seq_len - first_key, num_splits), block_k) * block_k
    per_split = jnp.maximum(per_split, min_split_tokens)
    split_start = first_key + split * per_split
    split_end = jnp.minimum(seq_len, split_start + per_split)
    num_blocks = pl.cdiv(jnp.maximum(split_end - split_start, 0), block_k)
    last_page = block_tables_ref.shape[0] - 1  # a split's last tile may pass the table's end

    def page(p):
        return block_tables_ref[jnp.minimum(p, last_page)]

    q = q_ref[...]
    offs = jnp.arange(block_k, dtype=jnp.int32)

    def body(i, carry):
        acc, m_prev, l_prev = carry
        pos = split_start + i * block_k + offs
        slots = token_slots(page, pos, page_size)
        k, v, k_scale, v_scale = load_kv(k_ref, v_ref, scale_refs, slots, q.dtype)
        s = scaled_scores(plgpu.dot(q, k, trans_b=True), sm_scale, k_scale, soft_cap)
        if row_end is None:
            visible = (pos < split_end)[None, :]
        else:
            visible = pos[None, :] < jnp.minimum(row_end, split_end)[:, None]
            if sliding_window is not None:
                visible &= pos[None, :] >= (row_end - sliding_window)[:, None]
        s = jnp.where(visible, s, MASK_VALUE)  # [Gp, block_k] f32
        return online_softmax_step(acc, m_prev, l_prev, s, v, v_scale)

    init = online_softmax_init(rows, head_dim, groups=2 if quantized else 1)
    acc, m, l = lax.fori_loop(0, num_blocks, body, init)

    if stat_refs:
        m_ref, l_ref = stat_refs
        o_ref[...] = merge_columns(acc)
        m_ref[...] = m
        l_ref[...] = l
    else:
        o_ref[...] = online_softmax_output(acc, l).astype(o_ref.dtype)


def decode_grouped(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale: float,
    tuning: DecodeTuning | None = None,
    interpret: bool = False,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    query_lens: jax.Array | None = None,
    group: int = 1,
) -> jax.Array:
    """Decode attention on queries already grouped by KV head.

    Args:
        q: [S, KV, Gp, D], Gp a power of two >= 16 (rows past the real ones are ignored).
        k_pages, v_pages: [KV, num_pages, page_size, D].
        block_tables: [S, P] int32.
        seq_lens: [S] int32; 0 gives zeros.
        sliding_window: a query sees only the last W keys up to itself; None: all.
        soft_cap: the scaled scores capped at C tanh(x / C) (``scaled_scores``); None: no cap.
        query_lens: [S] int32, the query tokens of each sequence (verified drafts: the
            sequence's last q_len positions), whose rows j * group .. j * group + group - 1 of
            q hold token j's heads (``group_query_tokens``); each sees the keys up to its own
            position. None: one token a sequence, every row at position seq_len - 1.
        group: query heads per KV head (the rows of one query token), with ``query_lens``.

    Returns:
        [S, KV, Gp, D] in q's dtype.
    """
    num_seqs, num_kv_heads, rows, head_dim = q.shape
    _, num_pages, page_size, _ = k_pages.shape
    pages_per_seq = block_tables.shape[1]
    quantized = isinstance(k_pages, QuantizedPages)
    t = resolve_decode_tuning(num_seqs, num_kv_heads, pages_per_seq, page_size, head_dim, tuning,
                              quantized)
    num_splits = t.num_splits
    split = num_splits > 1

    kernel = functools.partial(
        _decode_kernel,
        sm_scale=sm_scale,
        block_k=t.block_k,
        page_size=page_size,
        num_splits=num_splits,
        min_split_tokens=t.min_split_tokens,
        quantized=quantized,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        group=group,
        multi_query=query_lens is not None,
    )
    pool = flat_pool(k_pages, v_pages)
    lengths = [seq_lens.astype(jnp.int32)]
    if query_lens is not None:
        lengths.append(query_lens.astype(jnp.int32))
    in_specs = [pl.BlockSpec((num_seqs,), lambda s, h, k: (0,)) for _ in lengths] + [
        pl.BlockSpec((None, pages_per_seq), lambda s, h, k: (s, 0)),
        pl.BlockSpec((None, None, rows, head_dim), lambda s, h, k: (s, h, 0, 0)),
    ] + [pl.BlockSpec((None, *a.shape[1:]), lambda s, h, k, n=a.ndim: (h,) + (0,) * (n - 1))
         for a in pool]
    if split:
        out_shape = [
            jax.ShapeDtypeStruct((num_seqs, num_kv_heads, num_splits, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_seqs, num_kv_heads, num_splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((num_seqs, num_kv_heads, num_splits, rows), jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec((None, None, None, rows, head_dim), lambda s, h, k: (s, h, k, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, h, k: (s, h, k, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, h, k: (s, h, k, 0)),
        ]
    else:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
        out_specs = pl.BlockSpec((None, None, rows, head_dim), lambda s, h, k: (s, h, 0, 0))

    out = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
        name=f"jaxserve_paged_decode_bk{t.block_k}_ns{num_splits}",
    )(*lengths, block_tables.astype(jnp.int32), q, *pool)

    if not split:
        return out
    acc, m, l = out
    m_max = m.max(axis=2, keepdims=True)
    w = jnp.exp2(m - m_max)  # [S, KV, NS, Gp]
    num = (acc * w[..., None]).sum(axis=2)
    den = (l * w).sum(axis=2)
    den = jnp.where(den > 0.0, den, 1.0)
    return (num / den[..., None]).astype(q.dtype)


def flat_pool(k_pages, v_pages) -> list[jax.Array]:
    """[KV, num_pages, page_size, D] -> [KV, num_pages * page_size, D] (a free reshape), the
    layout the kernels gather token rows from (``token_slots``): [k, v], and for an FP8 pool
    (``kv_quant.QuantizedPages``) [k, v as uint16 pairs [KV, num_pages * page_size, D / 2]
    (``kv_quant.as_pairs``), k_scales, v_scales [KV, num_pages * page_size]]."""
    kv, num_pages, page_size, head_dim = k_pages.shape
    if not isinstance(k_pages, QuantizedPages):
        shape = (kv, num_pages * page_size, head_dim)
        return [k_pages.reshape(shape), v_pages.reshape(shape)]
    k, v = flat_pool(k_pages.values, v_pages.values)
    return [k, kv_quant.as_pairs(v),
            k_pages.scales.reshape(kv, -1), v_pages.scales.reshape(kv, -1)]


def group_query_tokens(q: jax.Array, num_kv_heads: int) -> tuple[jax.Array, int]:
    """[S, Q, H, D] (Q query tokens a sequence) -> ([S, KV, Gp, D] zero-padded, G): token j's
    heads of KV head h at rows j * G .. j * G + G - 1, Gp = max(16, next_pow2(Q * G)) (the
    layout ``decode_grouped``'s ``query_lens`` reads)."""
    s, num_tokens, num_heads, head_dim = q.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    qg = q.reshape(s, num_tokens, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qg = qg.reshape(s, num_kv_heads, num_tokens * group, head_dim)
    rows = max(MIN_TILE_ROWS, pl.next_power_of_2(num_tokens * group))
    return jnp.pad(qg, ((0, 0), (0, 0), (0, rows - num_tokens * group), (0, 0))), group


def ungroup_query_tokens(out: jax.Array, num_tokens: int, group: int) -> jax.Array:
    """``group_query_tokens``' inverse on ``decode_grouped``'s output: [S, KV, Gp, D] ->
    [S, Q, H, D]."""
    s, num_kv_heads, _, head_dim = out.shape
    out = out[:, :, :num_tokens * group].reshape(s, num_kv_heads, num_tokens, group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(s, num_tokens, num_kv_heads * group, head_dim)


def check_shapes(q, k_pages, v_pages, block_tables, seq_lens):
    """Validates the arrays both kernels take (docs/architecture.md, "Attention ops").

    Raises ValueError."""
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
    if len(k_pages.shape) != 4 or q.ndim != 3:
        raise ValueError("expected q [N, H, D] and pages [KV, num_pages, page_size, D]")
    if q.shape[2] != k_pages.shape[3]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) and pages ({k_pages.shape[3]}) differ")
    head_dim, page_size = q.shape[2], k_pages.shape[2]
    if head_dim & (head_dim - 1) or page_size & (page_size - 1):
        raise ValueError(f"head_dim ({head_dim}) and page_size ({page_size}) must be powers of two")
    if block_tables.ndim != 2 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables {block_tables.shape} vs seq_lens {seq_lens.shape}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "tuning"))
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    interpret: bool = False,
    tuning: DecodeTuning | None = None,
) -> jax.Array:
    """Decode attention: one query token per sequence over the paged KV pool (Pallas).

    Args:
        q: [S, H, D] the query of each sequence's newest token (at position seq_lens[s] - 1);
            float32 or bfloat16. H must be a multiple of KV (any group size, padded inside).
        k_pages, v_pages: [KV, num_pages, page_size, D]; D and page_size powers of two.
        block_tables: [S, P] int32 page ids; entries past a sequence's length are never read.
        seq_lens: [S] int32 context lengths (tokens) including the newest token; 0 gives zeros.
        sm_scale: softmax scale, default D ** -0.5.
        interpret: run the Pallas kernel in interpret mode (CPU).
        tuning: static tile/launch overrides (DecodeTuning); None picks them from the shapes.

    Returns:
        [S, H, D] in q's dtype.

    Raises:
        ValueError: on inconsistent shapes.
    """
    check_shapes(q, k_pages, v_pages, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    qg, group = group_query_tokens(q[:, None], num_kv_heads)
    out = decode_grouped(
        queries_for(qg, k_pages.dtype),
        k_pages,
        v_pages,
        block_tables,
        seq_lens,
        sm_scale=float(sm_scale),
        tuning=tuning,
        interpret=interpret,
    )
    return ungroup_query_tokens(out, 1, group)[:, 0].astype(q.dtype)
