"""Heads whose width is not a power of two (Phi-3-mini's 96) through the Pallas kernels: the
pool is as wide as the next power of two (``pallas_kernels.pool_head_dim``), the model pads its
queries and new keys and values with zeros, and greedy decoding equals HF transformers'. The
kernels run interpreted on the CPU; with the KV write as XLA's scatter (these steps' size) and
as the Pallas kernel (``pallas_kernels.kv_write``, forced for every step)."""

import numpy as np
import pytest

from jaxserve.sampling_params import SamplingParams
from pallas_kernels import get_attention_fn, kv_write, pool_head_dim, reference
from tests.greedy import assert_equals_hf_greedy
from tests.tiny_models import TINY, save_tiny_model

ENGINE = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, kv_cache_gib=0.01,
              log=lambda s: None)


def test_pool_head_dim():
    pallas = get_attention_fn("pallas", interpret=True)
    assert [pool_head_dim(pallas, d) for d in (24, 64, 80, 96, 128, 256)] == [32, 64, 128, 128,
                                                                            128, 256]
    assert pool_head_dim(reference.attention, 96) == 96


@pytest.mark.parametrize("kernel_write", [False, True])
def test_heads_of_24_equal_hf_greedy_through_pallas(tmp_path, smollm, monkeypatch, kernel_write):
    from jaxserve import LLM

    if kernel_write:
        monkeypatch.setattr(kv_write, "SCATTER_MAX_TOKENS", 0)
        # the patch is not in the source that keys the compiled-program cache
        monkeypatch.setenv("JAXSERVE_DISABLE_EXECUTABLE_CACHE", "1")

    hf_model = save_tiny_model("phi3-heads-of-24", tmp_path, smollm.tokenizer)
    llm = LLM(str(tmp_path), attention_backend="pallas", **ENGINE)
    assert llm.engine.runner.config.head_dim == 24
    assert llm.engine.runner.k_cache[0].shape[-1] == 32
    rng = np.random.default_rng(0)
    # past the window of 48: the sliding kernels too
    prompts = [rng.integers(0, TINY["vocab_size"], size=n).tolist() for n in (5, 60)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert_equals_hf_greedy(hf_model, prompts, [o.outputs[0].token_ids for o in outs], 10)
