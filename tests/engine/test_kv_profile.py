"""ModelRunner's KV pool deferral and the GPU sizing's program peaks (XLA memory analysis of
programs compiled against a pool given by shapes only), exercised on CPU with a tiny random
model."""

import jax
import jax.numpy as jnp
import pytest

from jaxserve.engine import kv_sizing
from jaxserve.models.registry import build_params
from jaxserve.worker import compilation
from jaxserve.worker.model_runner import ModelRunner
from pallas_kernels.reference import attention

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256}


def _runner():
    config, params = build_params(TINY, None, jnp.float32, 0)
    return ModelRunner(config, params, page_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                       max_model_len=256, kv_dtype=jnp.float32, attention_fn=attention)


def test_peaks_count_every_program_and_the_pool_comes_after():
    runner = _runner()
    assert runner.k_cache is None
    profiled = runner.profile_peak_bytes(num_pages=17)
    # At least the largest bucket's hidden states (64 tokens x 64 floats) pass through temporaries;
    # far less than the pool itself would be if the KV outputs were not donated in place.
    assert 64 * 64 * 4 <= profiled < 10 * 2**20
    runner.compile_buckets(17, log=lambda _: None)  # against the pool's shapes: nothing allocated
    assert runner.k_cache is None
    every = [compilation.memory_of(c) for _, _, c in runner.compiled.entries()]
    assert len(every) == len(runner.token_buckets) + 3 + 4  # buckets, samplers, the others
    assert runner.peak_program_bytes == kv_sizing.peak_program_bytes(every) >= profiled
    runner.allocate_kv_cache(17)
    c = runner.config  # on the CPU, one pool stacked by layer (Platform.stacked_kv_pool)
    assert runner.k_cache.shape == (c.num_layers, c.num_kv_heads, 17, 16, c.head_dim)


def test_a_pool_whose_arrays_share_memory_is_refused(monkeypatch):
    # What a GPU allocator that cannot place an output does (kv_sizing): hands back another's.
    runner = _runner()
    one = jnp.zeros((2, 17, 16, 16), jnp.float32)
    monkeypatch.setattr(runner.executables, "compile",
                        lambda make: lambda: ([one, jnp.ones_like(one)], [one, one]))
    with pytest.raises(ValueError, match="2 of its arrays got memory of their own, out of 4"):
        runner.allocate_kv_cache(17)
    assert runner.k_cache is None
