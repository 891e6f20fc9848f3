"""The engine with the Pallas grouped GEMM as its MoE expert GEMMs (``Platform.moe_grouped_gemm``
"pallas", interpreted on the CPU) gives ragged_dot's greedy tokens on a tiny Qwen3-MoE: the
platform's choice reaches every step program."""

import dataclasses

import numpy as np

from jaxserve.platforms import CPU
from jaxserve.sampling_params import SamplingParams
from tests.tiny_models import TINY, save_tiny_model

ENGINE = dict(max_model_len=128, max_num_batched_tokens=8, max_num_seqs=4, kv_cache_gib=0.01,
              log=lambda s: None)


def test_pallas_grouped_gemm_engine_equals_ragged_dot(tmp_path, smollm, monkeypatch):
    from jaxserve import LLM
    from jaxserve.worker import model_runner

    save_tiny_model("qwen3_moe", tmp_path, smollm.tokenizer)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TINY["vocab_size"], size=n).tolist() for n in (5, 20)]
    tokens = {}
    for name in ("ragged_dot", "pallas"):
        platform = dataclasses.replace(CPU, moe_grouped_gemm=name)
        monkeypatch.setattr(model_runner, "current_platform", lambda p=platform: p)
        outs = LLM(str(tmp_path), **ENGINE).generate(
            prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        tokens[name] = [o.outputs[0].token_ids for o in outs]
    assert tokens["pallas"] == tokens["ragged_dot"]
