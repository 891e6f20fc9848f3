"""The CPU's layer loop (docs/architecture.md, "The layer loop"): over a KV pool stacked by
layer, the step program holds one layer's kernels whatever the number of layers, where the
per-layer pools of the GPU's layout unroll them."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from pallas_kernels import kv_quant
from pallas_kernels.reference import attention

PAGE, PAGES = 16, 9


def step_fusions(num_layers: int, stacked: bool, tokens: int = 8) -> int:
    """Generated kernels of a compiled step of ``tokens`` tokens of a tiny Llama of
    ``num_layers`` layers."""
    config = ModelConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": num_layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256})
    shape = (config.num_kv_heads, PAGES, PAGE, config.head_dim)
    pool = (jax.ShapeDtypeStruct((num_layers, *shape), jnp.float32) if stacked
            else [jax.ShapeDtypeStruct(shape, jnp.float32)] * num_layers)
    i = np.zeros(tokens, np.int32)
    md = llama.AttentionMetadata(i, i, np.zeros(tokens + 1, np.int32), i,
                                 np.zeros((tokens, 4), np.int32))
    step = jax.jit(lambda p, t, md, k, v: llama.forward(config, p, t, md, k, v, i,
                                                        attention_fn=attention))
    params = llama.random_params(config, jnp.float32)
    hlo = step.lower(params, i, md, pool, pool).compile().as_text()
    # Dots are library calls (kind=kCustom); the other fusions are kernels XLA generates.
    return sum(" fusion(" in line and "kind=kCustom" not in line for line in hlo.splitlines())


def test_step_kernels_do_not_grow_with_the_layers():
    assert step_fusions(8, stacked=True) == step_fusions(2, stacked=True)
    # A 1-token step's dots are matrix-vector products, which XLA emits as kernels of their own
    # in each layer's branch (``linear.LayerSelect``), with their reshapes: 8 a layer; the rest
    # stays one layer's.
    assert step_fusions(8, True, 1) == step_fusions(2, True, 1) + 6 * 8
    assert step_fusions(8, stacked=False) > 3 * step_fusions(2, stacked=False) / 2


def test_pool_layer_reads_and_writes_its_layer_in_place():
    """A PoolLayer's pages read and write as that layer's own pool would, FP8 pools too."""
    rng = np.random.default_rng(0)
    stacked = jnp.asarray(rng.normal(size=(3, 2, 5, PAGE, 8)), jnp.float32)
    pages, slots = np.array([[4, 1], [2, 2]], np.int32), np.array([17, 40, 3], np.int32)
    k = jnp.asarray(rng.normal(size=(3, 2, 8)), jnp.float32)
    for pool in (stacked, kv_quant.quantize_pages(stacked)):
        layer = kv_quant.pool_layer.PoolLayer(pool, 1)
        one = jax.tree.map(lambda a: a[1], pool)
        np.testing.assert_array_equal(kv_quant.read_pages(layer, pages),
                                      kv_quant.read_pages(one, pages))
        wrote, _ = llama.write_kv(layer, layer, k, k, slots)
        want, _ = llama.write_kv(one, one, k, k, slots)
        np.testing.assert_array_equal(kv_quant.read_pages(wrote, pages[0]),
                                      kv_quant.read_pages(want, pages[0]))
        # The other layers as they were.
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[::2], b[::2]), wrote.pool, pool)


def test_page_copies_of_a_stacked_pool_are_its_layers_copies():
    from jaxserve.worker.programs import _copy_pages

    rng = np.random.default_rng(1)
    stacked = jnp.asarray(rng.normal(size=(3, 2, 6, PAGE, 8)), jnp.float32)
    src, dst = np.array([2, 5, 0], np.int32), np.array([4, 1, 0], np.int32)
    for pool in (stacked, kv_quant.quantize_pages(stacked)):
        layers = [jax.tree.map(lambda a, i=i: a[i], pool) for i in range(3)]
        k, _ = _copy_pages(pool, pool, src, dst)
        want, _ = _copy_pages(layers, layers, src, dst)
        for i, layer in enumerate(want):
            jax.tree.map(lambda a, b, i=i: np.testing.assert_array_equal(a[i], b), k, layer)
