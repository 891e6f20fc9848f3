"""Tiny random models of every family the engine serves, built with HF transformers from a
config (a few layers, a few experts, sliding windows shorter than the test prompts), for the
parity tests against transformers (docs/architecture.md, "Testing numerics")."""

import pathlib

import torch
import transformers

TINY = dict(vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=2, initializer_range=0.1,
            eos_token_id=2, bos_token_id=1,
            num_attention_heads=6, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)
# Phi-3's heads are hidden_size / num_attention_heads wide (its config checks LongRoPE's factor
# count against that).
PHI3 = {**TINY, "head_dim": TINY["hidden_size"] // TINY["num_attention_heads"]}

TINY_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        **TINY, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    # A window shorter than the prompts (200 tokens; the greedy ones up to 100 + 32).
    "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=48),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**TINY),
    # Mixture of experts: every layer sparse; a dense first layer (mlp_only_layers), a gated
    # shared expert and a sliding window on one layer; every other layer sparse
    # (decoder_sparse_step).
    "mixtral": lambda: transformers.MixtralConfig(**TINY, num_local_experts=4,
                                                  num_experts_per_tok=2, sliding_window=None),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **TINY, moe_intermediate_size=64, shared_expert_intermediate_size=96, num_experts=6,
        num_experts_per_tok=3, mlp_only_layers=[0], use_sliding_window=True, sliding_window=40,
        max_window_layers=2),  # HF's rule: a window on layer 0 only
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **TINY, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=2),
    # Gemma: caps low enough to bend the scores and logits, a softmax scale not D ** -0.5, a
    # sliding layer then a global one (Gemma 3: each with its own RoPE, the global one scaled).
    "gemma2": lambda: transformers.Gemma2Config(
        **TINY, sliding_window=48, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, attn_implementation="eager"),
    # Phi-3: fused q/k/v and gate/up in the checkpoint, a quarter of each head not rotated, a
    # window on every layer; its LongRoPE has a test of its own (tiny_phi3_longrope).
    "phi3": lambda: transformers.Phi3Config(
        **PHI3, sliding_window=48, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.75}),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **TINY, sliding_window=48, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}
# Other configs of the same families, for the logits check alone (test_model_parity): options
# and shapes the configs above leave out, each a config HF builds and jaxserve must equal.
VARIANT_CONFIGS = {
    # HF's attention_bias: q/k/v and the output projection carry biases; all heads KV heads.
    "llama-bias-mha-tied": lambda: transformers.LlamaConfig(
        **{**TINY, "num_key_value_heads": 6}, attention_bias=True, tie_word_embeddings=True),
    "llama-mqa-wide-heads": lambda: transformers.LlamaConfig(
        **{**TINY, "num_key_value_heads": 1, "head_dim": 64, "num_hidden_layers": 3,
           "intermediate_size": 100}, rms_norm_eps=1e-5),
    "llama-linear-rope": lambda: transformers.LlamaConfig(
        **TINY, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}),
    "mistral-narrow-heads": lambda: transformers.MistralConfig(
        **{**TINY, "head_dim": 16}, sliding_window=None),
    # Windows from layer max_window_layers on (HF's rule for use_sliding_window).
    "qwen2-windows-from-layer-1": lambda: transformers.Qwen2Config(
        **{**TINY, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=40,
        max_window_layers=1),
    "qwen3-bias-tied": lambda: transformers.Qwen3Config(
        **{**TINY, "head_dim": 48}, attention_bias=True, tie_word_embeddings=True),
    "mixtral-window-top1": lambda: transformers.MixtralConfig(
        **TINY, num_local_experts=3, num_experts_per_tok=1, sliding_window=40),
    "qwen2_moe-sparse-step-2": lambda: transformers.Qwen2MoeConfig(
        **{**TINY, "num_hidden_layers": 3}, moe_intermediate_size=48,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=2),
    "qwen3_moe-dense-layer-1": lambda: transformers.Qwen3MoeConfig(
        **{**TINY, "num_hidden_layers": 3}, moe_intermediate_size=48, num_experts=5,
        num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1]),
    "gemma2-no-caps-bias": lambda: transformers.Gemma2Config(
        **TINY, sliding_window=40, query_pre_attn_scalar=32, attn_logit_softcapping=None,
        final_logit_softcapping=None, attention_bias=True, attn_implementation="eager"),
    # Gemma 3 keeps attn_logit_softcapping in its config and never applies it.
    "gemma3-two-sliding-capped": lambda: transformers.Gemma3TextConfig(
        **{**TINY, "num_hidden_layers": 3}, sliding_window=40, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        final_logit_softcapping=5.0, attn_logit_softcapping=4.0, attn_implementation="eager"),
    "phi3-mha-no-window": lambda: transformers.Phi3Config(
        **{**PHI3, "num_key_value_heads": 6}, sliding_window=None, pad_token_id=0),
    # Heads of 24 features (Phi-3-mini's are 96): not a power of two, which the Pallas
    # kernels' pool pads (pallas_kernels.pool_head_dim).
    "phi3-heads-of-24": lambda: transformers.Phi3Config(
        **{**PHI3, "hidden_size": 144, "head_dim": 24}, sliding_window=48, pad_token_id=0),
}
HF_CLASSES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
}



def tiny_phi3_longrope() -> transformers.Phi3Config:
    """Phi-3 with LongRoPE (distinct short and long factors, a 64-token original length), the
    partial rotary and window of ``TINY_CONFIGS["phi3"]``."""
    rotary_half = int(PHI3["head_dim"] * 0.75) // 2
    return transformers.Phi3Config(
        **PHI3, sliding_window=48, pad_token_id=0,
        original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.75,
                         "short_factor": [1.0 + 0.1 * i for i in range(rotary_half)],
                         "long_factor": [1.0 + 0.7 * i for i in range(rotary_half)]})


def tiny_model(name: str):
    """The tiny random HF model ``name`` (of ``TINY_CONFIGS``, or ``VARIANT_CONFIGS``: its
    family's class), float32, eval mode: random biases and norm weights (HF initialises them to
    constants), so that those paths are exercised."""
    torch.manual_seed(0)
    config = (TINY_CONFIGS.get(name) or VARIANT_CONFIGS[name])()
    model = getattr(transformers, HF_CLASSES[name.split("-")[0]])(config).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("proj.bias") or "norm" in param_name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_tiny_model(name: str, folder: pathlib.Path, tokenizer):
    """``tiny_model(name)`` saved as an HF folder with ``tokenizer``; returns the model."""
    model = tiny_model(name)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model
