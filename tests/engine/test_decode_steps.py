"""Decode-only steps (``Platform.decode_steps``: a second step program for the small token
buckets, whose attention skips the ragged-prefill kernel) give HF's greedy tokens, with the
Pallas kernels interpreted on the CPU, and steps of one-token decodes take them while steps
with a prompt chunk or a forked choice's empty row do not."""

import dataclasses

import numpy as np

from jaxserve.platforms import CPU
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.compilation import decode_buckets
from tests.greedy import assert_equals_hf_greedy
from tests.tiny_models import TINY, save_tiny_model

ENGINE = dict(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4, kv_cache_gib=0.01,
              attention_backend="pallas", log=lambda s: None)


def test_decode_buckets():
    assert decode_buckets([16, 32, 64, 128, 256, 512, 8192], 256) == (16, 32, 64, 128, 256)
    assert decode_buckets([16, 32, 64, 128, 256], 100) == (16, 32, 64, 128)
    assert decode_buckets([1, 2, 4, 8], 32) == (1, 2, 4, 8)


def test_decode_steps_equal_hf_greedy(tmp_path, smollm, monkeypatch):
    from jaxserve import LLM
    from jaxserve.worker import model_runner

    # windows of 40 from layer 1 on: prompts and outputs pass them
    hf_model = save_tiny_model("qwen2-windows-from-layer-1", tmp_path, smollm.tokenizer)
    platform = dataclasses.replace(CPU, decode_steps=True)
    monkeypatch.setattr(model_runner, "current_platform", lambda: platform)
    llm = LLM(str(tmp_path), **ENGINE)
    runner = llm.engine.runner
    assert set(runner.compiled.decode_step) == {1, 2, 4}
    calls = dict.fromkeys(runner.compiled.decode_step, 0)

    def counted(t, fn):
        def call(*args):
            calls[t] += 1
            return fn(*args)
        return call

    for t, fn in list(runner.compiled.decode_step.items()):
        runner.compiled.decode_step[t] = counted(t, fn)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TINY["vocab_size"], size=n).tolist() for n in (5, 20, 50)]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    # n = 2: the forked choice's first step has a row without a token (the full step)
    (pair,) = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=12, n=2), use_tqdm=False)
    assert_equals_hf_greedy(hf_model, prompts, [o.outputs[0].token_ids for o in outs], 12)
    assert [c.token_ids for c in pair.outputs] == [outs[1].outputs[0].token_ids] * 2
    # the three sequences' decodes, together (bucket 4) and alone, mostly in decode-only steps
    assert calls[4] and sum(calls.values()) >= 3 * 11 // 2, calls
