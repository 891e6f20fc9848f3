"""FP8 linear projections (``jaxserve.models.linear``): the quantized product against the float32
one, saturation, the tensor-parallel specs of an FP8 weight, and the same logits at TP = 1 and 2
(fake CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.models import sharding
from jaxserve.models.linear import FP8_DTYPE, Fp8Weight, linear, quantize_rows, quantize_weight
from tests.integration import tp_utils


def test_fp8_product_is_close_to_float32():
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (16, 256), jnp.float32)
    # Channels of very different sizes: per-channel scales keep each one's relative error.
    w = jax.random.normal(kw, (256, 64), jnp.float32) * jnp.logspace(-3, 1, 64)[None, :]
    q = quantize_weight(w)
    assert q.weight.dtype == FP8_DTYPE and q.weight.shape == (64, 256) and q.scale.shape == (64,)
    out = np.asarray(linear(x, q))
    assert out.dtype == np.float32
    # The product is the dequantized operands' product (float32 accumulation and scaling).
    xq, xs = quantize_rows(x)
    deq_x = np.asarray(xq.astype(jnp.float32)) * np.asarray(xs)[:, None]
    deq_w = (np.asarray(q.weight.astype(jnp.float32)) * np.asarray(q.scale)[:, None]).T
    np.testing.assert_allclose(out, deq_x @ deq_w, rtol=1e-4, atol=1e-6 * np.abs(out).max())
    # Each operand within half a step of e4m3 (3 mantissa bits: 2^-4 of the value; at least
    # the subnormal step 2^-9 of the scale) of its float32 value.
    for deq, orig, scale in ((deq_x, x, xs[:, None]), (deq_w, w, q.scale[None, :])):
        orig, scale = np.asarray(orig), np.asarray(scale)
        assert np.all(np.abs(deq - orig) <= np.abs(orig) * 2**-4 + scale * 2**-9 + 1e-30)
    # So each channel's product is within a few percent of float32's (errors of 256 terms).
    ref = np.asarray(x @ w)
    err = np.linalg.norm(out - ref, axis=0) / np.linalg.norm(ref, axis=0)
    assert err.max() < 0.08 and err.mean() < 0.05, (err.max(), err.mean())


def test_saturating_and_zero_rows():
    x = jnp.array([[1e30, -3e29, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], jnp.float32)
    xq, scale = quantize_rows(x)
    assert np.isfinite(np.asarray(xq.astype(jnp.float32))).all()
    assert float(jnp.abs(xq.astype(jnp.float32)).max()) == 448.0
    assert np.asarray(xq[1].astype(jnp.float32)).tolist() == [0.0] * 4
    w = quantize_weight(jnp.eye(4, dtype=jnp.float32))
    y = np.asarray(linear(x, w))
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y[0, :2], [1e30, -3e29], rtol=0.07)
    assert y[1].tolist() == [0.0] * 4
    # bfloat16 activations give bfloat16 outputs.
    assert linear(x.astype(jnp.bfloat16), w).dtype == jnp.bfloat16


def test_bfloat16_product_within_a_rounding_of_the_float32_one():
    """bfloat16 activations take the FP8 product in bfloat16: the dequantized operands'
    product within bfloat16's rounding (twice: the product, then the scaled output)."""
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (16, 256), jnp.float32).astype(jnp.bfloat16)
    q = quantize_weight(jax.random.normal(kw, (256, 64), jnp.float32))
    out = np.asarray(linear(x, q).astype(jnp.float32))
    xq, xs = quantize_rows(x)
    deq_x = np.asarray(xq.astype(jnp.float32)) * np.asarray(xs)[:, None]
    deq_w = (np.asarray(q.weight.astype(jnp.float32)) * np.asarray(q.scale)[:, None]).T
    ref = deq_x @ deq_w
    np.testing.assert_allclose(out, ref, rtol=2 * 2.0**-8, atol=1e-3 * np.abs(ref).max())
    dots = [e for e in jax.make_jaxpr(linear)(x, q).eqns if e.primitive.name == "dot_general"]
    assert [e.params["preferred_element_type"] for e in dots] == [jnp.bfloat16]


def test_fp8_weight_specs_follow_the_plain_weights():
    mesh = Mesh(np.array(jax.devices()[:1]), (sharding.AXIS,))
    fp8 = Fp8Weight(jnp.zeros((8, 4), FP8_DTYPE), jnp.ones((8,)))
    layer = {"qkv_proj": fp8, "o_proj": fp8, "gate_up_proj": fp8, "down_proj": fp8,
             "input_layernorm": jnp.ones(4)}
    specs = sharding.param_shardings(layer, mesh)
    # Column-parallel ([in, out] split on out): rows of the [out, in] weight and the scales.
    for name in ("qkv_proj", "gate_up_proj"):
        assert specs[name].weight.spec == P(sharding.AXIS, None)
        assert specs[name].scale.spec == P(sharding.AXIS)
    # Row-parallel ([in, out] split on in): the weight's columns; the scales replicated.
    for name in ("o_proj", "down_proj"):
        assert specs[name].weight.spec == P(None, sharding.AXIS)
        assert specs[name].scale.spec == P(None)
    assert specs["input_layernorm"].spec == P()


def test_an_unknown_quantization_is_refused():
    from jaxserve.models.registry import build_params

    with pytest.raises(ValueError, match="unsupported --quantization 'int4'"):
        build_params({"architectures": ["LlamaForCausalLM"]}, None, jnp.float32,
                     quantization="int4")


CODE = """
import json
import jax, jax.numpy as jnp, numpy as np
from jaxserve.config import ModelConfig
from jaxserve.models import llama, sharding
from pallas_kernels import get_attention_fn
cfg = ModelConfig.from_hf_config(dict(architectures=["LlamaForCausalLM"], vocab_size=301,
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64))
out = {}
for tp in (1, 2):
    mesh = sharding.make_mesh(tp)
    params = llama.random_params(cfg, jnp.float32, seed=3, mesh=mesh, quantization="fp8")
    layout = sharding.Layout.of(cfg, tp)
    pool = jnp.zeros((layout.num_kv_heads, 3, 16, cfg.head_dim), jnp.float32)
    if mesh is not None:
        pool = jax.device_put(pool, sharding.kv_sharding(mesh))
    n = 12
    md = llama.AttentionMetadata(positions=np.arange(n, dtype=np.int32),
        slot_mapping=np.arange(16, 16 + n, dtype=np.int32),
        query_start_loc=np.array([0, n], np.int32), seq_lens=np.array([n], np.int32),
        block_tables=np.array([[1, 2]], np.int32))
    logits, _, _ = jax.jit(lambda p, k, v: llama.forward(cfg, p, jnp.arange(n) * 7, md, [k] * 2,
        [v] * 2, jnp.arange(n), attention_fn=get_attention_fn("reference"), mesh=mesh))(
        params, pool, pool)
    out[tp] = np.asarray(logits).tolist()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_fp8_logits_equal_at_tp1_and_tp2():
    # Per-channel weight scales are the same whole or split (a row-parallel weight's come from
    # an all-reduced max), and so are the per-token activation scales.
    out = tp_utils.run_python(CODE, devices=2)
    a, b = np.array(out["1"]), np.array(out["2"])
    assert np.abs(a).max() > 0.01
    np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-4)
