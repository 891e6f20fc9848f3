"""OutputProcessor (API side): text deltas, EOS / stop tokens kept out of the text, stop strings
end the request and ask for an engine abort; protocol models reject what jaxserve can't do."""

import asyncio

import pydantic
import pytest

from jaxserve.engine import EngineCoreOutput
from jaxserve.engine.output_processor import OutputProcessor, RequestError, merge_outputs
from jaxserve.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from jaxserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.model_loader import default_tokenizer

    return default_tokenizer()


def _drain(q):
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def _run(tokenizer, text, sp, finish_reason, extra_last=None, stop_reason=None):
    op = OutputProcessor(tokenizer, eos_token_ids=[tokenizer.eos_token_id])
    q = asyncio.Queue()
    op.add_request("r", None, [1, 2, 3], sp, q)
    ids = tokenizer.encode(text, add_special_tokens=False) + ([extra_last] if extra_last else [])
    aborts = []
    for k, t in enumerate(ids):
        last = k == len(ids) - 1
        aborts += op.process_outputs([EngineCoreOutput(
            "r", [t], finish_reason if last else None, stop_reason if last else None, 3, 0)]
        ).reqs_to_abort
        if "r" not in op.requests:
            break
    return _drain(q), aborts, op


def test_eos_not_in_text(tokenizer):
    outs, aborts, op = _run(tokenizer, "Paris is nice.", SamplingParams(), "stop",
                            extra_last=tokenizer.eos_token_id)
    assert "".join(o.outputs[0].text for o in outs) == "Paris is nice."
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
    assert sum(len(o.outputs[0].token_ids) for o in outs) == len(
        tokenizer.encode("Paris is nice.", add_special_tokens=False)) + 1
    assert not aborts and not op.requests


def test_stop_token_id_not_in_text(tokenizer):
    stop_id = tokenizer.encode("!", add_special_tokens=False)[0]
    outs, _, _ = _run(tokenizer, "Hello there", SamplingParams(stop_token_ids=[stop_id]), "stop",
                      extra_last=stop_id, stop_reason=stop_id)
    assert "".join(o.outputs[0].text for o in outs) == "Hello there"
    assert outs[-1].outputs[0].stop_reason == stop_id


def test_length_flushes_held_back_text(tokenizer):
    outs, _, _ = _run(tokenizer, "one two ST", SamplingParams(stop=["STOP"]), "length")
    assert "".join(o.outputs[0].text for o in outs) == "one two ST"
    assert outs[-1].outputs[0].finish_reason == "length"


def test_stop_string_finishes_and_aborts(tokenizer):
    outs, aborts, op = _run(tokenizer, "alpha beta END gamma delta", SamplingParams(stop=["END"]),
                            "length")
    assert "".join(o.outputs[0].text for o in outs) == "alpha beta "
    assert outs[-1].finished
    assert outs[-1].outputs[0].finish_reason == "stop"
    assert outs[-1].outputs[0].stop_reason == "END"
    assert aborts == ["r"] and not op.requests


def test_errors_and_merge(tokenizer):
    op = OutputProcessor(tokenizer)
    q = asyncio.Queue()
    op.add_request("a", None, [1], SamplingParams(), q)
    ids = tokenizer.encode("ab cd", add_special_tokens=False)
    op.process_outputs([EngineCoreOutput("a", [ids[0]])])
    op.process_outputs([EngineCoreOutput("a", ids[1:])])
    first, second = _drain(q)
    merged = merge_outputs(first, second)
    assert merged.outputs[0].token_ids == ids
    op.propagate_error(["a"], RequestError("bad", "invalid_request"))
    assert isinstance(q.get_nowait(), RequestError) and not op.requests
    op.process_outputs([EngineCoreOutput("a", [5])])  # late output of a dead request: ignored
    assert q.empty()


def test_without_a_queue_deltas_are_returned(tokenizer):
    """The offline LLM's way: no queue, the deltas come back from process_outputs."""
    op = OutputProcessor(tokenizer, eos_token_ids=[tokenizer.eos_token_id])
    op.add_request("a", "the prompt", [1], SamplingParams())
    ids = tokenizer.encode("ab cd", add_special_tokens=False)
    first = op.process_outputs([EngineCoreOutput("a", ids)])
    last = op.process_outputs([EngineCoreOutput("a", [tokenizer.eos_token_id], "stop")])
    (d1,), (d2,) = first.request_outputs, last.request_outputs
    assert d1.prompt == "the prompt" and not d1.finished
    assert d1.outputs[0].text + d2.outputs[0].text == "ab cd" and d2.finished
    assert d2.outputs[0].token_ids == [tokenizer.eos_token_id] and not op.requests


@pytest.mark.parametrize("body,field", [
    ({"prompt": "x", "n": 3}, "n"), ({"prompt": "x", "logprobs": 1}, "logprobs"),
    ({"prompt": "x", "echo": True}, "echo"), ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"), ({"prompt": "x"}, None),
    ({"prompt": ["x"], "n": 1, "logprobs": None}, None),
])
def test_completion_unsupported_fields(body, field):
    assert CompletionRequest.model_validate(body).unsupported_field() == field


@pytest.mark.parametrize("body,field", [
    ({"logprobs": True}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"), ({"n": 2}, "n"),
    ({"response_format": {"type": "text"}}, None), ({}, None),
])
def test_chat_unsupported_fields(body, field):
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
    assert req.unsupported_field() == field


def test_protocol_types_are_strict_and_extras_kept():
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": "5"})
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest.model_validate({"prompt": "x", "stream": "true"})
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": 1, "whatever": 3})
    assert req.temperature == 1.0 and req.model_extra == {"whatever": 3}
    sp = req.sampling_params(req.max_tokens)
    assert sp.max_tokens == 16 and sp.temperature == 1.0


def test_chat_content_parts_and_developer_role():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7})
    assert req.template_messages() == [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "ab"}]
    assert req.requested_max_tokens() == 7
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionRequest.model_validate({"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
