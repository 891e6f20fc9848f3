"""The Qwen family: Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm) and their mixtures of experts
Qwen2-MoE (a gated shared expert) and Qwen3-MoE (HF's modeling_qwen2, modeling_qwen3,
modeling_qwen2_moe, modeling_qwen3_moe). Sliding windows only with ``use_sliding_window``."""

from jaxserve.models.families.family import Family, checked_experts, every_layer, typed_windows


def _windows(arch: str, cfg: dict) -> dict:
    """HF's rule: none without ``use_sliding_window``; Qwen3-MoE every layer; else the layers
    ``layer_types`` marks, by default from ``max_window_layers`` on (Qwen2-MoE: every other
    layer below it)."""
    if not cfg.get("use_sliding_window"):
        return every_layer(cfg, None)
    window = cfg.get("sliding_window") or 4096
    if arch == "Qwen3MoeForCausalLM":
        return every_layer(cfg, window)
    last_full = cfg.get("max_window_layers", 28)
    if arch == "Qwen2MoeForCausalLM":
        return typed_windows(arch, cfg, window, lambda i: (i + 1) % 2 and i < last_full)
    return typed_windows(arch, cfg, window, lambda i: i >= last_full)


def _experts(arch: str, cfg: dict) -> dict:
    """The MoE fields, HF's defaults for the keys a config leaves out; which layers are sparse
    follows HF's rule (``mlp_only_layers``, ``decoder_sparse_step``)."""
    qwen2 = arch == "Qwen2MoeForCausalLM"
    # Hub configs say num_experts; transformers 5 writes num_local_experts.
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 60 if qwen2 else 128))
    step = cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    return checked_experts(arch, dict(
        num_experts=num_experts,
        num_experts_per_tok=cfg.get("num_experts_per_tok", 4 if qwen2 else 8),
        moe_intermediate_size=cfg.get("moe_intermediate_size", 1408 if qwen2 else 768),
        shared_expert_intermediate_size=(cfg.get("shared_expert_intermediate_size", 5632)
                                         if qwen2 else 0),
        norm_topk_prob=cfg.get("norm_topk_prob", False),
        sparse_layers=tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0
                            for i in range(cfg["num_hidden_layers"]))))


def _qwen2(cfg: dict) -> dict:
    return {"attention_bias": True, "o_proj_bias": False} | _windows("Qwen2ForCausalLM", cfg)


def _qwen3(cfg: dict) -> dict:
    return {"qk_norm": True} | _windows("Qwen3ForCausalLM", cfg)


def _qwen2_moe(cfg: dict) -> dict:
    arch = "Qwen2MoeForCausalLM"
    return ({"attention_bias": cfg.get("qkv_bias", True) or cfg.get("attention_bias", False),
             "o_proj_bias": False} | _windows(arch, cfg) | _experts(arch, cfg))


def _qwen3_moe(cfg: dict) -> dict:
    arch = "Qwen3MoeForCausalLM"
    return {"qk_norm": True} | _windows(arch, cfg) | _experts(arch, cfg)


_EXPERTS = ("mlp", "gate_proj", "up_proj", "down_proj")
ARCHITECTURES = {
    "Qwen2ForCausalLM": Family("qwen2", _qwen2),
    "Qwen3ForCausalLM": Family("qwen3", _qwen3),
    "Qwen2MoeForCausalLM": Family("qwen2_moe", _qwen2_moe, expert_names=_EXPERTS),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", _qwen3_moe, expert_names=_EXPERTS),
}
