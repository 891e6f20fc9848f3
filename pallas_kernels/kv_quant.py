"""FP8 KV cache: the page pool in float8_e4m3fn with one float32 scale per token and KV head.

A stored key or value row ``x`` [D] (one token, one KV head) is kept as ``round(x / scale)`` in
float8_e4m3fn with ``scale = max|x| / 448`` (448 is e4m3fn's largest finite value), so every row
fits whatever its magnitude: no calibration, nothing to read from a checkpoint, and no value
can overflow (e4m3fn has no infinity; an unscaled value above 448 would become NaN). The cast
still clips, so rounding at the edge cannot overflow either. A row reads back as
``values * scale``; the kernels fold the scales into the scores (keys) and the probabilities
(values), so the dots run on the 8-bit values widened to float16 and the KV read is about half
of bfloat16's (D bytes + 4 per row against 2 D). float16, not bfloat16: the H200 converts
e4m3 to float16 in one instruction (two values at a time) but to bfloat16 through float32,
which made the decode kernel slower than on a bfloat16 pool (docs/performance.md); every e4m3
value is exact in float16, and queries are clipped to float16's range on the way in. The pool stores the 8-bit patterns as uint8
(bitcast on the way in and out, free): XLA scatters float8 (and bfloat16) on the CPU by
converting the whole operand, i.e. copying the pool every write (~100 ms a layer at 2 GiB),
and uint8 in place. The kernels read a value tile as uint16 pairs of neighbouring columns
(``as_pairs``, ``widen_pairs``) and keep the even and the odd columns apart: a [tokens, D]
tile of bytes is the p @ V dot's second operand with its contracted axis strided, which Triton
loaded from shared memory one byte at a time (ncu on the H200: 4.2 M single-byte loads and 253
registers a thread in the decode kernel; docs/performance.md).

Source: the OCP 8-bit floating point specification (E4M3: 4 exponent bits, 3 mantissa bits,
no infinities, max 448); per-token scaling as in KIVI / vLLM's per-token-head KV quantization.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import pool_layer

FP8_DTYPE = jnp.float8_e4m3fn
STORAGE_DTYPE = jnp.uint8  # the pool holds FP8_DTYPE's bit patterns
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448
# The dtype the kernels widen FP8 keys and values to for their dots (and cast queries to).
FP8_COMPUTE_DTYPE = jnp.float16


@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """One layer's K (or V) pool in FP8 with per-row scales; a pytree, passed where a plain
    ``[KV, num_pages, page_size, D]`` pool would be.

    Attributes:
      values: [KV, num_pages, page_size, D] uint8, the bits of float8_e4m3fn values.
      scales: [KV, num_pages, page_size] float32; a row is ``values * scales[..., None]``.
    """

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        """The values' logical dtype, float8_e4m3fn."""
        return jnp.dtype(FP8_DTYPE)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes


jax.tree_util.register_dataclass(QuantizedPages, data_fields=["values", "scales"], meta_fields=[])


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) == jnp.dtype(FP8_DTYPE)


def zeros(shape: tuple[int, int, int, int]) -> QuantizedPages:
    """An empty FP8 pool of ``shape`` [KV, num_pages, page_size, D] (rows read back as 0)."""
    return QuantizedPages(jnp.zeros(shape, STORAGE_DTYPE), jnp.zeros(shape[:-1], jnp.float32))


def pool_zeros(shape: tuple[int, int, int, int], dtype, sharding=None):
    """An empty pool of ``shape`` in ``dtype`` (placed with ``sharding``, default: the default
    device): a QuantizedPages for FP8, else an array."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding),
                        pool_struct(shape, dtype, sharding))


def pool_struct(shape: tuple[int, int, int, int], dtype, sharding=None):
    """``pool_zeros``'s shapes, dtypes and sharding only (ShapeDtypeStructs, for lowering)."""
    s = jax.ShapeDtypeStruct
    if is_fp8(dtype):
        return QuantizedPages(s(shape, STORAGE_DTYPE, sharding=sharding),
                              s(shape[:-1], jnp.float32, sharding=sharding))
    return s(shape, dtype, sharding=sharding)


def scale_bytes(dtype) -> int:
    """Bytes of scale each stored row (token, KV head) carries in a pool of ``dtype``."""
    return 4 if is_fp8(dtype) else 0


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows of ``x`` [..., D] -> (values [..., D] float8_e4m3fn, scales [...] float32).

    An all-zero row gets scale 1 (and zeros); non-finite inputs stay non-finite in the scale.
    """
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scales = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    values = jnp.clip(xf / scales[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return values, scales


def to_storage(values: jax.Array) -> jax.Array:
    """float8_e4m3fn values -> their uint8 bit patterns (the pool's storage)."""
    return jax.lax.bitcast_convert_type(values, STORAGE_DTYPE)


def from_storage(values: jax.Array) -> jax.Array:
    """The pool's uint8 bit patterns -> float8_e4m3fn (values already in FP8 pass through)."""
    if values.dtype == jnp.dtype(STORAGE_DTYPE):
        return jax.lax.bitcast_convert_type(values, FP8_DTYPE)
    return values


def quantize_pages(x: jax.Array) -> QuantizedPages:
    """A whole pool [KV, num_pages, page_size, D] quantized row by row."""
    values, scales = quantize(x)
    return QuantizedPages(to_storage(values), scales)


def as_pairs(values: jax.Array) -> jax.Array:
    """The pool's uint8 bits [..., D] viewed as uint16 [..., D / 2]: element j holds columns
    2j (low byte) and 2j + 1 (high byte). A reshape and a bitcast, no copy."""
    return jax.lax.bitcast_convert_type(values.reshape(*values.shape[:-1], -1, 2), jnp.uint16)


def widen_pairs(pairs: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """uint16 pairs [..., D / 2] (``as_pairs``) -> (even columns, odd columns), each
    [..., D / 2] in dtype."""
    low, high = (pairs & 0xFF).astype(STORAGE_DTYPE), (pairs >> 8).astype(STORAGE_DTYPE)
    return from_storage(low).astype(dtype), from_storage(high).astype(dtype)


def dequantize(values: jax.Array, scales: jax.Array) -> jax.Array:
    """(values [..., D] float8_e4m3fn or the pool's uint8 bits, scales [...]) -> [..., D]
    float32."""
    return from_storage(values).astype(jnp.float32) * scales[..., None]


def read_pages(pool, pages) -> jax.Array:
    """``pool[:, pages]`` in float32, dequantized if ``pool`` is QuantizedPages ([KV, *pages.shape,
    page_size, D]); of a ``pool_layer.PoolLayer``, gathered from its layer in place."""
    pool, lead = pool_layer.split(pool)
    index = (*lead, slice(None), pages)
    if isinstance(pool, QuantizedPages):
        x = dequantize(pool.values[index], pool.scales[index])
    else:
        x = jnp.asarray(pool)[index].astype(jnp.float32)
    return jnp.moveaxis(x, pages.ndim, 0) if lead else x  # KV heads first


def compute_dtype(pool_dtype):
    """The dtype attention computes its dots in for a pool of ``pool_dtype``."""
    return FP8_COMPUTE_DTYPE if is_fp8(pool_dtype) else pool_dtype


def queries_for(q: jax.Array, pool_dtype) -> jax.Array:
    """``q`` cast to the dtype the kernels' dots use with a pool of ``pool_dtype``; for an FP8
    pool clipped to float16's finite range first (a bfloat16 query can exceed it)."""
    dtype = compute_dtype(pool_dtype)
    if dtype == q.dtype:
        return q
    if is_fp8(pool_dtype):
        big = float(jnp.finfo(dtype).max)
        q = jnp.clip(q, -big, big)
    return q.astype(dtype)
