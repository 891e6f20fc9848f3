"""LoRA's pieces without a server (docs/lora.md): the batched delta against a per-token loop,
an adapter's pool rows against its merged weights (fused q/k/v and gate/up, shard by shard,
KV heads replicated), the same logits at tensor-parallel sizes 1 and 2 (fake CPU devices), the
scheduler's ``max_loras`` rule, prefix-cache keys per adapter, and vLLM's
``lora_requests_info`` gauge, what ``--enable-lora`` refuses, and ``adapter_config.json``'s
checks."""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine import EngineCoreRequest
from jaxserve.lora.checkpoint import LoRAAdapter, LoRAShapes
from jaxserve.lora.layers import FUSED, LoRALinear, lora_delta, slot_rows
from jaxserve.lora.request import LoRARequest
from jaxserve.models import llama, sharding
from jaxserve.models.linear import linear
from jaxserve.sampling_params import SamplingParams
from tests.integration import tp_utils
from tests.unit.kv_fakes import FakeRunner, run_to_completion

CONFIG = dict(architectures=["LlamaForCausalLM"], vocab_size=301, hidden_size=64,
              intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=1, max_position_embeddings=64)


def test_delta_equals_a_per_token_loop():
    rng = np.random.default_rng(0)
    L, T, n_in, k, n_out = 3, 7, 10, 4, 5
    x = rng.normal(size=(T, n_in)).astype(np.float32)
    a = rng.normal(size=(L, n_in, k)).astype(np.float32)
    b = rng.normal(size=(L, k, n_out)).astype(np.float32)
    slots = np.array([0, 1, 3, 2, 0, 3, 1], np.int32)
    ref = np.stack([x[t] @ a[s - 1] @ b[s - 1] if s else np.zeros(n_out, np.float32)
                    for t, s in enumerate(slots)])
    np.testing.assert_allclose(np.asarray(lora_delta(x, a, b, slots)), ref, rtol=1e-5, atol=1e-5)
    w = rng.normal(size=(n_in, n_out)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(linear(x, LoRALinear(w, a, b), slots)), x @ w + ref,
                               rtol=1e-5, atol=1e-5)


def _adapter(shapes: LoRAShapes, rank: int, seed: int) -> LoRAAdapter:
    """A random adapter on every module of every layer but layer 1's k_proj."""
    rng = np.random.default_rng(seed)
    weights = {(i, m): (rng.normal(size=(rank, n_in)).astype(np.float32),
                        rng.normal(size=(n_out, rank)).astype(np.float32))
               for i in range(shapes.num_layers) for m, (n_in, n_out) in shapes.modules.items()
               if (i, m) != (1, "k_proj")}
    return LoRAAdapter(rank, 0.5, weights)


@pytest.mark.parametrize("tp", [1, 2])  # 2: one KV head replicated on both devices
def test_pool_rows_give_the_merged_weights(tp):
    """x through a fused projection with the adapter in slot 2 of 3 equals x through the fused
    merged weights W + s B A, built as the base weights are (``llama._fuse``, shard by shard)."""
    config = ModelConfig.from_hf_config(CONFIG)
    shapes, layout, max_rank = LoRAShapes.of(config), sharding.Layout.of(config, tp), 4
    adapter = _adapter(shapes, rank=3, seed=tp)
    rows = slot_rows(adapter, shapes, layout, max_rank, np.float32)
    rng = np.random.default_rng(9)
    for layer in range(config.num_layers):
        for name, modules in FUSED.items():
            base, merged = [], []
            for m in modules:
                n_in, n_out = shapes.modules[m]
                w = rng.normal(size=(n_out, n_in)).astype(np.float32)
                a_b = adapter.weights.get((layer, m))
                delta = 0 if a_b is None else adapter.scaling * a_b[1] @ a_b[0]
                kv = m in ("k_proj", "v_proj")
                rep = (lambda t: llama._repeat_kv_heads(t, layout)) if kv else (lambda t: t)
                base.append(rep(w))
                merged.append(rep(w + delta))
            a, b = rows[layer][name]
            pool_a = np.zeros((3, *a.shape), np.float32)
            pool_b = np.zeros((3, *b.shape), np.float32)
            pool_a[1], pool_b[1] = a, b
            x = rng.normal(size=(4, a.shape[0])).astype(np.float32)
            got = linear(x, LoRALinear(llama._fuse(base, tp), pool_a, pool_b),
                         np.full(4, 2, np.int32))
            np.testing.assert_allclose(np.asarray(got), np.asarray(x @ llama._fuse(merged, tp)),
                                       rtol=1e-4, atol=1e-4)


def test_pool_specs_follow_the_base_weights():
    """The step's in_shardings (``sharding.param_shardings``) of a layer with pools: the base
    weight as without adapters, b split with a column-parallel weight's columns, a with a
    row-parallel weight's rows."""
    import jax
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), (sharding.AXIS,))
    w, pool = jnp.zeros((4, 8)), jnp.zeros((2, 4, 3))
    layer = {name: LoRALinear(w, pool, pool) for name in FUSED}
    specs = sharding.param_shardings(layer, mesh)
    tp = sharding.AXIS
    for name in ("qkv_proj", "gate_up_proj"):
        assert (specs[name].base.spec, specs[name].a.spec, specs[name].b.spec) == (
            P(None, tp), P(None, None, None), P(None, None, tp))
    for name in ("o_proj", "down_proj"):
        assert (specs[name].base.spec, specs[name].a.spec, specs[name].b.spec) == (
            P(tp, None), P(None, tp, None), P(None, None, None))


TP_CODE = """
import json
import jax, jax.numpy as jnp, numpy as np
from jaxserve.config import ModelConfig
from jaxserve.lora.checkpoint import LoRAShapes
from jaxserve.lora.layers import add_pool, pool_of, slot_bytes, slot_rows
from jaxserve.lora.manager import LoRAModelManager
from jaxserve.models import llama, sharding
from pallas_kernels import get_attention_fn
from tests.unit.test_lora import CONFIG, _adapter
cfg = ModelConfig.from_hf_config(CONFIG)
shapes = LoRAShapes.of(cfg)
out = {}
for tp in (1, 2):
    mesh = sharding.make_mesh(tp)
    layout = sharding.Layout.of(cfg, tp)
    base = llama.random_params(cfg, jnp.float32, seed=3, mesh=mesh)
    params = add_pool(base, 2, 4, jnp.float32, mesh)
    # slot_bytes against the pools' bytes per slot, in all and on device 0
    pools = jax.tree.leaves(pool_of(params))
    out[f"bytes{tp}"] = [list(slot_bytes(base, 4, jnp.float32, mesh)), [
        sum(x.nbytes for x in pools) // 2, sum(s.data.nbytes for x in pools
        for s in x.addressable_shards if s.device == jax.devices()[0]) // 2]]
    manager = LoRAModelManager(params, shapes, layout, 2, 4, 2, mesh)
    manager.host[7] = slot_rows(_adapter(shapes, 3, 0), shapes, layout, 4, np.float32)
    params, slots = manager.activate(params, np.array([7, 0], np.int32))
    pool = jnp.zeros((layout.num_kv_heads, 3, 16, cfg.head_dim), jnp.float32)
    if mesh is not None:
        pool = jax.device_put(pool, sharding.kv_sharding(mesh))
    n = 12  # two sequences of 6 tokens: the adapter's, then the base model's
    md = llama.AttentionMetadata(positions=np.tile(np.arange(6, dtype=np.int32), 2),
        slot_mapping=np.r_[16:22, 32:38].astype(np.int32),
        query_start_loc=np.array([0, 6, 12], np.int32), seq_lens=np.array([6, 6], np.int32),
        block_tables=np.array([[1], [2]], np.int32))
    lora_slots = np.repeat(slots, 6)
    logits, _, _ = jax.jit(lambda p, k, v: llama.forward(cfg, p, jnp.arange(n) * 7 % 301, md,
        [k] * 2, [v] * 2, jnp.array([5, 11]), attention_fn=get_attention_fn("reference"),
        mesh=mesh, lora_slots=lora_slots))(params, pool, pool)
    out[tp] = np.asarray(logits).tolist()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_logits_equal_at_tp1_and_tp2():
    """A step of an adapter's row and a base row: the same logits over 2 fake devices (the
    pools split with their base weights) as on one. And ``slot_bytes`` on each device is what
    the split pools hold there."""
    out = tp_utils.run_python(TP_CODE, devices=2)
    (whole, each), measured = out["bytes2"]
    assert [whole, each] == measured and each < whole
    a, b = np.array(out["1"]), np.array(out["2"])
    np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-4)


def _request(rid: str, prompt: list[int], lora_id: int) -> Request:
    lora = LoRARequest(f"a{lora_id}", lora_id, "/nowhere") if lora_id else None
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    return Request(EngineCoreRequest(rid, prompt, sp, lora_request=lora), seed=0)


def test_running_requests_use_at_most_max_loras_adapters():
    sched = Scheduler(KVCacheManager(256, 4), max_num_seqs=8, max_num_batched_tokens=64,
                      max_model_len=128, eos_token_ids=(0,), max_loras=2)
    for i, lora_id in enumerate([1, 2, 0, 3, 1, 2, 3, 0]):
        sched.add_request(_request(str(i), [10 + i] * 5, lora_id))

    def check(out):
        assert len({r.lora_int_id for r in sched.running} - {0}) <= 2

    done = run_to_completion(sched, FakeRunner(256, 4), on_step=check)
    assert len(done) == 8


def test_a_request_waiting_for_an_adapter_slot_holds_up_only_adapters_requests():
    """Adapters 1 and 2 run (max_loras 2); adapter 3's request waits for a slot: the base
    model's requests behind it start at once, adapter 1's behind it wait with it (so adapter 1
    drains), and it starts once a running adapter's last request has finished."""
    sched = Scheduler(KVCacheManager(256, 4), max_num_seqs=8, max_num_batched_tokens=64,
                      max_model_len=128, eos_token_ids=(0,), max_loras=2)
    for i, lora_id in enumerate([1, 2, 3, 0, 1, 0]):
        sched.add_request(_request(str(i), [10 + i] * 5, lora_id))
    steps = []

    def record(out):
        steps.append([r.req_id for r in out.new_reqs])
        if len(steps) == 1:
            assert [r.request_id for r in sched.waiting] == ["2", "4"]  # in order

    done = run_to_completion(sched, FakeRunner(256, 4), on_step=record)
    assert len(done) == 6 and steps[0] == ["0", "1", "3", "5"]
    start = {rid: i for i, step in enumerate(steps) for rid in step}
    assert start["2"] <= start["4"]  # adapter 1's later request never passes adapter 3


def test_prefix_cache_pages_are_keyed_by_adapter():
    kv = KVCacheManager(64, 4)
    prompt = list(range(20, 33))
    first = _request("a", prompt, 1)
    assert kv.allocate_slots(first, len(prompt))
    first.num_computed_tokens = len(prompt)  # as the scheduler has it after the step
    kv.cache_full_pages(first)
    assert len(kv.get_computed_pages(_request("b", prompt, 1))) == 3  # same adapter: hits
    assert kv.get_computed_pages(_request("c", prompt, 2)) == []  # another adapter
    assert kv.get_computed_pages(_request("d", prompt, 0)) == []  # the base model


def test_lora_requests_info_gauge_has_vllms_name_and_labels():
    from jaxserve.engine import SchedulerStats
    from jaxserve.metrics import Metrics

    m = Metrics("m", "vllm", max_loras=4)
    m.update_stats(SchedulerStats(running_lora_adapters=["a", "b"], waiting_lora_adapters=["c"]))
    (family,) = [f for f in m.registry.collect() if f.name == "vllm:lora_requests_info"]
    (sample,) = family.samples
    assert sample.labels == {"max_lora": "4", "waiting_lora_adapters": "c",
                             "running_lora_adapters": "a,b"}
    assert sample.value == m.stats_time
    assert not [f for f in Metrics("m").registry.collect() if "lora" in f.name]


@pytest.mark.parametrize("change, says", [
    ({"num_experts": 4}, "a mixture-of-experts model"),
    ({"quantization": "fp8"}, "FP8 weights (fp8; --quantization)"),
    ({"num_hosts": 2}, "--num-hosts 2")])
def test_what_lora_refuses_at_start_up_names_the_flags(change, says):
    from types import SimpleNamespace

    from jaxserve.lora import manager

    model_config = dataclasses.replace(ModelConfig.from_hf_config(CONFIG),
                                       num_experts=change.get("num_experts", 0))
    config = SimpleNamespace(num_hosts=change.get("num_hosts", 1))
    with pytest.raises(ValueError, match=f"^--enable-lora does not support {re.escape(says)}$"):
        manager.create(config, model_config, {}, change.get("quantization"), None, print,
                       None, None)


def test_slot_bytes_are_the_pools_bytes_per_slot():
    """``layers.slot_bytes`` (what the start-up memory check counts) equals the bytes of the
    pools ``add_pool`` allocates, per slot (2 devices: ``test_logits_equal_at_tp1_and_tp2``)."""
    import jax

    from jaxserve.lora.layers import add_pool, pool_of, slot_bytes

    params = llama.random_params(ModelConfig.from_hf_config(CONFIG), jnp.float32)
    whole, each = slot_bytes(params, 8, jnp.bfloat16)
    pool = jax.tree.leaves(pool_of(add_pool(params, 3, 8, jnp.bfloat16)))
    assert whole == each == sum(x.nbytes for x in pool) // 3


def test_what_lora_refuses_for_memory_it_refuses_before_allocating():
    """``manager.create`` counts the pool and the host cache (``slot_bytes``) against the room
    it is given (``kv_sizing.lora_memory_problem``'s arithmetic: test_kv_sizing) and refuses
    before it allocates anything; what fits is created."""
    from types import SimpleNamespace

    from jaxserve.lora import manager
    from jaxserve.lora.layers import slot_bytes

    config = SimpleNamespace(num_hosts=1, max_loras=4, max_cpu_loras=None, max_lora_rank=8)
    model_config = ModelConfig.from_hf_config(CONFIG)
    params = llama.random_params(model_config, jnp.float32)
    slot = slot_bytes(params, 8, jnp.float32)[0]
    with pytest.raises(ValueError, match="^--max-loras 4 with --max-lora-rank 8: the LoRA pool"):
        manager.create(config, model_config, params, None, None, print, 4 * slot - 1, None)
    with pytest.raises(ValueError, match="^--max-cpu-loras 4 with --max-lora-rank 8: the LoRA "):
        manager.create(config, model_config, params, None, None, print, 4 * slot, 4 * slot - 1)
    with pytest.raises(ValueError, match="^--max-loras 4 and --max-cpu-loras 4 with "):
        manager.create(config, model_config, params, None, None, print, None, 8 * slot - 1)
    params, lora = manager.create(config, model_config, params, None, None, print, None,
                                  8 * slot)
    assert lora.max_loras == lora.max_cpu_loras == 4
    assert params["layers"][0]["o_proj"].a.shape[0] == 4


def test_host_cache_spares_the_adapters_in_use(tmp_path):
    """Past --max-cpu-loras the least recently used adapters leave the host, except those of
    waiting or running requests (``in_use``); the device slots go least recently used first,
    sparing the step's own."""
    from jaxserve.lora.layers import add_pool
    from jaxserve.lora.manager import LoRAModelManager
    from scripts.make_lora_adapters import write_adapter

    config = ModelConfig.from_hf_config(CONFIG)
    shapes = LoRAShapes.of(config)
    params = add_pool(llama.random_params(config, jnp.float32), 2, 4, jnp.float32)
    manager = LoRAModelManager(params, shapes, sharding.Layout.of(config, 1), 2, 4, 1)
    loras = {}
    for i in (1, 2, 3):
        write_adapter(tmp_path / str(i), shapes, 2, 0.1, np.float32, seed=i)
        loras[i] = LoRARequest(str(i), i, str(tmp_path / str(i)))
    manager.add_lora(loras[1])
    manager.add_lora(loras[2], in_use=lambda: {1})
    assert list(manager.host) == [1, 2]  # 1 is in use: the cache holds two for now
    params, slots = manager.activate(params, np.array([1, 0, 2], np.int32))
    assert slots.tolist() == [1, 0, 2]
    manager.add_lora(loras[3], in_use=lambda: {3})
    assert list(manager.host) == [3]
    params, slots = manager.activate(params, np.array([3, 2], np.int32))
    assert slots.tolist() == [1, 2]  # 3 took 1's slot (the least recently used), 2 kept its
    assert list(manager.resident) == [2, 3]
    o_proj = params["layers"][0]["o_proj"]
    assert np.asarray(o_proj.a[0])[:, :2].any() and np.asarray(o_proj.b[1]).any()


@pytest.mark.parametrize("edit, says", [
    ({"peft_type": None}, None),  # read as LoRA, as vLLM reads it
    ({"peft_type": "IA3"}, "adapter_config.json: peft_type 'IA3': only LoRA adapters "
                           "(peft_type 'LORA') are served"),
    ({"r": 0}, "adapter_config.json: r: Input should be greater than 0"),
    ({"lora_alpha": None}, "adapter_config.json: lora_alpha: field required"),
    ({"target_modules": [1]}, "adapter_config.json: target_modules: Input should be a valid "
                              "string"),
    ({"lora_bias": True}, "unsupported PEFT options ['lora_bias']")])
def test_adapter_config_is_checked_field_by_field(tmp_path, edit, says):
    """adapter_config.json (what PEFT writes, ``write_adapter``'s) with one field changed
    (None: left out): refused in one line naming the field, or read."""
    import json

    from jaxserve.lora.checkpoint import CONFIG_NAME, read_adapter
    from scripts.make_lora_adapters import write_adapter

    shapes = LoRAShapes.of(ModelConfig.from_hf_config(CONFIG))
    write_adapter(tmp_path, shapes, 2, 0.1, np.float32, seed=0)
    fields = {**json.loads((tmp_path / CONFIG_NAME).read_text()), **edit}
    (tmp_path / CONFIG_NAME).write_text(json.dumps({k: v for k, v in fields.items()
                                                    if v is not None}))
    if says is None:
        assert read_adapter(str(tmp_path), shapes, 4).rank == 2
    else:
        with pytest.raises(ValueError, match=f"^LoRA adapter {tmp_path}: {re.escape(says)}$"):
            read_adapter(str(tmp_path), shapes, 4)


def test_a_pickled_adapter_is_refused_by_name(tmp_path):
    """PEFT's older adapter_model.bin (a pickle, which runs code as it loads) is not read: the
    refusal says so and how to save the adapter instead."""
    from jaxserve.lora.checkpoint import WEIGHTS_NAME, read_adapter
    from scripts.make_lora_adapters import write_adapter

    shapes = LoRAShapes.of(ModelConfig.from_hf_config(CONFIG))
    write_adapter(tmp_path, shapes, 2, 0.1, np.float32, seed=0)
    (tmp_path / WEIGHTS_NAME).rename(tmp_path / "adapter_model.bin")
    with pytest.raises(ValueError, match="no adapter_model.safetensors in the folder \\(its "
                                         "adapter_model.bin, a pickle, is not read"):
        read_adapter(str(tmp_path), shapes, 4)
