"""Ragged prefill attention over the paged KV pool in Pallas (Triton backend), and ``attention``.

``attention(...)`` is the one entry point the model calls for any mixed batch
(docs/architecture.md, "Attention ops"). It dispatches the two parts of the batch to two kernels:

* sequences with exactly one query token (decodes) go to the flash-decoding kernel of
    ``paged_attention.py`` (KV split across programs, GQA group packed into one tile);
* every other sequence (prefill chunks, and the padding rows past ``query_start_loc[S]``) goes
    to the ragged flash-attention kernel below.

Both kernels are always launched; the part that has no work in a batch costs one launch of
idle programs (see docs/performance.md for the measurement behind this choice).

Ragged prefill kernel: the flattened query tokens of each sequence are cut into blocks of
``block_q`` tokens (a sequence's last block may be short). A small XLA computation describes
each block in use (sequence, first query row, row end, position of the first query, context
length). The grid is (slots, query heads), at most ``max_programs`` programs; a program walks
the blocks in use of its slot (the static bound on blocks is far above the blocks a step
uses: a pure-decode step uses only the padding block). For one (query block, query head) it
streams the sequence's pages
``block_k`` tokens at a time with an online softmax, first the key blocks that every query of
the block sees (no mask), then the blocks on the causal diagonal (bottom-right aligned mask:
query i of a chunk of ``q_len`` sits at position ``seq_len - q_len + i``). The padding rows
past ``query_start_loc[S]`` form one extra pseudo-sequence of context 0 and are written as 0.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_quant import QuantizedPages, queries_for
from pallas_kernels.online_softmax import (
    MASK_VALUE,
    online_softmax_init,
    online_softmax_output,
    online_softmax_step,
    scaled_scores,
)
from pallas_kernels.paged_attention import (
    NUM_SMS,
    DecodeTuning,
    check_shapes,
    decode_grouped,
    flat_pool,
    group_query_tokens,
    load_kv,
    token_slots,
    ungroup_query_tokens,
)

# The most rows (query tokens x query heads of a KV head) a decode-kernel tile takes: the
# accumulator of 64 rows of 128 columns is 32 KB of float32 registers across 4 warps.
MAX_DECODE_ROWS = 64


def decode_query_tokens(num_drafts: int, group: int) -> int:
    """``attention``'s ``max_decode_q`` for steps whose sequences verify up to ``num_drafts``
    drafts, with ``group`` query heads per KV head: 1 + num_drafts where the decode kernel's
    tile holds that many tokens' heads within MAX_DECODE_ROWS rows, else 1 (the ragged kernel
    takes verifying sequences)."""
    return num_drafts + 1 if (num_drafts + 1) * group <= MAX_DECODE_ROWS else 1


_INFO_FIELDS = 8  # per query block: seq, row start, row end, first position, context length
PROGRAMS_TARGET = 4 * NUM_SMS


@dataclasses.dataclass(frozen=True)
class PrefillTuning:
    """Static tile and launch parameters of the ragged prefill kernel (None = default).

    Attributes:
        block_q: query tokens per program (power of two, >= 16).
        block_k: KV tokens per inner-loop step; a power of two, rounded up to page_size.
        num_warps: Triton warps per program.
        num_stages: Triton software-pipelining depth of the KV loop.
        max_programs: bound on the programs launched (query-block slots x query heads); each
            slot walks several query blocks when more are in use.
    """

    block_q: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    max_programs: int | None = None


def resolve_prefill_tuning(
    head_dim: int, page_size: int, itemsize: int = 2, tuning: PrefillTuning | None = None
) -> PrefillTuning:
    """Fills the unset fields of ``tuning``; returns a complete PrefillTuning.

    Defaults (measured on the H200, prefill-b8-s2k, docs/performance.md): 16-bit operands
    128x128 tiles, 8 warps, 2 stages; float32 (twice the shared memory per tile) 64x32, 4 warps;
    at most PROGRAMS_TARGET programs (4 per SM of an H200: one 128x128 program fills an SM's
    shared memory, and idle programs cost a launch each).
    """
    tuning = tuning or PrefillTuning()
    big = itemsize <= 2 and head_dim <= 128
    block_q = pl.next_power_of_2(max(16, tuning.block_q or (128 if big else 64)))
    block_k = pl.next_power_of_2(tuning.block_k or (128 if big else 32))
    block_k = max(block_k, page_size)
    return PrefillTuning(
        block_q=block_q,
        block_k=block_k,
        num_warps=tuning.num_warps or (8 if big else 4),
        num_stages=tuning.num_stages or 2,
        max_programs=tuning.max_programs or PROGRAMS_TARGET,
    )


def _prefill_kernel(
    info_ref,  # [NB * _INFO_FIELDS + 1] int32 (whole array); the last entry: blocks in use
    block_tables_ref,  # [S, P_pad] int32 (whole array)
    q_ref,  # [T, D], this query head
    k_ref,  # [num_pages * page_size, D], this head's KV head's pool, flattened
    v_ref,  # [num_pages * page_size, D] (FP8: uint16 pairs [..., D / 2], kv_quant.as_pairs)
    *refs,  # (ks_ref, vs_ref [num_pages * page_size] if quantized), o_ref [T, D] (this head)
    sm_scale: float,
    block_q: int,
    block_k: int,
    page_size: int,
    num_blocks: int,
    num_slots: int,
    quantized: bool,
    sliding_window: int | None,
    soft_cap: float | None,
):
    scale_refs, o_ref = (refs[:2], refs[2]) if quantized else ((), refs[0])
    # A program is one of num_slots slots of a query head; it walks the query blocks in use
    # slot, slot + num_slots, ... so the grid stays small when most of the num_blocks bound is
    # unused (a pure-decode step has none in use; each launched program costs its share of
    # shared memory whether it finds work or not). Passes alternate the slot order (zig-zag):
    # a sequence's later blocks cost more, and this evens out the slots' sums.
    slot = pl.program_id(0)
    head_dim = k_ref.shape[1]
    offs_q = jnp.arange(block_q, dtype=jnp.int32)
    offs_k = jnp.arange(block_k, dtype=jnp.int32)
    num_used = info_ref[num_blocks * _INFO_FIELDS]

    def query_block(blk):
        base = blk * _INFO_FIELDS
        seq = info_ref[base]
        row_start = info_ref[base + 1]
        row_end = info_ref[base + 2]
        pos_start = info_ref[base + 3]
        ctx_len = info_ref[base + 4]

        row_mask = (row_start + offs_q) < row_end
        q = plgpu.load(q_ref.at[pl.ds(row_start, block_q), :], mask=row_mask[:, None], other=0.0)
        q_pos = pos_start + offs_q

        # Keys up to the last real query's position; blocks wholly at or before the first
        # query's position need no mask.
        num_rows = jnp.clip(row_end - row_start, 0, block_q)
        kv_end = jnp.clip(pos_start + num_rows, 0, ctx_len)
        num_kv_blocks = pl.cdiv(kv_end, block_k)
        num_full = jnp.minimum(lax.div(jnp.maximum(pos_start + 1, 0), block_k), num_kv_blocks)

        def step(j, carry, masked):
            acc, m_prev, l_prev = carry
            k_pos = j * block_k + offs_k
            slots = token_slots(lambda p: block_tables_ref[seq, p], k_pos, page_size)
            k, v, k_scale, v_scale = load_kv(k_ref, v_ref, scale_refs, slots, q.dtype)
            # [block_q, block_k] f32, base-2 units
            s = scaled_scores(plgpu.dot(q, k, trans_b=True), sm_scale, k_scale, soft_cap)
            if masked:
                visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < ctx_len)
                if sliding_window is not None:
                    visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
                s = jnp.where(visible, s, MASK_VALUE)
            return online_softmax_step(acc, m_prev, l_prev, s, v, v_scale)

        carry = online_softmax_init(block_q, head_dim, groups=2 if quantized else 1)
        if sliding_window is None:
            carry = lax.fori_loop(0, num_full, functools.partial(step, masked=False), carry)
        else:  # every block masked, from the one holding the first query's first key
            num_full = lax.div(jnp.maximum(pos_start - sliding_window + 1, 0), block_k)
        acc, m, l = lax.fori_loop(
            num_full, num_kv_blocks, functools.partial(step, masked=True), carry)

        out = online_softmax_output(acc, l).astype(o_ref.dtype)
        plgpu.store(o_ref.at[pl.ds(row_start, block_q), :], out, mask=row_mask[:, None])

    def one_pass(i, carry):
        blk = i * num_slots + jnp.where(lax.rem(i, 2) == 0, slot, num_slots - 1 - slot)

        @pl.when(blk < num_used)
        def _():
            query_block(blk)

        return carry

    lax.fori_loop(0, pl.cdiv(num_used, num_slots), one_pass, 0)


def _block_info(query_start_loc, seq_lens, include, num_tokens, block_q, num_blocks):
    """Query-block descriptors, flat [num_blocks * _INFO_FIELDS + 1] int32: the blocks in
    use first (sequence by sequence, in order), then unused ones; the last entry counts those
    in use.

    Sequences with ``include`` False get no blocks (their rows are left for the decode kernel).
    One pseudo-sequence of context 0 covers the padding rows [query_start_loc[S], T).
    """
    num_seqs = seq_lens.shape[0]
    qsl = query_start_loc.astype(jnp.int32)
    q_lens = jnp.where(include, qsl[1:] - qsl[:-1], 0)
    starts = qsl  # [S + 1]: the pseudo-sequence starts at qsl[S]
    lens = jnp.concatenate([q_lens, jnp.maximum(num_tokens - qsl[-1:], 0)])
    ctx = jnp.concatenate([seq_lens.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    nblk = (lens + block_q - 1) // block_q
    ends = jnp.cumsum(nblk)  # inclusive
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    # compare_all: one fused kernel; the default "scan" method is a while loop, which on GPU
    # syncs with the host every iteration (measured: +0.05-0.2 ms per call on the H200).
    seq = jnp.searchsorted(ends, b, side="right", method="compare_all").astype(jnp.int32)
    valid = seq <= num_seqs
    seq = jnp.minimum(seq, num_seqs)
    in_seq = b - (ends[seq] - nblk[seq])
    row_start = starts[seq] + in_seq * block_q
    row_end = starts[seq] + lens[seq]
    pos_start = ctx[seq] - lens[seq] + in_seq * block_q
    zero = jnp.zeros_like(b)
    info = jnp.stack(
        [
            jnp.minimum(seq, num_seqs - 1),  # block-table row (the pseudo-sequence reads none)
            jnp.where(valid, row_start, 0),
            jnp.where(valid, row_end, 0),
            jnp.where(valid, pos_start, 0),
            jnp.where(valid, ctx[seq], 0),
            zero,
            zero,
            zero,
        ],
        axis=1,
    )
    return jnp.concatenate([info.reshape(-1), ends[-1:]])


def ragged_prefill(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    block_tables: jax.Array,
    include: jax.Array,
    *,
    sm_scale: float,
    tuning: PrefillTuning | None = None,
    interpret: bool = False,
    min_q_len: int = 1,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Ragged causal attention for the sequences where ``include`` [S] is True.

    ``min_q_len`` is a static lower bound on the query length of included sequences; it only
    tightens the launch grid. With ``sliding_window`` W a query sees only the W keys up to its
    own position; with ``soft_cap`` the scaled scores are capped (``scaled_scores``).

    Returns [T, H, D] in q's dtype: rows of included sequences and padding rows (0) are written;
    rows of the other sequences are left undefined for the caller to fill.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    num_seqs, pages_per_seq = block_tables.shape
    group = num_heads // num_kv_heads
    t = resolve_prefill_tuning(head_dim, page_size, jnp.dtype(q.dtype).itemsize, tuning)
    pages_per_block = t.block_k // page_size
    padded_pages = pl.cdiv(pages_per_seq, pages_per_block) * pages_per_block
    if padded_pages != pages_per_seq:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, padded_pages - pages_per_seq)))
    # Blocks: sum over sequences of cdiv(q_len, block_q) <= T / block_q + (sequences with
    # q_len >= 1); decode-only sequences (q_len 1) are excluded when ``include`` says so.
    num_blocks = pl.cdiv(num_tokens, t.block_q) + min(num_seqs, num_tokens // min_q_len) + 1
    num_slots = max(1, min(num_blocks, t.max_programs // num_heads))
    info = _block_info(query_start_loc, seq_lens, include, num_tokens, t.block_q, num_blocks)

    kernel = functools.partial(
        _prefill_kernel,
        sm_scale=sm_scale,
        block_q=t.block_q,
        block_k=t.block_k,
        page_size=page_size,
        num_blocks=num_blocks,
        num_slots=num_slots,
        quantized=isinstance(k_pages, QuantizedPages),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    pool = flat_pool(k_pages, v_pages)
    return pl.pallas_call(
        kernel,
        grid=(num_slots, num_heads),
        in_specs=[
            pl.BlockSpec((num_blocks * _INFO_FIELDS + 1,), lambda b, h: (0,)),
            pl.BlockSpec((num_seqs, padded_pages), lambda b, h: (0, 0)),
            pl.BlockSpec((num_tokens, None, head_dim), lambda b, h: (0, h, 0)),
        ] + [pl.BlockSpec((None, *a.shape[1:]),
                          lambda b, h, n=a.ndim: (h // group,) + (0,) * (n - 1)) for a in pool],
        out_specs=pl.BlockSpec((num_tokens, None, head_dim), lambda b, h: (0, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
        name=f"jaxserve_ragged_prefill_bq{t.block_q}_bk{t.block_k}",
    )(info, block_tables.astype(jnp.int32), q, *pool)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "interpret", "decode_tuning", "prefill_tuning", "split_decode",
                     "sliding_window", "logits_soft_cap", "decode_only", "max_decode_q"),
)
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
    decode_tuning: DecodeTuning | None = None,
    prefill_tuning: PrefillTuning | None = None,
    split_decode: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    decode_only: bool = False,
    max_decode_q: int = 1,
) -> jax.Array:
    """Causal attention for one flattened ragged batch of prefill chunks and decodes (Pallas).

    Args:
        q: [T, H, D] queries (float32 or bfloat16); tokens of sequence s are rows
            query_start_loc[s]:query_start_loc[s+1]. Rows from query_start_loc[S] on are padding.
        k_pages, v_pages: [KV, num_pages, page_size, D] the page pool, already holding this
            step's keys and values; D and page_size powers of two; H a multiple of KV.
        query_start_loc: [S + 1] int32, non-decreasing, query_start_loc[S] <= T; padding
            sequences have zero query tokens (and seq_len 0).
        seq_lens: [S] int32 context length of each sequence after this step (tokens), >= q_len.
        block_tables: [S, P] int32 page ids; entries past a sequence's length are never read.
        sm_scale: softmax scale, default D ** -0.5.
        interpret: run the Pallas kernels in interpret mode (CPU).
        decode_tuning, prefill_tuning: static tile/launch overrides; None picks from the shapes.
        split_decode: send sequences of 1 to ``max_decode_q`` query tokens to the
            flash-decoding kernel (True) or let the ragged kernel handle every sequence (False).
        sliding_window: W keys a query sees at most (itself and the W - 1 before it; HF's
            ``kv_idx > q_idx - W``); None: all before it. Blocks wholly before a query block's
            window are not read.
        logits_soft_cap: C caps the scaled scores at C tanh(x / C) before the softmax
            (Gemma 2's ``attn_logit_softcapping``); None: no cap.
        decode_only: the caller's promise that every sequence has one query token, at row s
            (``query_start_loc`` 0, 1, ..., n, n, ...), or none (padding sequences, after the
            others): only the decode kernel runs, on rows 0..S-1 in place (no ragged-prefill
            launch, no gather or scatter of rows); S <= T. A sequence breaking the promise gets
            zeros.
        max_decode_q: the most query tokens a sequence the decode kernel takes has (1 + the
            speculative drafts a step verifies): its rows stack the tokens' heads by KV head
            (``group_query_tokens``), so a verifying sequence's context is read once per KV
            head, where the ragged kernel reads it once per query head in a 16-row-or-more
            tile.

    Returns:
        [T, H, D] in q's dtype. Query i of sequence s sits at position seq_lens[s] - q_len(s) + i
        and sees keys at positions <= that (bottom-right aligned), and with a window > that - W.
        Padding rows are 0.

    Raises:
        ValueError: on inconsistent shapes.
    """
    check_shapes(q, k_pages, v_pages, block_tables, seq_lens)
    if query_start_loc.shape != (seq_lens.shape[0] + 1,):
        raise ValueError(
            f"query_start_loc {query_start_loc.shape} must be [S + 1] for seq_lens {seq_lens.shape}"
        )
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    sm_scale = float(sm_scale)
    dtype = q.dtype
    q = queries_for(q, k_pages.dtype)
    qsl = query_start_loc.astype(jnp.int32)
    q_lens = qsl[1:] - qsl[:-1]
    if decode_only:
        num_seqs = seq_lens.shape[0]
        if num_seqs > num_tokens:
            raise ValueError(f"decode_only needs S <= T, got S={num_seqs}, T={num_tokens}")
        one = (q_lens == 1) & (qsl[:-1] == jnp.arange(num_seqs, dtype=jnp.int32))
        qg, group = group_query_tokens(q[:num_seqs, None], num_kv_heads)
        dec = decode_grouped(qg, k_pages, v_pages, block_tables, jnp.where(one, seq_lens, 0),
                             sm_scale=sm_scale, tuning=decode_tuning, interpret=interpret,
                             sliding_window=sliding_window, soft_cap=logits_soft_cap)
        out = jnp.where(one[:, None, None], ungroup_query_tokens(dec, 1, group)[:, 0], 0)
        return jnp.pad(out, ((0, num_tokens - num_seqs), (0, 0), (0, 0))).astype(dtype)
    if split_decode:
        is_decode = (q_lens >= 1) & (q_lens <= max_decode_q)
    else:
        is_decode = jnp.zeros_like(q_lens, dtype=bool)

    out = ragged_prefill(
        q,
        k_pages,
        v_pages,
        qsl,
        seq_lens,
        block_tables,
        ~is_decode,
        sm_scale=sm_scale,
        tuning=prefill_tuning,
        interpret=interpret,
        min_q_len=max_decode_q + 1 if split_decode else 1,
        sliding_window=sliding_window,
        soft_cap=logits_soft_cap,
    )
    if split_decode:
        # Decode rows: gather each sequence's first max_decode_q query rows, attend, scatter
        # back those it has in place.
        rows = qsl[:-1, None] + jnp.arange(max_decode_q, dtype=jnp.int32)  # [S, Q]
        qg, group = group_query_tokens(q[jnp.clip(rows, 0, num_tokens - 1)], num_kv_heads)
        dec = decode_grouped(
            qg,
            k_pages,
            v_pages,
            block_tables,
            jnp.where(is_decode, seq_lens, 0),
            sm_scale=sm_scale,
            tuning=decode_tuning,
            interpret=interpret,
            sliding_window=sliding_window,
            soft_cap=logits_soft_cap,
            query_lens=q_lens if max_decode_q > 1 else None,
            group=group,
        )
        dec = ungroup_query_tokens(dec, max_decode_q, group).reshape(-1, num_heads, head_dim)
        kept = is_decode[:, None] & (jnp.arange(max_decode_q) < q_lens[:, None])
        dst = jnp.where(kept, rows, num_tokens).reshape(-1)  # out of bounds: dropped
        out = out.at[dst].set(dec, mode="drop", unique_indices=False)
    return out.astype(dtype)
