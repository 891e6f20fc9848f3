"""FP8 KV cache: the page pool in float8_e4m3fn with one float32 scale per token and KV head.

A stored key or value row ``x`` [D] (one token, one KV head) is kept as ``round(x / scale)`` in
float8_e4m3fn with ``scale = max|x| / 448`` (448 is e4m3fn's largest finite value), so every row
fits whatever its magnitude: no calibration, nothing to read from a checkpoint, and no value
can overflow (e4m3fn has no infinity; an unscaled value above 448 would become NaN). The cast
still clips, so rounding at the edge cannot overflow either. A row reads back as
``values * scale``; the kernels fold the scales into the scores (keys) and the probabilities
(values), so the dots run on the 8-bit values widened to bfloat16 and the KV read is about half
of bfloat16's (D bytes + 4 per row against 2 D).

Source: the OCP 8-bit floating point specification (E4M3: 4 exponent bits, 3 mantissa bits,
no infinities, max 448); per-token scaling as in KIVI / vLLM's per-token-head KV quantization.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448
# The dtype the kernels widen FP8 keys and values to for their dots (and cast queries to).
FP8_COMPUTE_DTYPE = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """One layer's K (or V) pool in FP8 with per-row scales; a pytree, passed where a plain
    ``[KV, num_pages, page_size, D]`` pool would be.

    Attributes:
      values: [KV, num_pages, page_size, D] float8_e4m3fn.
      scales: [KV, num_pages, page_size] float32; a row is ``values * scales[..., None]``.
    """

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes


jax.tree_util.register_dataclass(QuantizedPages, data_fields=["values", "scales"], meta_fields=[])


def zeros(shape: tuple[int, int, int, int]) -> QuantizedPages:
    """An empty pool of ``shape`` [KV, num_pages, page_size, D] (all rows read back as 0)."""
    return QuantizedPages(jnp.zeros(shape, FP8_DTYPE), jnp.zeros(shape[:-1], jnp.float32))


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows of ``x`` [..., D] -> (values [..., D] float8_e4m3fn, scales [...] float32).

    An all-zero row gets scale 1 (and zeros); non-finite inputs stay non-finite in the scale.
    """
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scales = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    values = jnp.clip(xf / scales[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return values, scales


def dequantize(values: jax.Array, scales: jax.Array) -> jax.Array:
    """(values [..., D] float8_e4m3fn, scales [...]) -> [..., D] float32."""
    return values.astype(jnp.float32) * scales[..., None]


def read_pages(pool, pages) -> jax.Array:
    """``pool[:, pages]`` in float32, dequantized if ``pool`` is QuantizedPages ([KV, *pages.shape,
    page_size, D])."""
    if isinstance(pool, QuantizedPages):
        return dequantize(pool.values[:, pages], pool.scales[:, pages])
    return pool[:, pages].astype(jnp.float32)


def compute_dtype(pool_dtype):
    """The dtype attention computes its dots in for a pool of ``pool_dtype``."""
    return FP8_COMPUTE_DTYPE if jnp.dtype(pool_dtype) == jnp.dtype(FP8_DTYPE) else pool_dtype
