"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) in Flax NNX over a paged KV pool.

Source: HF transformers' modeling_llama / modeling_qwen2 / modeling_qwen3 (pre-norm RMSNorm,
rotate-half RoPE, SwiGLU MLP, grouped-query attention).

Parameters are ``nnx.Param`` arrays with a leading layer axis, so one layer function serves a
rolled ``lax.scan`` (CPU: fast to compile) and a fully unrolled loop (GPU: DESIGN.md section 3
measured 1.2 TB/s weight streaming rolled vs 3.0 TB/s unrolled). Q/K/V and gate/up projections
are fused into one matmul each. The KV pool ``[num_layers, KV, num_pages, page_size, D]`` rides
in the scan carry and is updated in place with a scatter at ``slot_mapping``; it is never a
scan input or output.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig


@dataclass(frozen=True)
class AttentionMetadata:
    """One flattened ragged batch, padded to buckets (DESIGN.md section 3).

    Attributes:
      positions: [T] int32 position of each token in its sequence.
      slot_mapping: [T] int32 page * page_size + offset of each token's K/V (page 0 = padding).
      query_start_loc: [S + 1] int32 first token row of each sequence.
      seq_lens: [S] int32 context length after this step, tokens.
      block_tables: [S, P] int32 page ids.
    """

    positions: jax.Array
    slot_mapping: jax.Array
    query_start_loc: jax.Array
    seq_lens: jax.Array
    block_tables: jax.Array


jax.tree_util.register_dataclass(
    AttentionMetadata,
    data_fields=["positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables"],
    meta_fields=[],
)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies, with Llama-3 ("llama3") or linear scaling.

    Raises:
      ValueError: for a rope_scaling type other than llama3 or linear.
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq.astype(np.float32)
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = scaling["factor"]
    if kind == "linear":
        return (inv_freq / factor).astype(np.float32)
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear)")
    # Llama 3.1's frequency-dependent scaling (transformers' _compute_llama3_parameters).
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def _apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, N, D]; cos, sin [T, D // 2] float32. Rotate-half layout, as HF Llama."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


class LlamaForCausalLM(nnx.Module):
    """Weights of a Llama-family model; ``forward`` runs one ragged batch over the KV pool.

    Parameter shapes (L layers, E hidden, H/KV heads, D head_dim, I intermediate, V vocab):
      embed_tokens [V, E]; lm_head [V, E] (absent when tied); norm [E];
      input_layernorm, post_attention_layernorm [L, E]; qkv_proj [L, E, (H + 2 KV) D];
      qkv_bias [L, (H + 2 KV) D] (Qwen2); q_norm, k_norm [L, D] (Qwen3); o_proj [L, H D, E];
      gate_up_proj [L, E, 2 I]; down_proj [L, I, E].
    """

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = config
        self.config = c
        L, E, D, I = c.num_layers, c.hidden_size, c.head_dim, c.intermediate_size
        qkv = (c.num_heads + 2 * c.num_kv_heads) * D

        def normal(*shape):
            return nnx.Param(0.02 * jax.random.normal(rngs.params(), shape, dtype))

        def ones(*shape):
            return nnx.Param(jnp.ones(shape, dtype))

        self.embed_tokens = normal(c.vocab_size, E)
        if not c.tie_word_embeddings:
            self.lm_head = normal(c.vocab_size, E)
        self.norm = ones(E)
        self.input_layernorm = ones(L, E)
        self.post_attention_layernorm = ones(L, E)
        self.qkv_proj = normal(L, E, qkv)
        if c.attention_bias:
            self.qkv_bias = nnx.Param(jnp.zeros((L, qkv), dtype))
        if c.qk_norm:
            self.q_norm = ones(L, D)
            self.k_norm = ones(L, D)
        self.o_proj = normal(L, c.num_heads * D, E)
        self.gate_up_proj = normal(L, E, 2 * I)
        self.down_proj = normal(L, I, E)


LAYER_PARAMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "qkv_proj",
    "qkv_bias",
    "q_norm",
    "k_norm",
    "o_proj",
    "gate_up_proj",
    "down_proj",
)


def forward(
    config: ModelConfig,
    params: dict,
    token_ids: jax.Array,
    md: AttentionMetadata,
    k_cache: jax.Array,
    v_cache: jax.Array,
    logits_indices: jax.Array,
    *,
    attention_fn: Callable,
    unroll: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One model step over a flattened ragged batch.

    Args:
      config: the model's shapes.
      params: pure dict of the model's parameters (``nnx.split`` state as a pure dict).
      token_ids: [T] int32 input tokens; ids past the embedding's vocabulary read row 0.
      md: positions, slot mapping and sequence layout of this batch.
      k_cache, v_cache: [L, KV, num_pages, page_size, D] the KV pool (donate it).
      logits_indices: [S] int32 rows whose logits are returned.
      attention_fn: ``attention(q, k_pages, v_pages, query_start_loc, seq_lens, block_tables)``
        from pallas_kernels (reference or Pallas).
      unroll: unroll the layer loop (GPU) instead of a rolled scan (CPU).

    Returns:
      (logits [S, V] float32, k_cache, v_cache updated in place).
    """
    c = config
    H, KV, D = c.num_heads, c.num_kv_heads, c.head_dim
    num_tokens = token_ids.shape[0]
    inv_freq = jnp.asarray(rope_inv_freq(c))
    angles = md.positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    page_size = k_cache.shape[3]
    pages, offsets = md.slot_mapping // page_size, md.slot_mapping % page_size

    embed = params["embed_tokens"]
    ids = jnp.where(token_ids < embed.shape[0], token_ids, 0)
    hidden = embed[ids]
    layer_params = {k: params[k] for k in LAYER_PARAMS if k in params}

    def layer(carry, xs):
        hidden, k_cache, v_cache = carry
        p, idx = xs
        x = _rms_norm(hidden, p["input_layernorm"], c.rms_norm_eps)
        qkv = x @ p["qkv_proj"]
        if "qkv_bias" in p:
            qkv = qkv + p["qkv_bias"]
        q = qkv[:, : H * D].reshape(num_tokens, H, D)
        k = qkv[:, H * D : (H + KV) * D].reshape(num_tokens, KV, D)
        v = qkv[:, (H + KV) * D :].reshape(num_tokens, KV, D)
        if "q_norm" in p:
            q = _rms_norm(q, p["q_norm"], c.rms_norm_eps)
            k = _rms_norm(k, p["k_norm"], c.rms_norm_eps)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        # The scalar layer index and the slot arrays are split by a slice, so numpy indexing
        # rules put the token axis first: the update is [T, KV, D], as k and v already are.
        k_cache = k_cache.at[idx, :, pages, offsets].set(k.astype(k_cache.dtype))
        v_cache = v_cache.at[idx, :, pages, offsets].set(v.astype(v_cache.dtype))
        attn = attention_fn(
            q, k_cache[idx], v_cache[idx], md.query_start_loc, md.seq_lens, md.block_tables
        )
        hidden = hidden + attn.reshape(num_tokens, H * D) @ p["o_proj"]
        x = _rms_norm(hidden, p["post_attention_layernorm"], c.rms_norm_eps)
        gate, up = jnp.split(x @ p["gate_up_proj"], 2, axis=-1)
        hidden = hidden + (jax.nn.silu(gate) * up) @ p["down_proj"]
        return (hidden, k_cache, v_cache), None

    xs = (layer_params, jnp.arange(c.num_layers))
    (hidden, k_cache, v_cache), _ = jax.lax.scan(
        layer, (hidden, k_cache, v_cache), xs, unroll=c.num_layers if unroll else 1
    )
    hidden = _rms_norm(hidden[logits_indices], params["norm"], c.rms_norm_eps)
    lm_head = params.get("lm_head", embed)
    logits = jnp.einsum("se,ve->sv", hidden, lm_head, preferred_element_type=jnp.float32)
    return logits, k_cache, v_cache


def params_from_hf(config: ModelConfig, weights: dict[str, np.ndarray], dtype) -> dict:
    """HF-named tensors (torch layouts, Linear weight [out, in]) -> this model's pure params dict.

    Raises:
      ValueError: naming the first missing tensor.
    """
    c = config

    def get(name):
        if name not in weights:
            raise ValueError(f"checkpoint lacks tensor {name!r}")
        return np.asarray(weights[name], dtype=np.float32)

    def per_layer(fmt, transpose=False):
        arrays = [get(fmt.format(i)) for i in range(c.num_layers)]
        return np.stack([a.T if transpose else a for a in arrays])

    attn = "model.layers.{}.self_attn."
    params = {
        "embed_tokens": get("model.embed_tokens.weight"),
        "norm": get("model.norm.weight"),
        "input_layernorm": per_layer("model.layers.{}.input_layernorm.weight"),
        "post_attention_layernorm": per_layer("model.layers.{}.post_attention_layernorm.weight"),
        "qkv_proj": np.concatenate(
            [per_layer(attn + f"{n}_proj.weight", transpose=True) for n in "qkv"], axis=-1
        ),
        "o_proj": per_layer(attn + "o_proj.weight", transpose=True),
        "gate_up_proj": np.concatenate(
            [per_layer(f"model.layers.{{}}.mlp.{n}_proj.weight", transpose=True) for n in ("gate", "up")],
            axis=-1,
        ),
        "down_proj": per_layer("model.layers.{}.mlp.down_proj.weight", transpose=True),
    }
    if not c.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight")
    if c.attention_bias:
        params["qkv_bias"] = np.concatenate(
            [per_layer(attn + f"{n}_proj.bias") for n in "qkv"], axis=-1
        )
    if c.qk_norm:
        params["q_norm"] = per_layer(attn + "q_norm.weight")
        params["k_norm"] = per_layer(attn + "k_norm.weight")
    return {k: jnp.asarray(v, dtype=dtype) for k, v in params.items()}
