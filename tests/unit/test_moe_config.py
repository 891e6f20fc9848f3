"""Mixture-of-experts configs (jaxserve/config.py, jaxserve/models/moe.py): which layers are
sparse, the keys each family's config.json uses, and the options refused at start-up. Numerics
against HF transformers are in tests/engine/test_model_parity.py."""

import copy

import pytest

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


@pytest.mark.parametrize("cfg,error", [
    (qwen3_moe(use_sliding_window=True), "use_sliding_window"),
    ({**PRESETS["mixtral-8x7b"], "sliding_window": 4096}, "sliding_window=4096"),
    (qwen3_moe(num_experts=4, num_experts_per_tok=8), "num_experts_per_tok 8 exceeds the 4"),
])
def test_options_not_implemented_are_refused(cfg, error):
    with pytest.raises(ValueError, match=error):
        ModelConfig.from_hf_config(cfg)


def test_fp8_weights_of_an_moe_model_are_refused():
    with pytest.raises(ValueError, match="--quantization fp8: FP8 weights of mixture-of-experts"):
        registry.build_params(qwen3_moe(), None, "float32", quantization="fp8")
