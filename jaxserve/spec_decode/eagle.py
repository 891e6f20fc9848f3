"""The eagle and eagle3 methods (vLLM V1's ``v1/spec_decode/eagle.py``; the heads of
``model_executor/models/llama_eagle.py`` and ``llama_eagle3.py``): a one-layer head drafts from
the target's own hidden states, on the device.

The head reads, at position t, the token at t + 1 and a hidden state for position t, and
predicts the token at t + 2:

- EAGLE-1 (Li et al. 2024, "EAGLE"): x = fc([embed(token) | h]) with h the target's final
  norm's output; Llama decoder layers (the first without its input norm); the output, not
  normed, through the target's LM head.
- EAGLE-3 (Li et al. 2025, "EAGLE-3"): h = fc([h_a | h_b | h_c]), the inputs (residual stream)
  of three target layers (vLLM's default ids: 2, L // 2, L - 3; the head config's
  ``eagle_aux_hidden_state_layer_ids`` overrides them); one layer whose q/k/v read
  [input_layernorm(embed(token)) | hidden_norm(h)] with h as the residual; the final norm and
  the head's own LM head over a draft vocabulary, mapped to target ids by d2t.

Either way the head's next input hidden state is its own output before any final norm, so a
draft chain runs k single-token head steps (a chain: tree drafting is not built).

Checkpoint layout (an HF folder, config.json + safetensors, as the public heads
yuhuili/EAGLE-LLaMA3-Instruct-8B and yuhuili/EAGLE3-LLaMA3.1-Instruct-8B write it, torch
layouts, [out, in] linear weights; E hidden, H heads, KV KV heads, D head dim, I
intermediate, Vd draft vocabulary):

- eagle: a Llama config (``num_hidden_layers`` >= 1); ``fc.weight`` [E, 2E] (``fc.bias`` [E]
  optional); ``layers.N.self_attn.{q,k,v,o}_proj.weight``, ``layers.N.mlp.{gate,up,down}_proj
  .weight``, ``layers.N.post_attention_layernorm.weight``, ``layers.N.input_layernorm.weight``
  for N >= 1 (layer 0's, if present, is not read: vLLM replaces it by the identity).
- eagle3: a Llama config with ``draft_vocab_size`` (architectures
  ``["LlamaForCausalLMEagle3"]``), one layer; ``fc.weight`` [E, 3E]; ``midlayer.`` +
  ``input_layernorm.weight`` [E], ``hidden_norm.weight`` [E], ``self_attn.q_proj.weight``
  [H D, 2E], ``self_attn.{k,v}_proj.weight`` [KV D, 2E], ``self_attn.o_proj.weight`` [E, H D],
  ``post_attention_layernorm.weight`` [E], ``mlp.*``; ``norm.weight`` [E]; ``lm_head.weight``
  [Vd, E]; ``d2t`` int64 [Vd] (target id = draft id + d2t[draft id]); ``t2d`` bool [V] (not
  read, as vLLM).
- Both: ``embed_tokens.weight`` [V, E] optional, else the target's embedding serves.

The pool and the bookkeeping are the draft_model method's (``draft_model.py``): the head's
own KV pool of the target's page count, indexed by the same block table, written by a
catch-up over every step's tokens (``catch_up``) and by ``propose``. The head's K/V at position
t are those of the pair (token t + 1, h_t), vLLM's layout; the catch-up of a step runs one
position behind the target (the pair of its last token needs the token sampled after it), so
each sequence's newest target hidden state waits in a per-slot carry (``slot_hidden``) for the
next step or for ``propose``, which starts from it with the emitted token.
"""

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.spec_decode.draft_model import draft_chain
from jaxserve.worker.sampling_fields import SamplingMetadata

METHODS = ("eagle", "eagle3")
# "model" of a random head of the target's shapes (``random_weights``): speed runs where no
# trained head can be fetched.
DUMMY = "dummy"
# Targets a Llama head attaches to: plain RMSNorm decoders whose LM head reads the final norm's
# output as is (no embedding scale, no logit soft-cap).
TARGET_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


@dataclass
class EagleHead:
    """An EAGLE head of ``--speculative-config``'s "model", ready to run.

    Attributes:
      method: "eagle" or "eagle3".
      config: the head's layer shapes (a Llama config; ``vocab_size`` the target's).
      params: on the device: ``fc`` [nE, E] (``fc_bias`` [E]), ``layers`` (``llama`` layer
        params), ``embed_tokens`` [V, E] (the head's or the target's), ``lm_head`` [V, E] (the
        target's) or, eagle3, [Vd, E] with ``norm`` [E] and ``draft_to_target`` [Vd] int32.
      aux_layers: the target hidden states the head reads (``llama.forward``'s
        ``aux_layers``): () for eagle, three layer ids for eagle3.
    """

    method: str
    config: ModelConfig
    params: dict
    aux_layers: tuple[int, ...]


def check_target(target: ModelConfig) -> None:
    """Raises ValueError, naming "method", for a target the head cannot attach to."""
    if target.architecture not in TARGET_ARCHITECTURES:
        raise ValueError(f"method: EAGLE heads attach to {', '.join(TARGET_ARCHITECTURES)} "
                         f"targets, not {target.architecture}")


def load_head(method: str, hf_config: dict, weights: dict, target: ModelConfig,
              target_params: dict, dtype) -> EagleHead:
    """The head of a checkpoint in the layout of the module docstring, in ``dtype`` on the one
    device, sharing the target's embedding (when it has none) and, eagle, LM head.

    Raises:
      ValueError: naming the field "model": a hidden size or vocabulary other than the
        target's, another layer count than one (eagle3), aux layer ids outside the target's
        layers, a missing tensor or one of the wrong shape.
    """
    if hf_config.get("quantization_config") is not None:
        raise ValueError("model: a quantized EAGLE head (quantization_config) is not supported")
    c = _layer_config(hf_config)
    for name, ours, theirs in (("hidden_size", c.hidden_size, target.hidden_size),
                               ("vocab_size", c.vocab_size, target.vocab_size)):
        if ours != theirs:
            raise ValueError(f"model: the EAGLE head's {name} is {ours}, the target's {theirs}")
    L = target.num_layers
    if method == "eagle":
        aux_layers = ()
    else:
        if c.num_layers != 1:
            raise ValueError(f"model: an eagle3 head has one layer, this one {c.num_layers}")
        aux_layers = tuple(hf_config.get("eagle_aux_hidden_state_layer_ids")
                           or (2, L // 2, L - 3))
        if len(aux_layers) != 3 or not all(0 <= i < L for i in aux_layers):
            raise ValueError(f"model: eagle3 reads three of the target's {L} layers, "
                             f"eagle_aux_hidden_state_layer_ids {list(aux_layers)}")
    shapes = expected_shapes(method, c, len(aux_layers) or 2, hf_config.get("draft_vocab_size"))
    t = {}
    for name, shape in shapes.items():
        w = weights.get(name)
        if w is None and not name.endswith(("fc.bias", "embed_tokens.weight")):
            raise ValueError(f"model: the EAGLE head lacks tensor {name!r}")
        if w is not None and tuple(w.shape) != shape:
            raise ValueError(f"model: the EAGLE head's tensor {name} has shape "
                             f"{tuple(w.shape)}, expected {shape}")
        if w is not None and name != "d2t" and (w.dtype.kind in "iub"
                                                or w.dtype.name.startswith("float8")):
            raise ValueError(f"model: the EAGLE head's tensor {name} has dtype {w.dtype}, "
                             f"expected a float dtype")
        if w is not None:
            t[name] = np.asarray(w)
    prefix = "midlayer." if method == "eagle3" else "layers.{}."
    layers = [llama.layer_params({n[len(prefix.format(i)):]: w for n, w in t.items()
                                  if n.startswith(prefix.format(i))}, dtype, c)
              for i in range(c.num_layers)]
    put = lambda name: jnp.asarray(t[name], dtype)  # noqa: E731
    params = {"fc": put("fc.weight").T, "layers": layers,
              "embed_tokens": (put("embed_tokens.weight") if "embed_tokens.weight" in t
                               else target_params["embed_tokens"])}
    if "fc.bias" in t:
        params["fc_bias"] = put("fc.bias")
    if method == "eagle":
        params["lm_head"] = target_params.get("lm_head", target_params["embed_tokens"])
    else:
        d2t = t["d2t"].astype(np.int64)
        ids = np.arange(len(d2t)) + d2t
        if ids.min() < 0 or ids.max() >= target.vocab_size:
            raise ValueError("model: the EAGLE head's d2t maps draft ids outside the target's "
                             "vocabulary")
        params |= {"norm": put("norm.weight"), "lm_head": put("lm_head.weight"),
                   "draft_to_target": jnp.asarray(ids, jnp.int32)}
    return EagleHead(method, c, params, aux_layers)


def _layer_config(hf_config: dict) -> ModelConfig:
    """The shapes of a head's Llama layers from its config.json (eagle3's architecture
    name read as Llama's)."""
    return ModelConfig.from_hf_config({**hf_config, "architectures": ["LlamaForCausalLM"]})


def expected_shapes(method: str, c: ModelConfig, num_inputs: int,
                    draft_vocab_size: int | None) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a head's checkpoint (module docstring); ``fc.bias`` and
    ``embed_tokens.weight`` are optional. ``num_inputs``: the hidden states fc reads (2 for
    eagle: the embedding and h; 3 for eagle3)."""
    E = c.hidden_size
    _, layer = llama.hf_tensor_shapes(c)
    out = {"fc.weight": (E, num_inputs * E), "fc.bias": (E,),
           "embed_tokens.weight": (c.vocab_size, E)}
    if method == "eagle":
        for i in range(c.num_layers):
            out |= {f"layers.{i}.{n}": s for n, s in layer.items()
                    if not (i == 0 and n == "input_layernorm.weight")}
        return out
    wide = {f"self_attn.{x}_proj.weight": (layer[f"self_attn.{x}_proj.weight"][0], 2 * E)
            for x in "qkv"}
    out |= {f"midlayer.{n}": s for n, s in (layer | wide | {"hidden_norm.weight": (E,)}).items()}
    vd = draft_vocab_size or c.vocab_size
    return out | {"norm.weight": (E,), "lm_head.weight": (vd, E), "d2t": (vd,)}


def head_config(target: dict, method: str, draft_vocab_size: int | None = None,
                aux_layer_ids: list[int] | None = None) -> dict:
    """The head's config.json: the target's Llama shapes with one decoder layer; eagle3's
    with its architecture, ``draft_vocab_size`` (default min(32000, V), the public heads')
    and, when given, ``eagle_aux_hidden_state_layer_ids``."""
    cfg = {k: v for k, v in target.items() if k not in ("quantization_config", "text_config")}
    cfg |= {"num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"],
            "tie_word_embeddings": False}
    if method == "eagle3":
        cfg |= {"architectures": ["LlamaForCausalLMEagle3"],
                "draft_vocab_size": draft_vocab_size or min(32000, target["vocab_size"])}
        if aux_layer_ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    return cfg


def random_weights(cfg: dict, method: str, std: float = 0.02, seed: int = 0,
                   dtype=np.float32) -> dict[str, np.ndarray]:
    """Random tensors of the head of config ``cfg`` (``head_config``), by their checkpoint
    names: no ``fc.bias`` and no ``embed_tokens.weight`` (the target's serves)."""
    rng = np.random.default_rng(seed)
    shapes = expected_shapes(method, _layer_config(cfg), 3 if method == "eagle3" else 2,
                             cfg.get("draft_vocab_size"))
    out = {}
    for name, shape in shapes.items():
        if name in ("fc.bias", "embed_tokens.weight", "d2t"):
            continue
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, dtype)
        else:
            out[name] = (std * rng.standard_normal(shape, np.float32)).astype(dtype)
    if method == "eagle3":
        vocab = cfg["vocab_size"]
        ids = np.sort(rng.choice(vocab, cfg["draft_vocab_size"], replace=False))
        out["d2t"] = (ids - np.arange(len(ids))).astype(np.int64)
        out["t2d"] = np.isin(np.arange(vocab), ids)
    return out


def combine(method: str, params: dict, hidden):
    """The target's hidden states [T, nE] as the head's h [T, E]: eagle3's fc over the three
    layers' states; eagle's fc reads h beside the embedding (``forward``), so as they are."""
    if method == "eagle":
        return hidden
    return _fc(params, hidden)


def _fc(params: dict, x):
    out = x @ params["fc"]
    return out + params["fc_bias"] if "fc_bias" in params else out


def forward(method: str, config: ModelConfig, attention_fn, params: dict, token_ids, h,
            md: llama.AttentionMetadata, k_cache, v_cache):
    """The head over tokens [T] int32 with their hidden states h [T, E] (``combine``'s, or the
    head's own output), at ``md``'s positions (writing their K/V into the head's pool).

    Returns:
      (logits [T, V] float32 over the target's vocabulary (eagle3: -inf outside the draft
      vocabulary), the next h [T, E] (the output before any norm), k_cache, v_cache).
    """
    with llama.matmul_precision(h.dtype):
        embed = params["embed_tokens"]
        x = jnp.concatenate([embed[token_ids], h], axis=-1)
        if method == "eagle":
            x = _fc(params, x)
        out, k_cache, v_cache = llama.run_layers(config, params["layers"], x, md, k_cache,
                                                 v_cache, attention_fn)
        normed = (out if method == "eagle"
                  else llama.rms_norm(out, params["norm"], config.rms_norm_eps))
        logits = jnp.einsum("se,ve->sv", normed, params["lm_head"],
                            preferred_element_type=jnp.float32)
    if method == "eagle3":
        logits = jnp.full((logits.shape[0], config.vocab_size), -jnp.inf,
                          jnp.float32).at[:, params["draft_to_target"]].set(logits)
    return logits, out, k_cache, v_cache


def catch_up(method: str, config: ModelConfig, attention_fn, page_size: int, params: dict,
             token_ids, md: llama.AttentionMetadata, seq_slots, hidden, slot_hidden,
             first_valid, k_cache, v_cache):
    """The head over a target step's tokens, one position behind it: the token at position
    p > 0 with h_{p - 1} writes the head's K/V at p - 1 (each sequence's last h waits in
    ``slot_hidden`` for the token after it). A sequence's first token reads h from
    ``slot_hidden``, and is left out where that holds no h_{p - 1} (``first_valid`` 0: a
    new sequence, a prefix-cache hit); the rows kept are moved to the front, in order, so that
    each sequence's queries stay contiguous.

    Args:
      token_ids: [T] int32, the step's tokens; ``md``: the step's metadata (the target's), its
        ``seq_slots`` [S] int32.
      hidden: [T, nE] the target's hidden states of the step (``EagleHead.aux_layers``).
      slot_hidden: [max_num_seqs, E], per InputBatch slot, the newest h of its sequence.
      first_valid: [S] int32, 1 where slot_hidden holds h_{p - 1} of the sequence's first
        token at p.
      k_cache, v_cache: the head's pool (donate it).

    Returns:
      (k_cache, v_cache, h [T, E]: ``combine``'s of the step's rows).
    """
    h = combine(method, params, hidden)
    qsl = md.query_start_loc
    t, s = token_ids.shape[0], qsl.shape[0] - 1
    row = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(qsl, row, side="right") - 1, s - 1)
    first = row == qsl[seq]
    h_prev = jnp.where(first[:, None], slot_hidden[seq_slots[seq]], h[jnp.maximum(row - 1, 0)])
    keep = (row < qsl[s]) & (md.positions > 0) & (~first | (first_valid[seq] > 0))
    order = jnp.argsort(~keep, stable=True)
    kept_before = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(keep, dtype=jnp.int32)])
    pos = jnp.maximum(md.positions - 1, 0)
    page = md.block_tables[seq, pos // page_size]
    slot_mapping = jnp.where(keep, page * page_size + pos % page_size, 0)
    head_md = llama.AttentionMetadata(
        jnp.where(keep, pos, 0)[order], slot_mapping[order], kept_before[qsl],
        jnp.maximum(md.seq_lens - 1, 0), md.block_tables)
    _, _, k_cache, v_cache = forward(method, config, attention_fn, params, token_ids[order],
                                     h_prev[order], head_md, k_cache, v_cache)
    return k_cache, v_cache, h


def write_slot_hidden(slot_hidden, rows_hidden, slots, rows):
    """``slot_hidden`` [max_num_seqs, E] with ``rows_hidden[rows]`` written at ``slots`` ([N]
    int32; slots past the table pad, dropped)."""
    return slot_hidden.at[slots].set(rows_hidden[rows], mode="drop")


def propose(method: str, config: ModelConfig, attention_fn, num_drafts: int, page_size: int,
            params, k_cache, v_cache, block_table, token_ids, positions, slots, num_seqs,
            sm: SamplingMetadata, slot_hidden):
    """num_drafts drafts after each sequence's last emitted token: ``draft_chain`` from the
    pair (that token, ``slot_hidden`` of its slot: h of the position before it), at that
    position, each step feeding the head's output as the next h.

    Args:
      positions: [B] int32, the emitted token's position (the chain starts one before it);
      the others as ``draft_model.propose``.

    Returns:
      as ``draft_model.propose``.
    """
    def step(tokens, md, k_cache, v_cache, h):
        logits, h, k_cache, v_cache = forward(method, config, attention_fn, params, tokens, h,
                                              md, k_cache, v_cache)
        return logits, k_cache, v_cache, h

    drafts, q, k_cache, v_cache, _ = draft_chain(
        step, num_drafts, page_size, k_cache, v_cache, block_table, token_ids,
        jnp.maximum(positions - 1, 0), slots, num_seqs, sm, slot_hidden[slots])
    return drafts, q, k_cache, v_cache

