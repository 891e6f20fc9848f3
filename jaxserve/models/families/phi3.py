"""The Phi-3 family (HF's modeling_phi3): the Llama decoder with a window on every layer,
``partial_rotary_factor`` and LongRoPE (``family.rope_fields``), and checkpoints that store each
layer's q/k/v projections as one ``self_attn.qkv_proj`` ([q | k | v] rows) and gate/up as one
``mlp.gate_up_proj`` ([gate | up] rows)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.model_loader.checkpoint import row_slice
from jaxserve.models.families.family import Family, every_layer

if TYPE_CHECKING:
    from jaxserve.config import ModelConfig


def split_fused(config: ModelConfig, weights: dict) -> dict:
    """``weights`` with each layer's fused projections replaced by Llama's names for their row
    blocks (views: nothing is read or copied; a lazy tensor stays lazy).

    Raises:
      ValueError: a fused tensor of the wrong shape (naming it).
    """
    c = config
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    fused = {"self_attn.qkv_proj": {"self_attn.q_proj": (0, q), "self_attn.k_proj": (q, q + kv),
                                    "self_attn.v_proj": (q + kv, q + 2 * kv)},
             "mlp.gate_up_proj": {"mlp.gate_proj": (0, inter), "mlp.up_proj": (inter, 2 * inter)}}
    out = dict(weights)
    for i in range(c.num_layers):
        for name, parts in fused.items():
            w = out.pop(f"model.layers.{i}.{name}.weight", None)
            if w is None:
                continue  # llama.checked_weights names what is missing
            rows = max(stop for _, stop in parts.values())
            if tuple(w.shape) != (rows, c.hidden_size):
                raise ValueError(f"tensor model.layers.{i}.{name}.weight has shape "
                                 f"{tuple(w.shape)}, expected {(rows, c.hidden_size)}")
            for part, (start, stop) in parts.items():
                out[f"model.layers.{i}.{part}.weight"] = row_slice(w, start, stop)
    return out


def _phi3(cfg: dict) -> dict:
    return every_layer(cfg, cfg.get("sliding_window"))


ARCHITECTURES = {"Phi3ForCausalLM": Family("phi3", _phi3, checkpoint_names=split_fused)}
