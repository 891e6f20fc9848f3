"""The Llama family: Llama 2/3, Mistral (a window on every layer) and its mixture of experts
Mixtral (HF's modeling_llama, modeling_mistral, modeling_mixtral)."""

from jaxserve.models.families.family import Family, checked_experts, every_layer


def _llama(cfg: dict) -> dict:
    return {}


def _mistral(cfg: dict) -> dict:
    return every_layer(cfg, cfg.get("sliding_window"))


def _mixtral(cfg: dict) -> dict:
    return _mistral(cfg) | checked_experts("MixtralForCausalLM", dict(
        num_experts=cfg.get("num_local_experts", 8),
        num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
        moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
        sparse_layers=(True,) * cfg["num_hidden_layers"]))


ARCHITECTURES = {
    "LlamaForCausalLM": Family("llama", _llama),
    "MistralForCausalLM": Family("mistral", _mistral),
    "MixtralForCausalLM": Family("mixtral", _mixtral, expert_names=("block_sparse_moe", "w1", "w3", "w2")),
}
