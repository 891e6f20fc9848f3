"""The Gemma family: Gemma 2 and Gemma 3 text (HF's modeling_gemma2, modeling_gemma3's
``Gemma3Text*``): GeGLU, (1 + w) RMSNorms around both blocks, the scaled embedding,
``query_pre_attn_scalar``, soft-capping (Gemma 2), sliding layers every other layer (Gemma 2)
or five of six (Gemma 3, on their own unscaled RoPE base)."""

from jaxserve.models.families.family import Family, rope_parameters, typed_windows

# HF's defaults (transformers' Gemma2Config, Gemma3TextConfig) for the keys a config may leave
# out (Gemma 3's published configs nest a partial ``text_config``).
_COMMON = dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
               num_attention_heads=8, num_key_value_heads=4, head_dim=256,
               hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
               tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096)
_GEMMA2 = {**_COMMON, "vocab_size": 256000, "max_position_embeddings": 8192,
           "rope_theta": 10000.0, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}
_GEMMA3 = {**_COMMON, "vocab_size": 262208, "max_position_embeddings": 131072,
           "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6}


def _gemma(cfg: dict) -> dict:
    return dict(norm_unit_offset=True, sandwich_norms=True,
                embed_scale=cfg["hidden_size"] ** 0.5,
                attn_scale=cfg["query_pre_attn_scalar"] ** -0.5,
                attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
                final_logit_softcapping=cfg.get("final_logit_softcapping"))


def _gemma2(cfg: dict) -> dict:
    return _gemma(cfg) | typed_windows("Gemma2ForCausalLM", cfg, cfg["sliding_window"],
                                       lambda i: (i + 1) % 2)


def _gemma3(cfg: dict) -> dict:
    """Raises ValueError for a rope type on the sliding layers other than the default."""
    arch = "Gemma3ForCausalLM"
    _, local = rope_parameters(cfg)
    local = local or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported config option rope_parameters.sliding_attention "
                         f"rope_type {local['rope_type']!r} of {arch}")
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
    # HF's Gemma3Attention keeps attn_logit_softcapping but never applies it (no softcap to
    # its attention function, eager or not): Gemma 3's scores are not capped.
    return (_gemma(cfg) | {"qk_norm": True, "attn_logit_softcapping": None,
                           "local_rope_theta": local.get("rope_theta") or cfg["rope_local_base_freq"]}
            | typed_windows(arch, cfg, cfg["sliding_window"], lambda i: (i + 1) % pattern))


ARCHITECTURES = {
    "Gemma2ForCausalLM": Family("gemma2", _gemma2, _GEMMA2, activation_key="hidden_activation"),
    "Gemma3ForCausalLM": Family("gemma3_text", _gemma3, _GEMMA3, activation_key="hidden_activation"),
}
