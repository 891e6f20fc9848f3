"""The online softmax both Pallas kernels stream their key blocks through (FlashAttention-2).

A kernel keeps, per query row, a running max ``m``, denominator ``l`` and weighted value sum
``acc``, all float32; scores are in base-2 units (scaled by ``LOG2E``) so that the update uses
``exp2``. Masked scores are ``MASK_VALUE``. These run inside a kernel body (Triton backend).

``acc`` is a tuple of column groups matching the value tile's: one [R, D] array, or for an FP8
pool two [R, D/2] arrays holding the even and the odd columns (``kv_quant.widen_pairs``: the
8-bit values are read two at a time, so that no dot operand is loaded from shared memory a
byte at a time). ``merge_columns`` puts the groups back in column order.
"""

import math

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

# A large finite negative for masked scores: keeps exp2(mask - max) at 0 without inf - inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Scale scores by this to use exp2: exp(x) = exp2(x * log2 e).
LOG2E = math.log2(math.e)


def scaled_scores(dot, sm_scale: float, k_scale=None, soft_cap: float | None = None):
    """Scores in base-2 units from the q . k products ``dot`` [R, K] f32: times ``sm_scale``
    (and the keys' FP8 scales ``k_scale``, broadcast over R), capped by ``cap * tanh(x / cap)``
    where ``soft_cap`` is given (Gemma 2's attention-logit soft-capping), times ``LOG2E``."""
    scale = sm_scale if k_scale is None else sm_scale * k_scale
    if soft_cap is None:
        return dot * (scale * LOG2E)
    return jnp.tanh(dot * (scale / soft_cap)) * (soft_cap * LOG2E)


def online_softmax_init(rows: int, head_dim: int, groups: int = 1):
    """The empty state (acc: ``groups`` arrays [rows, head_dim / groups], m [rows], l [rows]),
    before any key block."""
    acc = tuple(jnp.zeros((rows, head_dim // groups), jnp.float32) for _ in range(groups))
    m = jnp.full((rows,), MASK_VALUE, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    return acc, m, l


def online_softmax_step(acc, m_prev, l_prev, s, v, v_scale=None):
    """Fold one key block into the running softmax.

    Args:
      acc: the running sum of p @ V, f32 column groups (see the module docstring); m_prev,
        l_prev: [R] f32 running max and denominator.
      s: [R, block_k] f32 scores in base-2 units, masked entries MASK_VALUE.
      v: the values' column groups, each [block_k, D / len(acc)].
      v_scale: [block_k] f32 per-row scales of v (an FP8 pool, ``kv_quant``), or None.

    Returns:
      The updated (acc, m, l).
    """
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next[:, None])
    l_next = alpha * l_prev + p.sum(axis=1)
    if v_scale is None:
        p = p.astype(v[0].dtype)
        return tuple(a * alpha[:, None] + plgpu.dot(p, x) for a, x in zip(acc, v)), m_next, l_next
    # Scales relative to the block's largest keep p * scale in [0, 1] for the 16-bit dot (a small
    # scale times a small p would lose its bits in float16); the largest is applied after. Only
    # unmasked keys count (a masked slot may hold a stale row's scale; the null page's are 0).
    top = jnp.where(s.max(axis=0) > MASK_VALUE, v_scale, 0.0).max()
    top = jnp.where(top > 0.0, top, 1.0)
    pv = (p * (v_scale / top)[None, :]).astype(v[0].dtype)
    return (tuple(a * alpha[:, None] + plgpu.dot(pv, x) * top for a, x in zip(acc, v)),
            m_next, l_next)


def merge_columns(acc):
    """Column groups (even and odd columns, or one group) -> one [R, D] array."""
    if len(acc) == 1:
        return acc[0]
    rows, half = acc[0].shape
    return jnp.stack(acc, axis=-1).reshape(rows, 2 * half)


def online_softmax_output(acc, l):
    """The attention output acc / l as one [R, D] float32 array; rows that saw no key (l = 0)
    come out 0."""
    safe_l = jnp.where(l > 0.0, l, 1.0)
    return merge_columns(acc) / safe_l[:, None]
