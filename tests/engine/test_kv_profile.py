"""ModelRunner's KV pool deferral and the GPU sizing's step profile (XLA memory analysis of the
largest bucket against a pool given by shapes only), exercised on CPU with a tiny random model."""

import jax
import jax.numpy as jnp

from jaxserve.models.registry import build_params
from jaxserve.worker.model_runner import ModelRunner
from pallas_kernels.reference import attention

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256}


def test_profile_step_bytes_and_deferred_pool():
    config, params = build_params(TINY, None, jnp.float32, 0)
    runner = ModelRunner(config, params, page_size=16, max_num_seqs=4,
                         max_num_batched_tokens=64, max_model_len=256, kv_dtype=jnp.float32,
                         attention_fn=attention)
    assert runner.k_cache is None
    step = runner.profile_step_bytes(num_pages=17)
    # At least the largest bucket's hidden states (64 tokens x 64 floats) pass through temporaries;
    # far less than the pool itself would be if the KV outputs were not donated in place.
    assert 64 * 64 * 4 <= step < 10 * 2**20
    runner.allocate_kv_cache(17)
    leaves = jax.tree.leaves(runner.k_cache)
    assert len(leaves) == config.num_layers  # per-layer pools
    assert sum(x.size for x in leaves) == config.num_layers * config.num_kv_heads * 17 * 16 * config.head_dim
