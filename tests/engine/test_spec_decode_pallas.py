"""n-gram speculation with the Pallas kernels (interpreted on the CPU): each verifying
sequence's k + 1 query tokens go through the decode kernel (``max_decode_q``), and greedy
outputs equal HF transformers' (the near-tie rule) with drafts accepted."""

import numpy as np

from jaxserve.sampling_params import SamplingParams
from tests.greedy import assert_equals_hf_greedy
from tests.tiny_models import TINY, save_tiny_model

ENGINE = dict(max_model_len=160, max_num_batched_tokens=32, max_num_seqs=4, kv_cache_gib=0.01,
              attention_backend="pallas", log=lambda s: None,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_max": 3, "prompt_lookup_min": 1})


def test_verified_drafts_through_the_decode_kernel_equal_hf(tmp_path, smollm):
    from jaxserve import LLM

    # windows of 40 from layer 1 on: outputs pass them
    hf_model = save_tiny_model("qwen2-windows-from-layer-1", tmp_path, smollm.tokenizer)
    llm = LLM(str(tmp_path), **ENGINE)
    rng = np.random.default_rng(0)
    # a repeated phrase gives the lookup matches; a tiny random model's greedy text repeats too
    phrase = rng.integers(0, TINY["vocab_size"], size=6).tolist()
    prompts = [phrase * 4, rng.integers(0, TINY["vocab_size"], size=30).tolist() + phrase * 2]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    assert_equals_hf_greedy(hf_model, prompts, [o.outputs[0].token_ids for o in outs], 40)
    stats = llm.engine.get_stats().spec_decoding
    assert stats.num_accepted_tokens > 10, stats
