"""A step that fails on the device (injected) ends only the requests in it: EngineCore's
``recover_from_failed_step`` with the shared default-model engine; and ModelRunner's
``device_state_ok``, which tells the engine process whether it can go on, on a tiny model."""

import jax.numpy as jnp

from tests.conftest import SMALL_ENGINE
from jaxserve import SamplingParams
from jaxserve.engine import EngineCoreRequest
from jaxserve.models.registry import build_params
from jaxserve.worker.model_runner import ModelRunner
from pallas_kernels.reference import attention


def test_a_failed_step_ends_only_its_requests(smollm_llm, monkeypatch):
    core = smollm_llm.engine
    seqs = SMALL_ENGINE["max_num_seqs"]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = smollm_llm.tokenizer.encode("The capital of France is")
    # One more request than runs at once: the last one waits outside the failing steps.
    ids = [f"r{i}" for i in range(seqs + 1)]
    for rid in ids:
        core.add_request(EngineCoreRequest(rid, prompt, sp))
    core.step()  # the first seqs requests' prefill, dispatched

    runner, real = core.runner, core.runner.get_output
    failures = []

    def fail_once(handle):
        if not failures:
            failures.append(handle.step)
            raise RuntimeError("injected device failure")
        return real(handle)

    monkeypatch.setattr(runner, "get_output", fail_once)
    try:
        core.step()
        raise AssertionError("the injected failure did not surface")
    except RuntimeError as e:
        assert "injected" in str(e)
    failed, usable = core.recover_from_failed_step()
    assert failed == sorted(ids[:seqs]) and usable

    tokens = {}
    while core.has_unfinished_requests():
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert list(tokens) == [ids[-1]] and len(tokens[ids[-1]]) == 4
    assert core.scheduler.kv.usage() == 0  # the failed requests' pages came back


def test_device_state_ok_until_a_pool_array_is_lost():
    tiny = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 256}
    config, params = build_params(tiny, None, jnp.float32, 0)
    runner = ModelRunner(config, params, page_size=16, max_num_seqs=4, max_num_batched_tokens=16,
                         max_model_len=256, kv_dtype=jnp.float32, attention_fn=attention)
    runner.allocate_kv_cache(17)
    assert runner.device_state_ok()
    # What a program that failed after the pool was donated to it leaves behind.
    runner.v_cache.delete()
    assert not runner.device_state_ok()
    runner.v_cache = jnp.zeros(runner.k_cache.shape, runner.k_cache.dtype)
    assert runner.device_state_ok()
