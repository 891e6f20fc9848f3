"""Pipe message schema: every message type survives encode -> decode unchanged."""

import msgspec
import pytest

from jaxserve.config import EngineConfig, resolve_config
from jaxserve.engine import EngineCoreOutput, EngineCoreRequest, LogprobsLists, SchedulerStats
from jaxserve.engine import messages as M
from jaxserve.platforms import CPU, GPU
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

MESSAGES = [
    M.AddRequest(EngineCoreRequest(
        "req-1", [1, 2, 3, 49151],
        SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=123,
                       stop=["\n\n", "é😀"], stop_token_ids=[2], ignore_eos=True))),
    M.AddRequest(EngineCoreRequest("r", [5], SamplingParams(max_tokens=None, temperature=0))),
    M.AbortRequests(["a", "b"]),
    M.AbortRequests([]),
    M.Shutdown(),
    M.Ready(model_name="SmolLM2-135M-Instruct", tokenizer_dir="/tmp/x",
            config=resolve_config(EngineConfig(), CPU, max_position_embeddings=8192),
            eos_token_ids=[2], vocab_size=49152, allocator_fraction=0.94),
    M.Outputs([EngineCoreOutput("a", [17]),
               EngineCoreOutput("b", [2], finish_reason="stop", stop_reason=2,
                                num_prompt_tokens=30, num_cached_tokens=16)],
              SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25, num_preemptions_total=1)),
    M.Outputs([], None),
    M.AddRequest(EngineCoreRequest("n", [5, 6], SamplingParams(
        n=3, logprobs=2, prompt_logprobs=1, logit_bias={7: -100.0, 9: 2.5}, min_p=0.1,
        presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2, min_tokens=2,
        include_stop_str_in_output=True, skip_special_tokens=False))),
    M.Outputs([EngineCoreOutput("0_n", [17], new_logprobs=LogprobsLists([[17, 3]], [[-0.5, -0.1]], [2]),
                                new_prompt_logprobs=LogprobsLists([[6]], [[-3.25]], [40]))],
              SchedulerStats(prompt_tokens_computed=12)),
    *[M.AddRequest(EngineCoreRequest(f"so-{i}", [5], SamplingParams(
        n=2, structured_outputs=StructuredOutputsParams(**so))))
      for i, so in enumerate([
          {"json": {"type": "object", "properties": {"a": {"type": "integer", "maximum": 3}}}},
          {"json": '{"type": "string"}'}, {"regex": r"\d{3}"}, {"choice": ["yes", "no"]},
          {"grammar": 'start: "a" %json {"type": "integer"}'}, {"json_object": True}])],
    M.Ready(model_name="m", tokenizer_dir="/t",
            config=resolve_config(EngineConfig(model="m", max_model_len=8, kv_cache_dtype="fp8"),
                                  GPU, max_position_embeddings=8),
            generation_config={"temperature": 0.3, "top_p": 0.4}),
    M.Error(["a"], "prompt is too long", kind="invalid_request"),
    M.Error([], "cannot load model", fatal=True),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = M.encode(msg)
    assert isinstance(data, bytes)
    assert M.decode(data) == msg


@pytest.mark.parametrize("data", [b"", b"\xc1", msgspec.msgpack.encode({"type": "nope"}),
                                  msgspec.msgpack.encode({"type": "add"}),
                                  msgspec.msgpack.encode([1, 2])])
def test_malformed_frames_raise_value_error(data):
    with pytest.raises(ValueError):
        M.decode(data)


def test_encode_rejects_non_messages():
    with pytest.raises(ValueError):
        M.encode({"type": "add"})


def test_decoding_checks_sampling_params():
    """SamplingParams.__post_init__ runs on decode too: a bad value is a ValueError, not a
    request the engine would run."""
    bad = {"type": "add", "request": ["r", [1], {"temperature": -1.0}]}
    with pytest.raises(ValueError, match="temperature"):
        M.decode(msgspec.msgpack.encode(bad))
