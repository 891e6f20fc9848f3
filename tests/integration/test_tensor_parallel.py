"""Tensor parallelism on fake CPU devices (docs/parallelism.md): greedy outputs at
TP = 2, 3, 4 equal TP = 1's (docs/architecture.md, "Testing numerics"), offline here and through
the server in test_tensor_parallel_tiny_server.py (tiny models) and test_multihost.py (the tiny
Llama at TP = 2, its mesh over two processes: the one-host server path plus the step stream); the
step's collectives are the Megatron layout's; sizes the model or the machine cannot take are
refused with an error naming the flag.

Each JAX process with fake devices is a subprocess (``XLA_FLAGS`` is read when JAX starts): the
offline runs share one (``tp_offline`` in conftest.py), the server runs its engine in its own.
"""

import subprocess
import sys

import pytest
from server_utils import REPO

from tests.integration import tp_utils

pytestmark = pytest.mark.slow


# Each run loads its checkpoint per device part: the default model's GGUF and the HF folders
# through lazy tensors, the orbax folder restored straight into its shardings. The orbax Llama at
# TP=2 runs the Pallas kernels (interpret mode) per shard, the others the reference attention.
@pytest.mark.parametrize("name,tp", [("default", 3), ("llama", 4), ("qwen3_moe", 4),
                                     ("llama-orbax", 2)])
def test_offline_greedy_matches_tp1(name, tp, tp_offline, hf_smollm, tiny_hf_models):
    ref, ours = tp_offline[f"{name.removesuffix('-orbax')}:1"], tp_offline[f"{name}:{tp}"]
    assert ours["prompt_ids"] == ref["prompt_ids"]
    hf = hf_smollm if name == "default" else tiny_hf_models[name.removesuffix("-orbax")]
    tp_utils.assert_greedy_matches(ours["output_ids"], ref["output_ids"], ref["prompt_ids"], hf,
                                   f"{name} offline at TP={tp}")


def test_step_collectives_are_megatrons(tp_offline):
    # Tiny Llama, 2 layers, TP=4: an all-reduce after the embedding, after each O and each down
    # projection; one all-gather, of the [S, V] logits (never of a weight).
    tp = 4
    found = tp_offline["collectives"][str(tp)]
    assert found["ops"] == {"all-reduce": 1 + 2 * 2, "all-gather": 1}
    padded_vocab = -(-tp_utils.TINY["llama"][2]["vocab_size"] // tp) * tp
    num_seqs = tp_utils.TP_FLAGS["max_num_seqs"]
    assert found["gathered"][0].startswith(f"f32[{num_seqs},{padded_vocab}]"), found


REFUSED_SIZES = {
    "2": "--tensor-parallel-size 2 does not divide the model's 9 attention heads; sizes that "
         "fit this model: 1, 3",
    "4": "--tensor-parallel-size 4 does not divide the model's 9 attention heads",
    "5": "--tensor-parallel-size 5 exceeds the 4 cpu device(s) JAX sees",
}


def test_server_refuses_sizes_that_do_not_fit():
    # The SmolLM2 shape as dummy weights: the same heads as the default model, nothing to read.
    # The three servers start at once (each is a process start and a refusal).
    procs = {tp: subprocess.Popen(
        [sys.executable, "-m", "jaxserve.serve", "--port", "0", "--model", "smollm2-135m",
         "--load-format", "dummy", "--tensor-parallel-size", tp],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env=tp_utils.fake_devices_env()) for tp in REFUSED_SIZES}
    for tp, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err[-3000:]
        assert REFUSED_SIZES[tp] in err
        assert "Traceback" not in err + out


DUMMY_70B_LAYER = """
import json, jax, jax.numpy as jnp, numpy as np
from jaxserve.config import ModelConfig
from jaxserve.model_loader.dummy import PRESETS
from jaxserve.models import llama, sharding

c = ModelConfig.from_hf_config(PRESETS["llama-3.1-70b"])
_, layer = llama.hf_tensor_shapes(c)
out = {}
for tp in (1, 4):  # one 70B layer drawn in bf16: compiled only, nothing allocated
    ma = llama._random_from_hf.lower(
        jax.random.key(0), tuple(layer.items()), jnp.bfloat16, llama._layer_from_hf,
        sharding.Layout.of(c, tp), sharding.make_mesh(tp)).compile().memory_analysis()
    out[tp] = [ma.output_size_in_bytes, ma.temp_size_in_bytes]
tiny = ModelConfig.from_hf_config({**PRESETS["llama-3.2-1b"], "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": 1001, "head_dim": 16})
one = llama.random_params(tiny, jnp.float32)
two = llama.random_params(tiny, jnp.float32, mesh=sharding.make_mesh(2))
same = {name: bool(np.array_equal(np.asarray(two["layers"][0][name]), np.asarray(one["layers"][0][name])))
        for name in ("o_proj", "down_proj", "input_layernorm")}
same["embed_tokens"] = bool(np.array_equal(np.asarray(two["embed_tokens"])[:1001],
                                           np.asarray(one["embed_tokens"])))
out["same"] = same
print(json.dumps(out))
"""


def test_dummy_weights_are_drawn_per_device():
    import numpy as np

    from jaxserve.config import ModelConfig
    from jaxserve.model_loader.dummy import PRESETS
    from jaxserve.models.llama import hf_tensor_shapes

    found = tp_utils.run_python(DUMMY_70B_LAYER)
    (out1, temp1), (out4, temp4) = found["1"], found["4"]
    _, layer = hf_tensor_shapes(ModelConfig.from_hf_config(PRESETS["llama-3.1-70b"]))
    norms = sum(2 * np.prod(s) for name, s in layer.items() if name.endswith("norm.weight"))
    layer_bytes = sum(2 * np.prod(s) for s in layer.values())  # bf16
    # (XLA counts a few bytes more: the output tuple's pointers.)
    assert 0 <= out1 - layer_bytes < 1024
    assert 0 <= out4 - ((layer_bytes - norms) // 4 + norms) < 1024  # a quarter; norms replicated
    assert temp4 <= temp1 / 4 * 1.05, (temp1, temp4)  # no device draws the whole layer
    assert all(found["same"].values()), found["same"]  # the same values at every mesh size


MOE_TP = """
import json, tempfile
import jax.numpy as jnp, numpy as np, torch, transformers
from safetensors.numpy import load_file
from jaxserve.config import ModelConfig
from jaxserve.models import llama, sharding
from tests.engine.test_model_parity import prompt_logits

shape = dict(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
configs = {
    "mixtral": transformers.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": transformers.Qwen2MoeConfig(**shape, moe_intermediate_size=32, num_experts=6,
                                             shared_expert_intermediate_size=48,
                                             num_experts_per_tok=3),
}
ids = np.random.default_rng(0).integers(0, 301, 48).tolist()
out = {}
for name, config in configs.items():
    torch.manual_seed(0)
    tmp = tempfile.TemporaryDirectory()  # removed once the next replaces it, or at exit
    folder = tmp.name
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    hf_config = json.load(open(folder + "/config.json"))
    weights = load_file(folder + "/model.safetensors")
    c = ModelConfig.from_hf_config(hf_config)
    one = prompt_logits(c, llama.params_from_hf(c, weights, jnp.float32), ids)
    mesh = sharding.make_mesh(2)
    params = llama.params_from_hf(c, weights, jnp.float32, mesh)
    experts = params["layers"][0]["experts_gate_up"]
    two = prompt_logits(c, params, ids, mesh)
    out[name] = {"rel": float(np.abs(two - one).max() / np.abs(one).max()),
                 "expert_shard": list(experts.addressable_shards[0].data.shape)}
# The other families' tiny models, read lazily as a TP server reads them (Phi-3's fused
# tensors as lazy row blocks), and a Llama with biases on every attention projection.
from jaxserve.model_loader import load_hf_folder
from tests.tiny_models import tiny_model
for name in ("gemma2", "gemma3", "phi3", "llama-bias-mha-tied"):
    tmp = tempfile.TemporaryDirectory()
    folder = tmp.name
    tiny_model(name).save_pretrained(folder)
    ckpt = load_hf_folder(folder, with_tokenizer=False, lazy=True)
    c = ModelConfig.from_hf_config(ckpt.hf_config)
    eager = {k: np.asarray(w) for k, w in ckpt.weights.items()}
    one = prompt_logits(c, llama.params_from_hf(c, eager, jnp.float32), ids)
    mesh = sharding.make_mesh(2)
    two = prompt_logits(c, llama.params_from_hf(c, ckpt.weights, jnp.float32, mesh), ids, mesh)
    out[name] = {"rel": float(np.abs(two - one).max() / np.abs(one).max())}
print(json.dumps(out))
"""


def test_moe_and_other_families_logits_at_tp2_equal_tp1():
    """Each expert split by columns over 2 fake devices, and the Gemma and Phi-3 layers (and
    the output projection's bias, replicated) split as Llama's: the same logits as one
    device."""
    found = tp_utils.run_python(MOE_TP, devices=2)
    assert found["mixtral"]["expert_shard"] == [4, 64, 96]  # 4 experts x [E, 2 I / 2]
    assert found["qwen2_moe"]["expert_shard"] == [6, 64, 32]
    assert {"gemma2", "gemma3", "phi3", "llama-bias-mha-tied"} <= set(found)
    assert all(r["rel"] < 1e-5 for r in found.values()), found


MOE_PALLAS_TP = """
import json
import jax, jax.numpy as jnp
from jaxserve.models import moe, sharding
from tests.unit.test_moe_grouped_gemm import _params

mesh = sharding.make_mesh(2)
p = _params(jax.random.key(3), shared=24)
p = jax.device_put(p, sharding.param_shardings(p, mesh))
x = jax.random.normal(jax.random.key(1), (19, 32))
pallas = moe.get_grouped_gemm("pallas", interpret=True)
run = lambda gemm: jax.jit(lambda x, p: moe.sparse_mlp(x, p, 3, True, 2, grouped_gemm=gemm,
                                                       mesh=mesh))(x, p)
ref, out = run(jax.lax.ragged_dot), run(pallas)
print(json.dumps({"rel": float(jnp.abs(out - ref).max() / jnp.abs(ref).max())}))
"""


def test_moe_pallas_grouped_gemm_per_shard_equals_ragged_dot():
    """The Pallas expert GEMMs, which XLA cannot split, run per shard over 2 fake devices
    (``sharding.per_shard_experts``): the block's output is ragged_dot's."""
    assert tp_utils.run_python(MOE_PALLAS_TP, devices=2)["rel"] < 1e-5
