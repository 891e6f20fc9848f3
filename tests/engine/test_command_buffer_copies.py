"""Loaded copies of the step programs called in turn (``Platform.command_buffer_copies``, on
for the GPU): both copies run, on alternate steps, and the tokens are HF's greedy ones."""

import dataclasses

import numpy as np

from jaxserve.platforms import CPU
from jaxserve.sampling_params import SamplingParams
from tests.greedy import assert_equals_hf_greedy
from tests.tiny_models import TINY, save_tiny_model

ENGINE = dict(max_model_len=96, max_num_batched_tokens=16, max_num_seqs=4, kv_cache_gib=0.01,
              log=lambda s: None)


def test_step_copies_called_in_turn_equal_hf_greedy(tmp_path, smollm, monkeypatch):
    from jaxserve import LLM
    from jaxserve.worker import model_runner

    hf_model = save_tiny_model("llama", tmp_path, smollm.tokenizer)
    platform = dataclasses.replace(CPU, command_buffer_copies=2)
    monkeypatch.setattr(model_runner, "current_platform", lambda: platform)
    llm = LLM(str(tmp_path), **ENGINE)
    runner = llm.engine.runner
    assert set(runner._copies) == {("step", t) for t in runner.compiled.step}
    calls = []  # (bucket, copy, step count) of each step call

    def counted(t, i, fn):
        def call(*args):
            calls.append((t, i, runner._step_count))
            return fn(*args)
        return call

    for (_, t), copies in runner._copies.items():
        assert copies[0] is runner.compiled.step[t] and copies[1] is not copies[0]
        copies[:] = [counted(t, i, c) for i, c in enumerate(copies)]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, TINY["vocab_size"], size=n).tolist() for n in (7, 30)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert_equals_hf_greedy(hf_model, prompts, [o.outputs[0].token_ids for o in outs], 10)
    assert {i for _, i, _ in calls} == {0, 1}
    assert all(i == k % 2 for _, i, k in calls), calls
