"""The model step as compiled for the GPU (``branch_free``) holds no data-dependent control flow
(docs/architecture.md, "One engine step"): there an XLA conditional or while loop copies its
predicate to the host and blocks the dispatching thread, which stalls async scheduling. Attention is stubbed (the GPU's Pallas
kernels are custom calls; the CPU reference has loops of its own), everything else is the real
step. The one loop allowed is JAX's threefry PRNG (5 rounds, a constant trip count, which XLA
unrolls on the GPU: the H200 measured 0% idle at batch 256 with it in every step)."""

import re

import jax
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.worker.model_runner import ModelRunner
from jaxserve.worker.sampler import sample_filtered
from jaxserve.worker.sampling_fields import SamplingMetadata
from tests.unit.test_sampler import plain_filter_metadata

CONTROL_FLOW = re.compile(r"stablehlo\.(if|case|while)\b")


def tiny_config() -> ModelConfig:
    return ModelConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 256,
        "max_position_embeddings": 256, "tie_word_embeddings": True, "eos_token_id": 2})


def attention_stub(q, k_pages, v_pages, query_start_loc, seq_lens, block_tables, **options):
    return q


@pytest.mark.parametrize("ngram", [False, True])
def test_step_lowers_without_control_flow(ngram):
    """The plain step, and the n-gram method's (its drafts made in the step)."""
    config = tiny_config()
    spec = dict(num_speculative_tokens=3, max_spec_seqs=2, ngram_lookup=(1, 3)) if ngram else {}
    runner = ModelRunner(config, llama.random_params(config, np.float32), page_size=16,
                         max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
                         kv_dtype=np.float32, attention_fn=attention_stub, branch_free=True,
                         **spec)
    runner.allocate_kv_cache(8)
    args = runner.placeholder_args(runner.k_cache, runner.v_cache)
    text = runner.programs.step[8].lower(*args.step[8]).as_text()
    for func in re.split(r"\n\s*func\.func ", text):
        found = CONTROL_FLOW.search(func)
        if found and not (found.group(1) == "while" and func.startswith("private @threefry2x32")):
            raise AssertionError(f"{found.group(0)} in {func.split('(')[0]}")


def test_the_separate_top_k_top_p_sampler_is_where_the_branches_are():
    # The check above would also pass if nothing ever branched; the filtered sampler does.
    s = 4
    sm = SamplingMetadata(*(np.zeros(s, dt) for dt in (np.float32, np.int32, np.float32,
                                                      np.uint32, np.int32)))
    text = jax.jit(sample_filtered).lower(np.zeros((s, 256), np.float32), np.zeros(s, np.int32),
                                          sm, plain_filter_metadata(sm, 256)).as_text()
    assert CONTROL_FLOW.search(text)
