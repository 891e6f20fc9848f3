"""The tensor-parallel layout as arithmetic (jaxserve/models/sharding.py): which sizes a
model takes (vLLM's rule), how KV heads are replicated and the vocabulary padded, how the fused
projections' columns are laid out shard by shard, and the KV bytes each device holds. The runs on
fake devices are in tests/integration/test_tensor_parallel.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine.core import kv_bytes_per_page
from jaxserve.model_loader.dummy import PRESETS
from jaxserve.models import llama, sharding


def preset(name: str) -> ModelConfig:
    return ModelConfig.from_hf_config(PRESETS[name])


@pytest.mark.parametrize("name,fits", [
    ("smollm2-135m", [1, 3]),  # 9 heads, 3 KV heads, intermediate 1536
    ("llama-3.1-8b", [1, 2, 4, 8, 16, 32]),  # 32 heads, 8 KV heads: 16 and 32 replicate them
    ("qwen2.5-0.5b", [1, 2]),  # 14 heads, 2 KV heads, intermediate 4864: 7 and 14 do not divide it
])
def test_sizes_a_model_takes(name, fits):
    c = preset(name)
    for tp in range(1, c.num_heads + 1):
        if tp in fits:
            sharding.check_tensor_parallel(c, tp)
        else:
            with pytest.raises(ValueError, match=f"--tensor-parallel-size {tp} does not divide"):
                sharding.check_tensor_parallel(c, tp)


def test_refusal_names_the_flag_and_the_sizes_that_fit():
    with pytest.raises(ValueError) as e:
        sharding.check_tensor_parallel(preset("smollm2-135m"), 2)
    assert str(e.value) == ("--tensor-parallel-size 2 does not divide the model's 9 attention "
                            "heads; sizes that fit this model: 1, 3")


def test_more_devices_than_there_are_is_refused():
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 exceeds the 1 cpu device"):
        sharding.make_mesh(2)
    assert sharding.make_mesh(1) is None  # one device: no mesh, the unsharded program


def test_layout_replicates_kv_heads_past_the_mesh_and_pads_the_vocabulary():
    c = preset("llama-3.1-8b")  # 8 KV heads, vocabulary 128256
    assert sharding.Layout.of(c, 4) == sharding.Layout(4, 8, 1, 128256)
    assert sharding.Layout.of(c, 16) == sharding.Layout(16, 16, 2, 128256)
    assert sharding.Layout.of(c, 32).kv_heads_per_device == 1
    s = preset("smollm2-135m")
    assert sharding.Layout.of(s, 3) == sharding.Layout(3, 3, 1, 49152)
    odd = ModelConfig.from_hf_config({**PRESETS["llama-3.2-1b"], "vocab_size": 1001})
    assert sharding.Layout.of(odd, 4).vocab_size == 1004


def test_kv_bytes_per_page_are_one_devices():
    c = preset("llama-3.1-8b")
    one = kv_bytes_per_page(c, sharding.Layout.of(c, 1), c.head_dim, 16, jnp.bfloat16)
    assert one == 2 * 32 * 8 * 16 * 128 * 2
    assert kv_bytes_per_page(c, sharding.Layout.of(c, 4), c.head_dim, 16, jnp.bfloat16) == one // 4
    # Replicated past 8 devices: each still holds one KV head.
    assert kv_bytes_per_page(c, sharding.Layout.of(c, 16), c.head_dim, 16, jnp.bfloat16) == one // 8


def test_fused_columns_run_shard_by_shard():
    q, k, v = (np.arange(2 * n).reshape(2, n) + 100 * i for i, n in enumerate((8, 4, 4)))
    assert (llama._columns_by_shard([q, k, v], 1) == np.concatenate([q, k, v], axis=1)).all()
    fused = np.asarray(llama._columns_by_shard([q, k, v], 2))
    # Device 0 gets the first half of q, k and v; device 1 the second halves.
    assert (fused[:, :8] == np.concatenate([q[:, :4], k[:, :2], v[:, :2]], axis=1)).all()
    assert (fused[:, 8:] == np.concatenate([q[:, 4:], k[:, 2:], v[:, 2:]], axis=1)).all()
    # Biases (Qwen2) the same way.
    bias = np.asarray(llama._columns_by_shard([q[0], k[0], v[0]], 2))
    assert (bias == fused[0]).all()


def test_kv_heads_are_repeated_head_by_head():
    c = ModelConfig.from_hf_config({**PRESETS["llama-3.2-1b"], "num_key_value_heads": 2})
    layout = sharding.Layout.of(c, 4)  # 2 KV heads over 4 devices: each twice
    w = np.arange(2 * 3 * 5).reshape(2 * 3, 5)  # 2 heads of head_dim 3, 5 inputs
    out = np.asarray(llama._repeat_kv_heads(w, layout))
    assert (out == np.concatenate([w[:3], w[:3], w[3:], w[3:]])).all()
    assert llama._repeat_kv_heads(w, sharding.Layout.of(c, 2)) is w


@pytest.mark.parametrize("flags,error", [
    (["--num-hosts", "2", "--host-id", "2"], "argument --host-id: --host-id 2 must be below --num-hosts 2"),
    (["--host-id", "1"], "argument --host-id: --host-id 1 must be below --num-hosts 1"),
    (["--tensor-parallel-size", "0"], "argument --tensor-parallel-size: must be positive, got 0"),
])
def test_parallel_flags_refuse_bad_values(flags, error, capsys):
    from jaxserve import serve

    assert serve.main(flags) == 2
    assert capsys.readouterr().err.strip() == f"python -m jaxserve.serve: error: {error}"
