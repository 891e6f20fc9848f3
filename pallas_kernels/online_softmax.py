"""The online softmax both Pallas kernels stream their key blocks through (FlashAttention-2).

A kernel keeps, per query row, a running max ``m``, denominator ``l`` and weighted value sum
``acc``, all float32; scores are in base-2 units (scaled by ``LOG2E``) so that the update uses
``exp2``. Masked scores are ``MASK_VALUE``. These run inside a kernel body (Triton backend).
"""

import math

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

# A large finite negative for masked scores: keeps exp2(mask - max) at 0 without inf - inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Scale scores by this to use exp2: exp(x) = exp2(x * log2 e).
LOG2E = math.log2(math.e)


def online_softmax_init(rows: int, head_dim: int):
    """The empty state (acc [rows, head_dim], m [rows], l [rows]), before any key block."""
    acc = jnp.zeros((rows, head_dim), jnp.float32)
    m = jnp.full((rows,), MASK_VALUE, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    return acc, m, l


def online_softmax_step(acc, m_prev, l_prev, s, v, v_scale=None):
    """Fold one key block into the running softmax.

    Args:
      acc: [R, D] f32 running sum of p @ V; m_prev, l_prev: [R] f32 running max and denominator.
      s: [R, block_k] f32 scores in base-2 units, masked entries MASK_VALUE.
      v: [block_k, D] values.
      v_scale: [block_k] f32 per-row scales of v (an FP8 pool, ``kv_quant``), or None.

    Returns:
      The updated (acc, m, l).
    """
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next[:, None])
    l_next = alpha * l_prev + p.sum(axis=1)
    if v_scale is None:
        return acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v), m_next, l_next
    # Scales relative to the block's largest keep p * scale in [0, 1] for the 16-bit dot (a small
    # scale times a small p would lose its bits in float16); the largest is applied after. Only
    # unmasked keys count (a masked slot may hold a stale row's scale; the null page's are 0).
    top = jnp.where(s.max(axis=0) > MASK_VALUE, v_scale, 0.0).max()
    top = jnp.where(top > 0.0, top, 1.0)
    pv = p * (v_scale / top)[None, :]
    return acc * alpha[:, None] + plgpu.dot(pv.astype(v.dtype), v) * top, m_next, l_next


def online_softmax_output(acc, l):
    """The attention output acc / l in float32; rows that saw no key (l = 0) come out 0."""
    safe_l = jnp.where(l > 0.0, l, 1.0)
    return acc / safe_l[:, None]
