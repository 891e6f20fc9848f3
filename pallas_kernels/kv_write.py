"""The KV write in Pallas (Triton backend): a step's new keys and values into their slots of the
page pool, K and V (and an FP8 pool's quantization and scales) in one kernel.

XLA writes the pool with one scatter a pool array (two for bfloat16, four for FP8: values and
scales of K and V, after a separate row-max), each a kernel of its own and, at prefill sizes,
at a small fraction of the memory's rate: on the H200, 278.8 us for 16,384 tokens against the
kernel's 39.8 (FP8: 176.5 against 40.0); up to 256 tokens XLA's scatters are about as fast
(one token: 10.4 against 16.2 us; 256 within 4 us either way), so steps of up to
``SCATTER_MAX_TOKENS`` keep them (``pallas_kernels.get_kv_write_fn``; docs/performance.md,
"The KV write"). Here one program takes ``block_tokens`` tokens of one KV head: it loads their
K and V rows, quantizes them for an FP8 pool (``kv_quant``'s rule: one scale a row,
``max|x| / 448``), and stores each row at its slot. The pools are the kernel's inputs and
outputs at once (aliased), so only the rows written move; donate them to the step.

Padding tokens' slots point into the null page (page 0, never read), where their rows may land
in any order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import kv_quant
from pallas_kernels.kv_quant import QuantizedPages

# The most tokens a step writes with XLA's scatters instead (measured above).
SCATTER_MAX_TOKENS = 256
# Tokens a program writes: enough rows to keep the stores wide, few enough that a decode
# step's handful of tokens still spreads over many programs.
MAX_BLOCK_TOKENS = 16


def block_tokens(num_tokens: int) -> int:
    """The largest power of two <= MAX_BLOCK_TOKENS that divides ``num_tokens`` (the token
    buckets are multiples of 16; any count works, an odd one a token a program)."""
    return min(MAX_BLOCK_TOKENS, num_tokens & -num_tokens)


def _kernel(slot_ref, k_ref, v_ref, *refs, quantized: bool):
    # refs: the aliased pools (inputs, unread), then the same pools as outputs.
    outs = refs[len(refs) // 2:]
    slots = slot_ref[...]
    for x_ref, n in ((k_ref, 0), (v_ref, 1)):
        x = x_ref[...]  # [block_tokens, D]
        if quantized:
            values_ref, scales_ref = outs[2 * n], outs[2 * n + 1]
            values, scales = kv_quant.quantize(x)
            values_ref[slots] = kv_quant.to_storage(values)
            scales_ref[slots] = scales
        else:
            pool_ref = outs[n]
            pool_ref[slots] = x.astype(pool_ref.dtype)


def write_kv(k_pages, v_pages, k: jax.Array, v: jax.Array, slot_mapping: jax.Array, *,
             interpret: bool = False):
    """``llama.write_kv``'s contract for one layer's pools, as one Pallas kernel.

    Args:
      k_pages, v_pages: [KV, num_pages, page_size, D] arrays, or FP8 pools
        (``kv_quant.QuantizedPages``: uint8 values, float32 scales [KV, num_pages, page_size]);
        D a power of two (``pallas_kernels.pool_head_dim``). Donated: updated in place.
      k, v: [T, KV, D] this step's keys and values.
      slot_mapping: [T] int32 slots, page * page_size + offset (padding: the null page).
      interpret: run the kernel in Pallas's interpreter (tests off a GPU).

    Returns:
      The updated (k_pages, v_pages), of the pools' types and shapes.
    """
    quantized = isinstance(k_pages, QuantizedPages)
    num_tokens, num_kv_heads, head_dim = k.shape
    kv, num_pages, page_size, _ = k_pages.shape
    rows = num_pages * page_size
    if quantized:
        pools = [k_pages.values, k_pages.scales, v_pages.values, v_pages.scales]
    else:
        pools = [k_pages, v_pages]
    # [KV, rows, D] values and [KV, rows] scales: free reshapes of the pools.
    flat = [p.reshape(kv, rows, *p.shape[3:]) for p in pools]
    bt = block_tokens(num_tokens)
    token_spec = pl.BlockSpec((bt, None, head_dim), lambda i, h: (i, h, 0))
    pool_specs = [pl.BlockSpec((None, *p.shape[1:]), lambda i, h, n=p.ndim: (h,) + (0,) * (n - 1))
                  for p in flat]
    first_pool = 3  # the operands: slots, k, v, then the pools
    out = pl.pallas_call(
        functools.partial(_kernel, quantized=quantized),
        grid=(num_tokens // bt, num_kv_heads),
        in_specs=[pl.BlockSpec((bt,), lambda i, h: (i,)), token_spec, token_spec, *pool_specs],
        out_specs=pool_specs,
        out_shape=[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in flat],
        input_output_aliases={first_pool + n: n for n in range(len(flat))},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name=f"jaxserve_kv_write_bt{bt}",
    )(slot_mapping.astype(jnp.int32), k, v, *flat)
    out = [o.reshape(p.shape) for o, p in zip(out, pools)]
    if quantized:
        return QuantizedPages(out[0], out[1]), QuantizedPages(out[2], out[3])
    return out[0], out[1]
