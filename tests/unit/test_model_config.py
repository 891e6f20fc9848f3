"""Mixture-of-experts and sliding-window configs (jaxserve/models/families/): which layers are sparse
or windowed (against HF's own configs), the keys each family's config.json uses, and the options
refused at start-up. Numerics against HF transformers are in tests/engine/test_model_parity.py."""

import copy

import pytest
import transformers

from jaxserve.config import ModelConfig
from jaxserve.model_loader.dummy import PRESETS
from jaxserve.models import registry


def qwen3_moe(**changes) -> dict:
    return {**copy.deepcopy(PRESETS["qwen3-30b-a3b"]), "num_hidden_layers": 6, **changes}


def test_sparse_layers_follow_hfs_rule():
    # HF: sparse where not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    c = ModelConfig.from_hf_config(qwen3_moe(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert c.sparse_layers == (False, True, False, False, False, True)
    assert ModelConfig.from_hf_config(qwen3_moe(num_experts=0)).sparse_layers == (False,) * 6


def test_expert_count_from_either_key():
    # The Hub's config.json says num_experts; transformers 5 writes num_local_experts.
    cfg = qwen3_moe()
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert ModelConfig.from_hf_config(cfg).num_experts == 128


def test_mixtral_renormalizes_and_every_layer_is_sparse():
    c = ModelConfig.from_hf_config(PRESETS["mixtral-8x7b"])
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 14336)
    assert c.norm_topk_prob and all(c.sparse_layers) and len(c.sparse_layers) == 32


def test_more_experts_per_token_than_experts_is_refused():
    with pytest.raises(ValueError, match="num_experts_per_tok 8 exceeds the 4"):
        ModelConfig.from_hf_config(qwen3_moe(num_experts=4, num_experts_per_tok=8))


def test_fp8_weights_of_an_moe_model_are_refused():
    with pytest.raises(ValueError, match="--quantization fp8: FP8 weights of mixture-of-experts"):
        registry.build_params(qwen3_moe(), None, "float32", quantization="fp8")


SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=6)


@pytest.mark.parametrize("make", [
    lambda: transformers.Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=64,
                                     max_window_layers=2),
    lambda: transformers.Qwen3Config(**SHAPE, use_sliding_window=True, sliding_window=64,
                                     max_window_layers=4),
    lambda: transformers.Qwen2MoeConfig(**SHAPE, use_sliding_window=True, sliding_window=64,
                                        max_window_layers=4, num_experts=4,
                                        num_experts_per_tok=2),
    lambda: transformers.Qwen2Config(**SHAPE, use_sliding_window=False, sliding_window=64),
])
def test_windowed_layers_are_hfs(make):
    hf = make()
    cfg = hf.to_dict()
    cfg["architectures"] = [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                             "qwen2_moe": "Qwen2MoeForCausalLM"}[hf.model_type]]
    windows = ModelConfig.from_hf_config(cfg).layer_windows
    expect = tuple(64 if t == "sliding_attention" and hf.use_sliding_window else None
                   for t in hf.layer_types)
    assert windows == expect
    del cfg["layer_types"]  # a config.json written before layer_types: HF's default rule
    assert ModelConfig.from_hf_config(cfg).layer_windows == expect


def test_mistral_and_mixtral_window_every_layer():
    mistral = {**PRESETS["mistral-7b"], "sliding_window": 4096}
    assert ModelConfig.from_hf_config(mistral).layer_windows == (4096,) * 32
    assert ModelConfig.from_hf_config(PRESETS["mistral-7b"]).layer_windows == (None,) * 32
    assert ModelConfig.from_hf_config(qwen3_moe(use_sliding_window=True,
                                                sliding_window=512)).layer_windows == (512,) * 6


def test_unknown_layer_types_are_refused():
    cfg = {**PRESETS["qwen2.5-0.5b"], "use_sliding_window": True,
           "layer_types": ["chunked_attention"] * 24}
    with pytest.raises(ValueError, match="layer_types .'chunked_attention'."):
        ModelConfig.from_hf_config(cfg)


@pytest.mark.parametrize("preset,change,named", [
    ("llama-3.1-8b", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
    ("qwen3-0.6b", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ("llama-3.1-8b", {"mlp_bias": True}, "mlp_bias"),
    ("gemma-2-9b", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ("llama-3.1-8b", {"hidden_act": "relu"}, "hidden_act 'relu'"),
    ("llama-3.1-8b", {"architectures": ["DeepseekV3ForCausalLM"]}, "DeepseekV3ForCausalLM"),
])
def test_unimplemented_options_are_refused_by_name(preset, change, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf_config({**copy.deepcopy(PRESETS[preset]), **change})


def test_gemma3_bidirectional_attention_and_a_scaled_local_rope_are_refused():
    cfg = transformers.Gemma3TextConfig(num_hidden_layers=2).to_dict()
    cfg["architectures"] = ["Gemma3ForCausalLM"]
    assert ModelConfig.from_hf_config(cfg).local_rope_theta == 10000.0
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_config({**cfg, "use_bidirectional_attention": True})
    local = {**cfg["rope_parameters"], "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                             "rope_theta": 10000.0}}
    with pytest.raises(ValueError, match="sliding_attention rope_type 'linear'"):
        ModelConfig.from_hf_config({**cfg, "rope_parameters": local})


def test_the_architecture_is_named_or_read_from_model_type():
    """As HF's auto classes: a config without ``architectures`` is the model its ``model_type``
    names (each family's as transformers maps it); one with neither key is refused."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from jaxserve.models.families import ARCHITECTURES

    for arch, family in ARCHITECTURES.items():
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family.model_type] == arch
    qwen2 = {k: v for k, v in PRESETS["qwen2.5-0.5b"].items() if k != "architectures"}
    c = ModelConfig.from_hf_config(qwen2)
    assert c.architecture == "Qwen2ForCausalLM" and c.attention_bias
    with pytest.raises(ValueError, match="unsupported model_type 'falcon'"):
        ModelConfig.from_hf_config({**qwen2, "model_type": "falcon"})
    del qwen2["model_type"]
    with pytest.raises(ValueError, match="neither 'architectures' nor 'model_type'"):
        ModelConfig.from_hf_config(qwen2)
