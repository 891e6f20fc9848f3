"""``Family``, a row of the architecture table, and the config rules families share: HF's
``layer_types`` windows, the MoE fields' check, and RoPE (with LongRoPE resolved)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# The gated MLP's activations by HF name: silu (SwiGLU), gelu_pytorch_tanh (GeGLU).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# RoPE scaling types (HF's ``rope_type``) the decoder implements (``jaxserve.models.rope``).
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su")


@dataclass(frozen=True)
class Family:
    """What one HF architecture adds to the shared decoder (``jaxserve.models.llama``).

    Attributes:
      model_type: HF's ``model_type`` of the architecture's config (``llama``, ``qwen2``, ...).
      fields: the HF config (with ``defaults`` filled in) -> the ``ModelConfig`` fields the
        family sets beyond the common shapes (windows, biases, norms, experts, ...); raises
        ValueError naming a config option it does not implement.
      defaults: HF's defaults (its config class's) for keys a config of the family may leave
        out.
      activation_key: the config key of the gated MLP's activation.
      expert_names: of an MoE family, its HF names (block, gate, up, down) of a sparse layer's
        ``{block}.experts.N.{gate|up|down}`` tensors.
      checkpoint_names: ``(ModelConfig, weights) -> weights`` under Llama's tensor names, for a
        family whose checkpoints store them otherwise (views, nothing read).
    """

    model_type: str
    fields: Callable[[dict], dict]
    defaults: Mapping = field(default_factory=dict)
    activation_key: str = "hidden_act"
    expert_names: tuple[str, str, str, str] | None = None
    checkpoint_names: Callable | None = None


def every_layer(cfg: dict, window: int | None) -> dict:
    """``layer_windows`` with ``window`` (None: full attention) on every layer."""
    return {"layer_windows": (window or None,) * cfg["num_hidden_layers"]}


def typed_windows(arch: str, cfg: dict, window: int, sliding: Callable[[int], bool]) -> dict:
    """``layer_windows`` from HF's ``layer_types`` ("sliding_attention" layers get ``window``),
    or where the config has none, from HF's default rule ``sliding(layer index)``.

    Raises:
      ValueError: a ``layer_types`` entry other than full_attention and sliding_attention.
    """
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "sliding_attention" if sliding(i) else "full_attention" for i in range(n)]
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"unsupported config option layer_types {sorted(unknown)} of {arch}")
    return {"layer_windows": tuple(window if t == "sliding_attention" else None for t in types)}


def checked_experts(arch: str, fields: dict) -> dict:
    """An MoE family's fields, checked.

    Raises:
      ValueError: an expert count below the experts per token.
    """
    if 0 < fields["num_experts"] < fields["num_experts_per_tok"]:
        raise ValueError(f"num_experts_per_tok {fields['num_experts_per_tok']} exceeds the "
                         f"{fields['num_experts']} experts of {arch}")
    return fields


def rope_parameters(cfg: dict) -> tuple[dict, dict | None]:
    """(the global layers' rope parameters, the sliding layers' own or None): transformers 5's
    ``rope_parameters`` (one dict, or one per layer type), else the top-level keys."""
    rope = dict(cfg.get("rope_parameters") or {})
    local = rope.pop("sliding_attention", None)
    return rope.pop("full_attention", rope), local


def rope_fields(cfg: dict, max_model_len: int | None) -> dict:
    """``rope_theta``, ``rope_scaling`` (None for the default rope) and ``rotary_dim`` (None:
    the whole head; ``partial_rotary_factor``) of an HF config.

    LongRoPE (Phi-3's ``longrope``, formerly ``su``) resolves to one factor set for the server's
    life, since the KV cache holds keys rotated by it: the long factors when ``max_model_len``
    (default ``max_position_embeddings``) exceeds ``original_max_position_embeddings``, the
    short ones otherwise, with HF's attention factor. HF switches per forward pass (long once a
    sequence passes the original length), so the two agree on every sequence when
    max_model_len <= the original length, and on sequences longer than it otherwise.

    Raises:
      ValueError: a rope type outside ``ROPE_TYPES`` (yarn, dynamic, ...), naming it.
    """
    rope, _ = rope_parameters(cfg)
    scaling = cfg.get("rope_scaling") or rope or None
    kind = scaling and scaling.get("rope_type", scaling.get("type"))
    if kind not in (None, *ROPE_TYPES):
        raise ValueError(f"unsupported config option rope_scaling rope_type {kind!r} "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    if kind in (None, "default"):
        scaling = None
    elif kind in ("longrope", "su"):
        scaling = _longrope(cfg, scaling, max_model_len)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return {"rope_theta": rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0,
            "rope_scaling": scaling,
            "rotary_dim": None if partial == 1.0 else int(head_dim * partial)}


def _longrope(cfg: dict, scaling: dict, max_model_len: int | None) -> dict:
    """LongRoPE's ``{"rope_type": "longrope", "ext_factors", "attention_factor"}`` for a server
    of ``max_model_len`` tokens (``rope_fields``; transformers' ``_compute_longrope_parameters``
    for the attention factor)."""
    max_pos = cfg["max_position_embeddings"]
    original = (scaling.get("original_max_position_embeddings")
                or cfg.get("original_max_position_embeddings") or max_pos)
    factor = scaling.get("factor") or max_pos / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0 else
                            math.sqrt(1 + math.log(factor) / math.log(original)))
    long = (max_model_len or max_pos) > original
    return {"rope_type": "longrope", "attention_factor": attention_factor,
            "ext_factors": tuple(scaling["long_factor" if long else "short_factor"])}
