"""The engine with the Pallas grouped GEMM as its MoE expert GEMMs (``Platform.moe_grouped_gemm``
"pallas", interpreted on the CPU) gives HF's greedy tokens on a tiny Qwen3-MoE (the near-tie
rule): the platform's choice reaches every step program (one engine; the ragged_dot engine's
equality with HF is test_model_parity's)."""

import dataclasses

import numpy as np

from jaxserve.platforms import CPU
from jaxserve.sampling_params import SamplingParams
from tests.greedy import assert_equals_hf_greedy
from tests.tiny_models import TINY, save_tiny_model

ENGINE = dict(max_model_len=128, max_num_batched_tokens=8, max_num_seqs=4, kv_cache_gib=0.01,
              log=lambda s: None)


def test_pallas_grouped_gemm_engine_equals_hf(tmp_path, smollm, monkeypatch):
    from jaxserve import LLM
    from jaxserve.worker import model_runner

    hf_model = save_tiny_model("qwen3_moe", tmp_path, smollm.tokenizer)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TINY["vocab_size"], size=n).tolist() for n in (5, 20)]
    platform = dataclasses.replace(CPU, moe_grouped_gemm="pallas")
    monkeypatch.setattr(model_runner, "current_platform", lambda: platform)
    outs = LLM(str(tmp_path), **ENGINE).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert_equals_hf_greedy(hf_model, prompts, [o.outputs[0].token_ids for o in outs], 8)
