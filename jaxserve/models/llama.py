"""The decoder every family runs (``jaxserve.models.families``: Llama 2/3, Mistral, the Qwen
families, Gemma 2/3, Phi-3, and the mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE):
plain functions over a params dict and a paged KV pool, with the options a family's config sets
(``ModelConfig``).

Source: HF transformers' modeling_llama / modeling_qwen2 / modeling_qwen3 / modeling_gemma2 /
modeling_gemma3 / modeling_phi3 (pre-norm RMSNorm, rotate-half RoPE, gated MLP, grouped-query
attention; Gemma's norms around both blocks and soft caps); the MoE families' sparse MLP blocks
are ``jaxserve.models.moe``.

Params: ``{"embed_tokens", "norm", "lm_head" (absent when tied), "layers": [one dict per
layer]}`` of device arrays (shapes: ``_layer_from_hf``), built once, one layer at a time, in the
target dtype: from HF tensors (``params_from_hf``) or random on the device (``random_params``).
Q/K/V and gate/up projections are fused into one matmul each. The KV pool is one donated
``[KV, num_pages, page_size, D]`` array per layer, and the step loops over the layers in Python
(the GPU); or one ``[L, KV, num_pages, page_size, D]`` array, and the layers run as a loop
indexing it in place (the CPU; ``forward``). Either is written in place at ``slot_mapping``
(``write_kv``). Given a tensor-parallel mesh, the same
functions build the params split in the Megatron layout and run the step as one SPMD program,
the KV write and attention per device (``jaxserve.models.sharding``, docs/parallelism.md).
"""

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial, reduce

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import pallas_kernels
from jaxserve.config import ModelConfig
from jaxserve.models import fp8_checkpoint, moe, sharding
from jaxserve.models.families import ARCHITECTURES
from jaxserve.models.linear import Fp8Weight, LayerSelect, linear, quantize_linears
from jaxserve.models.rope import rope_attention_factor, rope_inv_freq
from pallas_kernels import kv_quant, pool_layer


@dataclass(frozen=True)
class AttentionMetadata:
    """One flattened ragged batch, padded to buckets (docs/architecture.md, "Scheduler output ->
    model runner input").

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


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, unit_offset: bool = False) -> jax.Array:
    """RMSNorm over the last axis, as HF rounds it: Llama's ``weight * normed.to(dtype)``, or
    with ``unit_offset`` Gemma's ``(normed * (1 + weight)).to(dtype)`` in float32."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


@dataclass(frozen=True)
class LayerOptions:
    """What every decoder layer of a model computes alike (``ModelConfig``'s fields of one
    layer; a static argument of the jitted layer)."""

    num_heads: int
    head_dim: int
    eps: float
    hidden_act: str
    norm_unit_offset: bool
    sandwich_norms: bool
    attn_scale: float | None
    attn_logit_softcapping: float | None
    num_experts_per_tok: int
    norm_topk_prob: bool

    @classmethod
    def of(cls, c: ModelConfig) -> "LayerOptions":
        return cls(c.num_heads, c.head_dim, c.rms_norm_eps, c.hidden_act, c.norm_unit_offset,
                   c.sandwich_norms, c.attn_scale, c.attn_logit_softcapping,
                   c.num_experts_per_tok, c.norm_topk_prob)


def _apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, N, D]; cos, sin [T, R // 2] float32, R <= D the rotated features (the rest pass
    through: partial rotary). Rotate-half layout, as HF Llama."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half : 2 * half].astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
    return jnp.concatenate([rotated, x[..., 2 * half :]], axis=-1)


def write_kv(k_pages, v_pages, k: jax.Array, v: jax.Array, slot_mapping: jax.Array):
    """Scatter this step's keys and values into their slots of the page pool (XLA scatter).

    Args:
      k_pages, v_pages: [KV, num_pages, page_size, D] arrays, or FP8 pools
        (``pallas_kernels.kv_quant.QuantizedPages``, each row quantized with its own scale), or
        a layer of stacked pools (``pallas_kernels.pool_layer.PoolLayer``, written at
        ``[layer, ...]``); donate them to update in place.
      k, v: [T, KV, D] new keys and values.
      slot_mapping: [T] int32, page * page_size + offset; padding tokens point into page 0.

    Returns:
      The updated (k_pages, v_pages).
    """
    slot_mapping = jnp.asarray(slot_mapping)
    page_size = k_pages.shape[2]
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size

    def write(pool, x):
        storage, lead = pool_layer.split(pool)
        index = (*lead, slice(None), pages, offsets)
        if not lead:  # the advanced indices stand together: their axis stays in place
            x = x.transpose(1, 0, 2)  # [KV, T, D]
        if isinstance(storage, kv_quant.QuantizedPages):
            values, scales = kv_quant.quantize(x)
            storage = kv_quant.QuantizedPages(
                storage.values.at[index].set(kv_quant.to_storage(values)),
                storage.scales.at[index].set(scales))
        else:
            storage = jnp.asarray(storage)
            storage = storage.at[index].set(x.astype(storage.dtype))
        return pool_layer.PoolLayer(storage, *lead) if lead else storage

    return write(k_pages, k), write(v_pages, v)


def _write_and_attend(attention_fn: Callable, q, k, v, k_pages, v_pages, md: AttentionMetadata):
    """This step's K/V into the pool (the write that goes with ``attention_fn``:
    ``pallas_kernels.get_kv_write_fn``), then attention: (out [T, H, D], k_pages, v_pages). A pool
    wider than the heads (``pallas_kernels.pool_head_dim``) takes q, k and v padded with zero
    features, and the output's padding is dropped."""
    head_dim, width = q.shape[-1], k_pages.shape[-1]
    if width > head_dim:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, width - head_dim))) for x in (q, k, v))
    write = pallas_kernels.get_kv_write_fn(attention_fn, k.shape[0]) or write_kv
    k_pages, v_pages = write(k_pages, v_pages, k, v, md.slot_mapping)
    out = attention_fn(q, k_pages, v_pages, md.query_start_loc, md.seq_lens, md.block_tables)
    return out[..., :head_dim], k_pages, v_pages


@partial(jax.jit, static_argnames=("opts", "attention_fn", "mesh", "sliding_window",
                                   "grouped_gemm"))
def _decoder_layer(hidden: jax.Array, p: dict, k_pages: jax.Array, v_pages: jax.Array,
                   cos: jax.Array, sin: jax.Array, md: AttentionMetadata,
                   lora_slots: jax.Array | None = None, *, opts: LayerOptions,
                   attention_fn: Callable, mesh: Mesh | None, sliding_window: int | None = None,
                   grouped_gemm: Callable = jax.lax.ragged_dot):
    """One decoder layer: hidden [T, E] -> (hidden, k_pages, v_pages with this step's K/V).

    A jitted function of its own so that the step traces and lowers one layer, not L: every
    layer has the same shapes, so JAX reuses the layer's trace and its lowered function, and
    XLA inlines the calls (same program, far less start-up time; docs/architecture.md, "The layer
    loop").
    With a mesh, the fused projections hold their columns shard by shard (``sharding``), and
    the KV write and attention run per shard. A layer with a ``sliding_window`` attends to
    that many keys at most (``ModelConfig.layer_windows``). A layer whose params hold a
    ``router`` runs the MoE block (``moe.sparse_mlp``, its expert GEMMs ``grouped_gemm``) instead
    of the dense MLP. With
    ``opts.sandwich_norms`` (Gemma) the attention's and the MLP's outputs are normed before
    they join the residual, and ``pre_feedforward_layernorm`` norms the MLP's input.
    Projections with LoRA adapters add each token's delta (``lora_slots``, ``linear``).
    An EAGLE head's layers (``jaxserve.spec_decode.eagle``): without ``input_layernorm``
    (EAGLE-1's first) the input is not normed; with ``hidden_norm`` (EAGLE-3's) ``hidden`` is
    [T, 2E], the token's embedding then the hidden state: q/k/v read both normed, the hidden
    state is the residual.
    """
    n = sharding.mesh_size(mesh)
    H, KV = opts.num_heads, k_pages.shape[0]  # the pool's KV heads (replicated past the model's)
    num_tokens, D = hidden.shape[0], opts.head_dim
    norm = partial(rms_norm, eps=opts.eps, unit_offset=opts.norm_unit_offset)
    if "hidden_norm" in p:  # EAGLE-3's layer: [embedding | hidden], the hidden the residual
        embeds, hidden = jnp.split(hidden, 2, axis=-1)
        x = jnp.concatenate([norm(embeds, p["input_layernorm"]), norm(hidden, p["hidden_norm"])],
                            axis=-1)
    elif "input_layernorm" in p:
        x = norm(hidden, p["input_layernorm"])
    else:  # EAGLE-1's first layer has no input norm
        x = hidden
    qkv = linear(x, p["qkv_proj"], lora_slots)
    if "qkv_bias" in p:
        qkv = qkv + p["qkv_bias"]
    # Columns shard by shard: [q heads | k heads | v heads] of each of the n shards.
    qkv = qkv.reshape(num_tokens, n, -1)
    hq, hk = H // n * D, KV // n * D
    q = qkv[..., :hq].reshape(num_tokens, H, D)
    k = qkv[..., hq : hq + hk].reshape(num_tokens, KV, D)
    v = qkv[..., hq + hk :].reshape(num_tokens, KV, D)
    if "q_norm" in p:
        q, k = norm(q, p["q_norm"]), norm(k, p["k_norm"])
    q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
    attend = partial(_write_and_attend, partial(
        attention_fn, sliding_window=sliding_window,
        sm_scale=D ** -0.5 if opts.attn_scale is None else opts.attn_scale,
        logits_soft_cap=opts.attn_logit_softcapping))
    if mesh is not None:
        attend = sharding.per_shard_attention(attend, mesh)
    attn, k_pages, v_pages = attend(q, k, v, k_pages, v_pages, md)
    attn = linear(attn.reshape(num_tokens, H * D), p["o_proj"], lora_slots)
    if "o_bias" in p:
        attn = attn + p["o_bias"]
    if opts.sandwich_norms:
        hidden = hidden + norm(attn, p["post_attention_layernorm"])
        x = norm(hidden, p["pre_feedforward_layernorm"])
    else:
        hidden = hidden + attn
        x = norm(hidden, p["post_attention_layernorm"])
    if "router" in p:
        mlp = moe.sparse_mlp(x, p, opts.num_experts_per_tok, opts.norm_topk_prob, n,
                             opts.hidden_act, grouped_gemm, mesh)
    else:
        gate_up = linear(x, p["gate_up_proj"], lora_slots)  # [gate | up] per shard
        mlp = linear(moe.gated_act(gate_up, n, opts.hidden_act), p["down_proj"], lora_slots)
    if opts.sandwich_norms:
        mlp = norm(mlp, p["post_feedforward_layernorm"])
    return hidden + mlp, k_pages, v_pages


def matmul_precision(dtype):
    """The context a step of ``dtype`` weights is traced under: float32 weights multiply in
    float32 (XLA's and Triton's GPU dots otherwise round float32 operands to TF32's 10-bit
    mantissa, which moves logits by ~1e-3 and parts greedy outputs from HF's float32); 16-bit
    weights keep the default. On the CPU float32 dots are float32 either way."""
    if jnp.dtype(dtype) == jnp.float32:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def forward(
    config: ModelConfig,
    params: dict,
    token_ids: jax.Array,
    md: AttentionMetadata,
    k_cache,
    v_cache,
    logits_indices: jax.Array,
    *,
    attention_fn: Callable,
    mesh: Mesh | None = None,
    hidden_indices: jax.Array | None = None,
    lora_slots: jax.Array | None = None,
    aux_layers: tuple[int, ...] | None = None,
    grouped_gemm: Callable = jax.lax.ragged_dot,
):
    """One model step over a flattened ragged batch.

    The pool's layout picks how the layers run (docs/architecture.md, "The layer loop"): with a
    pool per layer, a Python loop over them, unrolled (on the H200, stacked weights streamed
    through a rolled ``lax.scan`` at 1.2 TB/s against 3.0 TB/s unrolled); with a pool stacked by
    layer, a ``fori_loop`` over each run of alike layers (``_layer_loop``), so that the program
    holds one layer's kernels, not L (the CPU's host memory and compile time).

    Args:
      config: the model's shapes.
      params: the params dict (module docstring), ``params["layers"]`` one dict per layer.
      token_ids: [T] int32 input tokens; ids past the embedding's vocabulary read row 0.
      md: positions, slot mapping and sequence layout of this batch.
      k_cache, v_cache: the KV pool (donate it): lists of L arrays [KV, num_pages, page_size,
        D], or arrays [L, KV, num_pages, page_size, D] stacked by layer (FP8: QuantizedPages).
      logits_indices: [S] int32 rows whose logits are returned.
      attention_fn: ``attention(q, k_pages, v_pages, query_start_loc, seq_lens, block_tables)``
        from pallas_kernels (reference or Pallas).
      mesh: the tensor-parallel mesh the params and pool are split over (``sharding``), None
        for one device.
      hidden_indices: optional [R] int32 rows whose last hidden states (before the final norm)
        are returned too, for ``compute_logits`` later (prompt log-probabilities).
      lora_slots: [T] int32 each token's LoRA adapter slot (0: none), read by the projections
        that carry adapters (``jaxserve.lora.layers.LoRALinear``).
      aux_layers: the hidden states an EAGLE head reads (``jaxserve.spec_decode.eagle``):
        () the final norm's output [T, E] (EAGLE-1); layer ids (EAGLE-3) the inputs of those
        layers (the residual stream), concatenated in the order given, [T, len * E]; None:
        none.
      grouped_gemm: the MoE layers' expert GEMMs (``moe.get_grouped_gemm``; the engine's from
        ``Platform.moe_grouped_gemm``).

    Returns:
      (logits [S, V] float32 over the whole vocabulary, replicated on a mesh; k_cache, v_cache
      updated in place), plus the [R, E] hidden rows when hidden_indices is given, plus the
      head's hidden states when aux_layers is given.
    """
    with matmul_precision(params["embed_tokens"].dtype):
        return _forward(config, params, token_ids, md, k_cache, v_cache, logits_indices,
                        attention_fn, mesh, hidden_indices, lora_slots, aux_layers, grouped_gemm)


def rope_tables(c: ModelConfig, positions: jax.Array):
    """(cos, sin) [T, R // 2] float32 of ``positions`` under the model's RoPE, and those of its
    local (sliding-window) layers (Gemma 3's own theta; else the same)."""
    def cos_sin(theta: float, scaling: dict | None):
        inv_freq = jnp.asarray(rope_inv_freq(c.rotary_dim or c.head_dim, theta, scaling))
        angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        factor = rope_attention_factor(scaling)
        return (cos, sin) if factor == 1.0 else (cos * factor, sin * factor)

    rope = cos_sin(c.rope_theta, c.rope_scaling)
    return rope, rope if c.local_rope_theta is None else cos_sin(c.local_rope_theta, None)


def run_layers(c: ModelConfig, layers: list[dict], hidden, md: AttentionMetadata, k_cache: list,
               v_cache: list, attention_fn: Callable):
    """``layers`` in turn over ``hidden`` [T, E] with a pool per layer (one device): (hidden,
    k_cache, v_cache). An EAGLE head's layers (``jaxserve.spec_decode.eagle``) run so."""
    rope, _ = rope_tables(c, md.positions)
    opts = LayerOptions.of(c)
    k_cache, v_cache = list(k_cache), list(v_cache)
    for i, p in enumerate(layers):
        hidden, k_cache[i], v_cache[i] = _decoder_layer(
            hidden, p, k_cache[i], v_cache[i], *rope, md, opts=opts, attention_fn=attention_fn,
            mesh=None)
    return hidden, k_cache, v_cache


def _forward(c: ModelConfig, params, token_ids, md, k_cache, v_cache, logits_indices,
             attention_fn, mesh, hidden_indices, lora_slots, aux_layers, grouped_gemm):
    rope, local_rope = rope_tables(c, md.positions)
    opts = LayerOptions.of(c)

    embed = params["embed_tokens"]
    hidden = embed[jnp.where(token_ids < embed.shape[0], token_ids, 0)]
    if c.embed_scale != 1.0:  # HF multiplies by the scale rounded to the weights' dtype
        hidden = hidden * jnp.asarray(c.embed_scale, hidden.dtype)

    def layer(hidden, p, k_pages, v_pages, window):
        cos, sin = rope if window is None else local_rope
        return _decoder_layer(hidden, p, k_pages, v_pages, cos, sin, md, lora_slots, opts=opts,
                              attention_fn=attention_fn, mesh=mesh, sliding_window=window,
                              grouped_gemm=grouped_gemm)

    layers, aux = params["layers"], {}
    if isinstance(k_cache, list | tuple):  # a pool per layer: the layers unrolled
        k_cache, v_cache = list(k_cache), list(v_cache)
        for i, p in enumerate(layers):
            if aux_layers and i in aux_layers:
                aux[i] = hidden
            hidden, k_cache[i], v_cache[i] = layer(hidden, p, k_cache[i], v_cache[i],
                                                   _window(c, i))
    else:  # pools stacked by layer: a loop over each run of alike layers
        for start, stop in _runs(c, aux_layers or ()):
            if aux_layers and start in aux_layers:
                aux[start] = hidden
            hidden, k_cache, v_cache = _layer_loop(partial(layer, window=_window(c, start)),
                                                   layers, start, stop, hidden, k_cache, v_cache)

    out = (compute_logits(c, params, hidden[logits_indices], mesh), k_cache, v_cache)
    if hidden_indices is not None:
        out += (hidden[hidden_indices],)
    if aux_layers == ():  # EAGLE-1 reads the final norm's output
        out += (rms_norm(hidden, params["norm"], c.rms_norm_eps, c.norm_unit_offset),)
    elif aux_layers is not None:
        out += (jnp.concatenate([aux[i] for i in aux_layers], axis=-1),)
    return out


def _window(c: ModelConfig, i: int) -> int | None:
    """Layer i's sliding window (``ModelConfig.layer_windows``), None: full attention."""
    return c.layer_windows[i] if c.layer_windows else None


def _runs(c: ModelConfig, breaks: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """[start, stop) of each run of consecutive layers alike (same window, both dense or both
    MoE): one loop each; a run also starts at each layer of ``breaks`` (whose input hidden
    state the step returns)."""
    kind = lambda i: (_window(c, i), bool(c.sparse_layers and c.sparse_layers[i]))  # noqa: E731
    starts = [i for i in range(c.num_layers)
              if i == 0 or i in breaks or kind(i) != kind(i - 1)]
    return list(zip(starts, starts[1:] + [c.num_layers]))


def _layer_loop(layer: Callable, layers: list[dict], start: int, stop: int, hidden,
                k_cache, v_cache):
    """Layers [start, stop) as one ``fori_loop`` over pools stacked by layer ([L, KV,
    num_pages, page_size, D], the loop's carry, each layer's indexed in place:
    ``pool_layer.PoolLayer``): (hidden, k_cache, v_cache). MoE layers run unrolled instead:
    their expert weights would be sliced out of a stack, i.e. copied."""
    if "router" in layers[start]:
        for i in range(start, stop):
            hidden, k, v = layer(hidden, layers[i], pool_layer.PoolLayer(k_cache, i),
                                 pool_layer.PoolLayer(v_cache, i))
            k_cache, v_cache = k.pool, v.pool
        return hidden, k_cache, v_cache
    layer_of = _layer_of(layers[start:stop])

    def body(i, carry):
        hidden, k, v = layer(carry[0], layer_of(i - start), pool_layer.PoolLayer(carry[1], i),
                             pool_layer.PoolLayer(carry[2], i))
        return hidden, k.pool, v.pool

    return jax.lax.fori_loop(start, stop, body, (hidden, k_cache, v_cache))


def _layer_of(run: list[dict]) -> Callable[[jax.Array], dict]:
    """For a loop over the layers ``run``: index j (traced) -> layer j's params, its
    ``LINEARS`` as ``LayerSelect`` (read in place), the rest (norms, biases: a few KiB a
    layer) stacked here, before the loop, and indexed."""
    small = {name: jnp.stack([p[name] for p in run]) for name in run[0] if name not in LINEARS}
    big = {name: tuple(p[name] for p in run) for name in LINEARS}
    return lambda j: ({name: a[j] for name, a in small.items()}
                      | {name: LayerSelect(ws, j) for name, ws in big.items()})


def compute_logits(config: ModelConfig, params: dict, hidden: jax.Array,
                   mesh: Mesh | None = None) -> jax.Array:
    """The final norm and the LM head: last hidden states [N, E] -> logits [N, V] float32, over
    the whole vocabulary (gathered on a mesh), capped at C tanh(x / C) with the config's
    ``final_logit_softcapping`` C."""
    hidden = rms_norm(hidden, params["norm"], config.rms_norm_eps, config.norm_unit_offset)
    lm_head = params.get("lm_head", params["embed_tokens"])
    with matmul_precision(lm_head.dtype):
        logits = jnp.einsum("se,ve->sv", hidden, lm_head, preferred_element_type=jnp.float32)
    if mesh is not None:  # the sampler sees the whole vocabulary
        logits = sharding.gather_logits(logits, mesh)
    if lm_head.shape[0] != config.vocab_size:  # rows padded to a multiple of the mesh
        logits = logits[:, : config.vocab_size]
    cap = config.final_logit_softcapping
    return logits if cap is None else cap * jnp.tanh(logits / cap)


# HF names of the tensors outside the decoder layers -> param names (same layouts).
_OUTER_NAMES = {"model.embed_tokens.weight": "embed_tokens", "model.norm.weight": "norm",
            "lm_head.weight": "lm_head"}


def hf_tensor_shapes(config: ModelConfig, layer: int = 0) -> tuple[dict, dict]:
    """Shapes of the HF tensors the model reads, in torch layouts (Linear weight [out, in]).

    Returns:
      ({HF name: shape} outside the layers, {name under ``model.layers.N.``: shape} of layer
      ``layer``: its MLP block's as ``moe.hf_layer_shapes`` where the layer is sparse).
    """
    c = config
    E, D, I = c.hidden_size, c.head_dim, c.intermediate_size
    q, kv = c.num_heads * D, c.num_kv_heads * D
    outer = {"model.embed_tokens.weight": (c.vocab_size, E), "model.norm.weight": (E,)}
    if not c.tie_word_embeddings:
        outer["lm_head.weight"] = (c.vocab_size, E)
    shapes = {
        "input_layernorm.weight": (E,), "post_attention_layernorm.weight": (E,),
        "self_attn.q_proj.weight": (q, E), "self_attn.k_proj.weight": (kv, E),
        "self_attn.v_proj.weight": (kv, E), "self_attn.o_proj.weight": (E, q),
    }
    if c.sparse_layers and c.sparse_layers[layer]:
        shapes |= moe.hf_layer_shapes(c)
    else:
        shapes |= {"mlp.gate_proj.weight": (I, E), "mlp.up_proj.weight": (I, E),
                   "mlp.down_proj.weight": (E, I)}
    if c.attention_bias:
        shapes |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                   "self_attn.v_proj.bias": (kv,)}
    if c.o_proj_bias:
        shapes |= {"self_attn.o_proj.bias": (E,)}
    if c.qk_norm:
        shapes |= {"self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,)}
    if c.sandwich_norms:
        shapes |= {"pre_feedforward_layernorm.weight": (E,),
                   "post_feedforward_layernorm.weight": (E,)}
    return outer, shapes


def _place(t: dict, mesh: Mesh | None) -> dict:
    """HF tensors split as ``sharding.hf_sharding`` says: each of this process's devices gets
    its slice, read alone from a host array or a ``LazyTensor`` (``x[index]``), or moved from a
    device array; host arrays as they are without a mesh (a ``LazyTensor`` read whole)."""
    if mesh is None:
        return {name: w if isinstance(w, np.ndarray | jax.Array) else np.asarray(w)
                for name, w in t.items()}
    out = {}
    for name, w in t.items():
        where = sharding.hf_sharding(name, w.shape, mesh)
        out[name] = (jax.device_put(w, where) if isinstance(w, jax.Array) else
                     jax.make_array_from_callback(w.shape, where, lambda index, w=w: w[index]))
    return out


def _constrain(params: dict, mesh: Mesh | None) -> dict:
    """Built params laid out on the mesh as ``sharding.param_shardings`` says (in a jit)."""
    if mesh is None:
        return params
    return jax.lax.with_sharding_constraint(params, sharding.param_shardings(params, mesh))


def _columns_by_shard(blocks: list, n: int) -> jax.Array:
    """Concatenate column blocks ``[..., c_j]`` (each c_j a multiple of n) so that the columns run
    shard by shard: the first n-th of every block, then the second, ... An even split of the
    result over n devices gives device i its slice of each block; n = 1 is a plain
    concatenation."""
    lead = blocks[0].shape[:-1]
    return jnp.concatenate([w.reshape(*lead, n, -1) for w in blocks], axis=-1).reshape(*lead, -1)


def _repeat_kv_heads(w, layout: sharding.Layout):
    """HF k/v projection rows (or bias) ``[KV D, ...]``, or an ``Fp8Weight``'s rows and scales,
    -> ``[KV r D, ...]``: each KV head's rows r = ``layout.kv_replicas`` times in a row (vLLM
    replicates KV heads past the mesh size so)."""
    if layout.kv_replicas == 1:
        return w
    if isinstance(w, Fp8Weight):
        return dataclasses.replace(w, weight=_repeat_kv_heads(w.weight, layout),
                                   scale=_repeat_kv_heads(w.scale, layout))
    heads = w.reshape(layout.num_kv_heads // layout.kv_replicas, -1, *w.shape[1:])
    return jnp.repeat(heads, layout.kv_replicas, axis=0).reshape(-1, *w.shape[1:])


def _fuse(parts: list, n: int):
    """HF projections of one input (``[out_j, in]`` weights, or ``Fp8Weight``) -> one weight
    whose output channels run shard by shard (``_columns_by_shard``): ``[in, sum out_j]``, or an
    ``Fp8Weight`` of ``[sum out_j, in]`` with its scales in the same order and the largest of
    the parts' input scales (they quantize the same activations)."""
    if not isinstance(parts[0], Fp8Weight):
        return _columns_by_shard([w.T for w in parts], n)
    input_scale = (None if parts[0].input_scale is None else
                   reduce(jnp.maximum, [w.input_scale for w in parts]))
    return Fp8Weight(_columns_by_shard([w.weight.T for w in parts], n).T,
                     _columns_by_shard([w.scale for w in parts], n), input_scale,
                     parts[0].input_scale_ub)


@partial(jax.jit, static_argnames=("dtype", "layout", "mesh", "quantization"))
def _outer_from_hf(t: dict, dtype, layout: sharding.Layout, mesh: Mesh | None,
                   quantization: str | None = None) -> dict:
    """Embedding [V, E], final norm [E] and untied lm_head [V, E] (HF names) -> params in dtype,
    the vocabulary rows padded with zeros to ``layout.vocab_size``. They stay in dtype whatever
    the ``quantization`` (as vLLM keeps them)."""
    p = {}
    for name, w in t.items():
        if w.ndim == 2 and w.shape[0] < layout.vocab_size:
            w = jnp.pad(w, ((0, layout.vocab_size - w.shape[0]), (0, 0)))
        p[_OUTER_NAMES[name]] = w.astype(dtype)
    return _constrain(p, mesh)


def layer_params(t: dict, dtype, config: ModelConfig) -> dict:
    """One decoder layer's params on the one device from its HF tensors (names under
    ``model.layers.N.``; ``_layer_from_hf``): an EAGLE head's layers are built so."""
    return _layer_from_hf(_place(t, None), dtype, sharding.Layout.of(config, 1), None)


# The decoder layer's linear projections: the weights ``--quantization`` stores in its format.
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@partial(jax.jit, static_argnames=("dtype", "layout", "mesh", "quantization"))
def _layer_from_hf(t: dict, dtype, layout: sharding.Layout, mesh: Mesh | None,
                   quantization: "str | fp8_checkpoint.Fp8Checkpoint | None" = None) -> dict:
    """One decoder layer's HF tensors (names under ``model.layers.N.``) -> its params in dtype,
    split over ``mesh`` (``sharding``); the ``LINEARS`` as ``linear.Fp8Weight`` with
    ``quantization`` "fp8" (quantized from their values in dtype) or an
    ``fp8_checkpoint.Fp8Checkpoint`` (the checkpoint's FP8 values and scales as stored).

    Shapes (E hidden, H heads, KV the layout's KV heads, D head_dim, I intermediate, n the mesh
    size): input_layernorm, post_attention_layernorm [E]; qkv_proj [E, (H + 2 KV) D] and
    qkv_bias [(H + 2 KV) D] (Qwen2), columns [q | k | v] of each shard in turn; q_norm, k_norm
    [D] (Qwen3); o_proj [H D, E] and o_bias [E] (HF's attention_bias); gate_up_proj [E, 2 I], columns [gate | up] of each shard in
    turn; down_proj [I, E]. With n = 1: [q | k | v] and [gate | up]. An ``Fp8Weight`` holds the
    same channels as rows (``[out, in]``). A sparse layer (``moe.is_sparse``) holds the MoE
    block's params (``moe``) instead of gate_up_proj and down_proj.
    """
    n = layout.size
    if isinstance(quantization, fp8_checkpoint.Fp8Checkpoint):
        proj = partial(fp8_checkpoint.fp8_weight, quantization, t)
    else:
        proj = lambda name: t[name + ".weight"]  # noqa: E731
    qkv = lambda get: [get("q"), *(_repeat_kv_heads(get(x), layout) for x in "kv")]  # noqa: E731
    # Linear weights [out, in] become [in, out] (the step computes x @ w); FP8 ones stay.
    p = {
        "post_attention_layernorm": t["post_attention_layernorm.weight"],
        "qkv_proj": _fuse(qkv(lambda x: proj(f"self_attn.{x}_proj")), n),
        "o_proj": _fuse([proj("self_attn.o_proj")], n),
    }
    if moe.is_sparse(t):
        p |= moe.params_from_hf(t, _columns_by_shard, n)
    else:
        p |= {"gate_up_proj": _fuse([proj("mlp.gate_proj"), proj("mlp.up_proj")], n),
              "down_proj": _fuse([proj("mlp.down_proj")], n)}
    if "self_attn.q_proj.bias" in t:
        p["qkv_bias"] = _columns_by_shard(qkv(lambda x: t[f"self_attn.{x}_proj.bias"]), n)
    if "self_attn.o_proj.bias" in t:
        p["o_bias"] = t["self_attn.o_proj.bias"]
    if "self_attn.q_norm.weight" in t:
        p["q_norm"], p["k_norm"] = t["self_attn.q_norm.weight"], t["self_attn.k_norm.weight"]
    # input_layernorm: absent in EAGLE-1's first layer; hidden_norm: EAGLE-3's layer
    for name in ("input_layernorm", "hidden_norm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        if f"{name}.weight" in t:
            p[name] = t[f"{name}.weight"]
    p = {name: w if isinstance(w, Fp8Weight) else w.astype(dtype) for name, w in p.items()}
    if quantization == "fp8":
        p = quantize_linears(p, LINEARS)
    return _constrain(p, mesh)


def checked_weights(config: ModelConfig, weights: dict,
                    quantization: "str | fp8_checkpoint.Fp8Checkpoint | None" = None) -> dict:
    """``weights`` under Llama's names (the family's ``checkpoint_names``), checked against what
    ``config`` reads before any tensor is read (shapes and dtypes only): every tensor of
    ``hf_tensor_shapes`` there in its shape, and FP8 data as ``quantization`` says.

    Raises:
      ValueError: naming the first missing tensor or the first one of the wrong shape (or, of
        FP8 data, dtype: ``fp8_checkpoint.check_tensors``).
    """
    rename = ARCHITECTURES[config.architecture].checkpoint_names
    if rename is not None:
        weights = rename(config, weights)
    outer, layer = hf_tensor_shapes(config)
    fp8_checkpoint.check_tensors(weights, quantization, layer, config.num_layers)
    expected = [("", outer), *((f"model.layers.{i}.", hf_tensor_shapes(config, i)[1])
                               for i in range(config.num_layers))]
    for prefix, shapes in expected:
        for name, shape in shapes.items():
            w = weights.get(prefix + name)
            if w is None:
                raise ValueError(f"checkpoint lacks tensor {prefix + name!r}")
            if tuple(w.shape) != shape:
                raise ValueError(f"tensor {prefix + name} has shape {tuple(w.shape)}, expected {shape}")
    return weights


def params_from_hf(config: ModelConfig, weights: dict, dtype, mesh: Mesh | None = None,
                   quantization: "str | fp8_checkpoint.Fp8Checkpoint | None" = None) -> dict:
    """HF-named tensors (torch layouts; host arrays, or device arrays as orbax restores them) ->
    params of device arrays in ``dtype``, split over ``mesh`` (``sharding``) if given; the
    layers' linear projections in FP8 with ``quantization`` "fp8" or the checkpoint's
    ``fp8_checkpoint.Fp8Checkpoint`` (``_layer_from_hf``).

    Built one layer at a time, so a device holds at most its part of the params built so far
    plus one layer's tensors as read (in the checkpoint's dtype; on a mesh only its slice of
    each, but the whole of a tensor that does not split evenly) and as built. Values are those
    of the tensors cast to ``dtype`` (transposes, concatenations, padding and KV-head copies
    are exact); FP8 checkpoint values as stored.

    Raises:
      ValueError: as ``checked_weights`` (before anything is built), or a mesh size the model
        does not split into (``sharding.check_tensor_parallel``).
    """
    layout = sharding.Layout.of(config, sharding.mesh_size(mesh))
    weights = checked_weights(config, weights, quantization)

    def read(names, prefix: str = "") -> dict:
        return _place({name: weights[prefix + name] for name in names}, mesh)

    outer, layer = hf_tensor_shapes(config)
    scales = (tuple(fp8_checkpoint.scale_tensors(quantization, layer))
              if isinstance(quantization, fp8_checkpoint.Fp8Checkpoint) else ())
    # The embedding first: its two copies (as read, as built) then meet no layer on the device.
    params = _outer_from_hf(read(outer), dtype, layout, mesh)
    params["layers"] = [_layer_from_hf(read((*hf_tensor_shapes(config, i)[1], *scales),
                                            f"model.layers.{i}."), dtype, layout, mesh, quantization)
                        for i in range(config.num_layers)]
    return params


def random_params(config: ModelConfig, dtype, seed: int = 0, mesh: Mesh | None = None,
                  quantization: str | None = None) -> dict:
    """Random params of the model's shapes (``--load-format dummy``), drawn on the device(s) in
    ``dtype`` one layer at a time (nothing on the host, no float32 copy; on a mesh each device
    draws only its slice, the same values at every mesh size): the HF tensors are normal(0,
    0.02) (norm weights 1, biases 0), then built as ``params_from_hf`` builds them.

    Raises:
      ValueError: as ``sharding.check_tensor_parallel``.
    """
    layout = sharding.Layout.of(config, sharding.mesh_size(mesh))
    outer, _ = hf_tensor_shapes(config)
    keys = jax.random.split(jax.random.key(seed), config.num_layers + 1)
    params = _random_from_hf(keys[0], tuple(outer.items()), dtype, _outer_from_hf, layout, mesh)
    params["layers"] = [
        _random_from_hf(k, tuple(hf_tensor_shapes(config, i)[1].items()), dtype, _layer_from_hf,
                        layout, mesh, quantization)
        for i, k in enumerate(keys[1:])]
    return params


@partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def _random_from_hf(key, shapes: tuple, dtype, build: Callable, layout: sharding.Layout,
                    mesh: Mesh | None, quantization: str | None = None) -> dict:
    """``build`` (``_outer_from_hf`` or ``_layer_from_hf``) of random HF tensors of ``shapes``
    (((name, shape), ...)), in one executable. Tensors of one shape come from one draw (an MoE
    layer's experts: 3 draws, not 3 per expert)."""
    t, by_shape = {}, {}
    for name, shape in shapes:
        if name.endswith("norm.weight"):
            t[name] = jnp.ones(shape, dtype)
        elif name.endswith(".bias"):
            t[name] = jnp.zeros(shape, dtype)
        else:
            by_shape.setdefault(tuple(shape), []).append(name)
    for k, (shape, names) in zip(jax.random.split(key, max(len(by_shape), 1)), by_shape.items()):
        # The barrier keeps XLA from fusing the generator into each tensor's slice (an MoE
        # layer's 384 copies of it compiled for minutes on XLA:GPU).
        draw = jax.lax.optimization_barrier(
            0.02 * jax.random.normal(k, (len(names), *shape), dtype))
        t |= {name: draw[i] for i, name in enumerate(names)}
    return build(t, dtype, layout, mesh, quantization)
