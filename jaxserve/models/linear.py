"""Linear projections and the weight formats they take (``linear``): a plain weight in the model's
dtype, or FP8 (W8A8: ``--quantization fp8``, or an FP8 checkpoint, ``fp8_checkpoint``); a plain
weight may carry LoRA adapters beside it (``jaxserve.lora.layers.LoRALinear``).

A plain weight is ``[in, out]`` and the projection is ``x @ w``. An FP8 weight (``Fp8Weight``)
is ``[out, in]`` float8_e4m3fn with one float32 scale per output channel (row); at run time the
activations are quantized to float8_e4m3fn, each token with a scale of its own (dynamic, per
token; its largest magnitude capped at ``input_scale_ub`` if set) or all with the weight's
static ``input_scale``, the two FP8 operands meet in one ``dot_general`` that accumulates in
float32 (on Hopper, XLA runs it as a cuBLASLt FP8 GEMM; the ``[out, in]`` layout is the one that
GEMM reads without a transpose) and writes the product in the activations' dtype when that is
bfloat16 (else float32), and the product is scaled back by the activations' and the channel's
scales.

Source: the e4m3 format (Micikevicius et al. 2022, "FP8 Formats for Deep Learning": largest
finite value 448, no infinities); vLLM's ``Fp8LinearMethod`` (dynamic quantization of a 16-bit
checkpoint at load, per-token activation scales). vLLM's online mode keeps one scale per weight
tensor; one per output channel is the more accurate choice (a channel of large weights no longer
coarsens every other channel's steps) and costs nothing in the GEMM's epilogue.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.lora.layers import LoRALinear, lora_delta

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
# The smallest scale: an all-zero row (or channel) quantizes to zeros, not to 0 / 0.
_MIN_SCALE = 1e-12


@dataclass(frozen=True)
class Fp8Weight:
    """A linear weight in FP8: ``w[in, out] ~= (weight * scale[:, None]).T``.

    Attributes:
      weight: [out, in] float8_e4m3fn.
      scale: [out] float32, one per output channel.
      input_scale: [] float32, the static scale of the activations (``x ~= x_q * input_scale``);
        None: dynamic, one scale per token.
      input_scale_ub: with dynamic scales, the largest token magnitude a scale covers (larger
        values saturate at +-448; fbgemm's ``activation_scale_ub``); None: no cap.
    """

    weight: jax.Array
    scale: jax.Array
    input_scale: jax.Array | None = None
    input_scale_ub: float | None = None


jax.tree_util.register_dataclass(Fp8Weight, data_fields=["weight", "scale", "input_scale"],
                                 meta_fields=["input_scale_ub"])


def _saturating_fp8(x: jax.Array) -> jax.Array:
    """x (already divided by its scale) to float8_e4m3fn, clipped to +-448 first: a value past
    the largest finite one would otherwise become NaN (the format has no infinity)."""
    return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def quantize_weight(w: jax.Array) -> Fp8Weight:
    """A plain ``[in, out]`` weight -> its ``Fp8Weight`` (per-output-channel scales: each
    channel's largest magnitude maps to 448)."""
    wt = w.astype(jnp.float32).T  # [out, in]
    scale = jnp.maximum(jnp.max(jnp.abs(wt), axis=1), _MIN_SCALE) / FP8_MAX
    return Fp8Weight(_saturating_fp8(wt / scale[:, None]), scale)


def quantize_rows(x: jax.Array, ub: float | None = None) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-token quantization: x [M, K] -> (x_q [M, K] float8_e4m3fn, scale [M]
    float32) with ``x ~= x_q * scale[:, None]``; each row's largest magnitude (capped at ``ub``
    if given) maps to 448."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    if ub is not None:
        amax = jnp.minimum(amax, ub)
    scale = jnp.maximum(amax, _MIN_SCALE) / FP8_MAX
    return _saturating_fp8(xf / scale[:, None]), scale


def _quantize_input(x: jax.Array, w: Fp8Weight) -> tuple[jax.Array, jax.Array]:
    """x [M, K] as ``w`` takes it: (x_q [M, K] float8_e4m3fn, scale [M] or [1] float32)."""
    if w.input_scale is None:
        return quantize_rows(x, w.input_scale_ub)
    scale = w.input_scale.reshape(1)
    return _saturating_fp8(x.astype(jnp.float32) / scale), scale


@dataclass(frozen=True)
class LayerSelect:
    """The weight of layer ``index`` inside a loop over layers (docs/architecture.md, "The
    layer loop"): every layer's weight stays an array of its own, and ``linear`` multiplies by
    the one chosen (``lax.switch``), reading it where it lies. A weight sliced out of a stacked
    ``[L, in, out]`` array is copied every layer (XLA's CPU dot takes no dynamic offset), which
    doubled a batch-1 decode step.

    Attributes:
      weights: L weights, each in a format ``linear`` takes.
      index: int32 scalar, the layer's position in ``weights``.
    """

    weights: tuple
    index: jax.Array


jax.tree_util.register_dataclass(LayerSelect, data_fields=["weights", "index"], meta_fields=[])


def linear(x: jax.Array, w, lora_slots: jax.Array | None = None) -> jax.Array:
    """x [M, in] times a weight of ``in -> out`` -> [M, out] in x's dtype.

    Args:
      x: activations [M, in].
      w: a plain ``[in, out]`` array (``x @ w``), an ``Fp8Weight``, or a ``LoRALinear`` (a
        plain weight plus each row's adapter delta, ``jaxserve.lora.layers``), or a
        ``LayerSelect`` of them.
      lora_slots: [M] int32, each row's adapter slot (0: none); read with a ``LoRALinear``.
    """
    if isinstance(w, LayerSelect):
        return jax.lax.switch(w.index, [lambda x, s, wi=wi: linear(x, wi, s) for wi in w.weights],
                              x, lora_slots)
    if isinstance(w, LoRALinear):
        return linear(x, w.base) + lora_delta(x, w.a, w.b, lora_slots)
    if not isinstance(w, Fp8Weight):
        return x @ w
    xq, xs = _quantize_input(x, w)
    # bfloat16 activations take the product in bfloat16 (float32 accumulation, rounded once):
    # half the bytes of a float32 product between the GEMM and the scaling, which XLA cannot
    # fold into cuBLASLt's FP8 GEMM (its scales are per tensor, ours per row and channel).
    product = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    y = jax.lax.dot_general(xq, w.weight, (((1,), (1,)), ((), ())),
                            preferred_element_type=product)
    return (y.astype(jnp.float32) * xs[:, None] * w.scale[None, :]).astype(x.dtype)


def quantize_linears(params: dict, names: tuple[str, ...]) -> dict:
    """``params`` with the weights under ``names`` as ``Fp8Weight``; the rest as they are."""
    return {k: quantize_weight(v) if k in names else v for k, v in params.items()}
