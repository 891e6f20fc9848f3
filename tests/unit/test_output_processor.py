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
    ({"prompt": "x", "best_of": 2}, "best_of"), ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "n": 3, "logprobs": 2, "echo": True, "presence_penalty": 0.5,
      "logit_bias": {"5": 1.0}}, None),
    ({"prompt": ["a", "b"], "best_of": 1}, None),
])
def test_completion_unsupported_fields(body, field):
    assert CompletionRequest.model_validate(body).unsupported_field() == field


@pytest.mark.parametrize("body,field", [
    ({"response_format": {"type": "json_object"}}, None),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     None),
    ({"response_format": {"type": "text"}, "n": 2, "logprobs": True, "top_logprobs": 3}, None),
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
    sp = req.sampling_params(req.max_tokens, {})
    assert sp.max_tokens == 16 and sp.temperature == 1.0


def test_request_fields_to_sampling_params():
    """OpenAI's and vLLM's request fields land in SamplingParams under vLLM's names; the
    generation config fills in only what the request leaves out."""
    defaults = {"temperature": 0.2, "top_p": 0.9, "max_tokens": 50}
    req = CompletionRequest.model_validate({
        "prompt": "x", "n": 3, "logprobs": 2, "echo": True, "presence_penalty": 0.5,
        "frequency_penalty": -1, "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2,
        "logit_bias": {"5": 1.5, "07": -100}, "top_p": 0.5, "seed": 4,
        "include_stop_str_in_output": True, "skip_special_tokens": False, "user": "u1"})
    sp = req.sampling_params(req.max_tokens, defaults)
    assert (sp.n, sp.logprobs, sp.prompt_logprobs, sp.logit_bias) == (3, 2, 2, {5: 1.5, 7: -100})
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1, 1.2)
    assert (sp.min_p, sp.min_tokens, sp.seed) == (0.1, 2, 4)
    assert sp.include_stop_str_in_output and not sp.skip_special_tokens
    assert (sp.temperature, sp.top_p, sp.max_tokens) == (0.2, 0.5, 16)
    chat = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 4})
    sp = chat.sampling_params(chat.requested_max_tokens(), defaults)
    assert (sp.logprobs, sp.prompt_logprobs, sp.max_tokens, sp.temperature) == (4, None, 50, 0.2)
    with pytest.raises(pydantic.ValidationError, match="top_logprobs"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                              "logprobs": True, "top_logprobs": 21})
    bad_keys = [({"logit_bias": {k: 1}}, "logit_bias") for k in ("a", "+1", " 1", "1_0", "-1",
                                                                    "\u0663", "\uff11")]
    for body, field in [({"top_logprobs": 2}, "top_logprobs"), *bad_keys,
                        ({"min_p": 1.5}, "min_p"), ({"n": 0}, "n"),
                        ({"presence_penalty": 3}, "presence_penalty")]:
        chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                     **body})
        with pytest.raises(ValueError, match=f"^{field}"):
            chat.sampling_params(None, {})


def test_chat_content_parts_and_developer_role():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7})
    assert req.template_messages() == [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "ab"}]
    assert req.requested_max_tokens() == 7
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(ValueError, match=r"^messages\.1\.content\.1: images are not supported"):
        req.template_messages()


def test_choices_of_one_request_and_their_logprobs(tokenizer):
    """n choices come back under their engine ids and fold into one request; each finishes on
    its own, a stop string aborts that choice alone; log-probabilities become Logprob entries
    holding the token and its alternatives."""
    from jaxserve.engine import LogprobsLists

    a, b = (tokenizer.encode(x, add_special_tokens=False)[0] for x in ("a", "b"))
    op = OutputProcessor(tokenizer, eos_token_ids=[2])
    op.add_request("r", None, [1], SamplingParams(n=2, stop=["b"], logprobs=1))
    lp = LogprobsLists([[a, b]], [[-0.5, -0.25]], [2])
    out = op.process_outputs([EngineCoreOutput("0_r", [a], new_logprobs=lp),
                              EngineCoreOutput("1_r", [b], new_logprobs=lp)])
    assert out.reqs_to_abort == ["1_r"]
    first, second = out.request_outputs
    assert first.outputs[0].index == 0 and second.outputs[0].index == 1
    assert second.outputs[0].finish_reason == "stop" and not second.finished
    entry = first.outputs[0].logprobs[0]
    assert list(entry) == [a, b] and (entry[a].rank, entry[b].rank) == (2, 1)
    assert entry[b].decoded_token == "b"
    merged = merge_outputs(first, second)
    assert [c.index for c in merged.outputs] == [0, 1]
    last = op.process_outputs([EngineCoreOutput("0_r", [2], "stop", 2, new_logprobs=lp)])
    assert last.request_outputs[0].finished and not op.requests
    assert op.abort_request("r") == []


def test_cumulative_logprob_and_lora_request(tokenizer):
    """vLLM's CompletionOutput.cumulative_logprob: the sum of the choice's tokens'
    log-probabilities so far (every delta, and their merge), None without logprobs; the LoRA
    request on the RequestOutput and each CompletionOutput."""
    from jaxserve.engine import LogprobsLists
    from jaxserve.lora.request import LoRARequest

    lora = LoRARequest("adapter", 1, "/adapters/a")
    op = OutputProcessor(tokenizer, eos_token_ids=[2])
    op.add_request("r", None, [1], SamplingParams(logprobs=1), lora_request=lora)
    op.add_request("plain", None, [1], SamplingParams())
    lp = LogprobsLists([[5, 6], [7, 5]], [[-0.5, -0.25], [-1.0, -0.75]], [2, 2])
    first = op.process_outputs([EngineCoreOutput("r", [5, 7], new_logprobs=lp),
                                EngineCoreOutput("plain", [5])]).request_outputs
    assert first[0].outputs[0].cumulative_logprob == -1.5
    assert first[1].outputs[0].cumulative_logprob is None and first[1].lora_request is None
    lp = LogprobsLists([[2, 5]], [[-0.25, -2.0]], [1])
    (last,) = op.process_outputs([EngineCoreOutput("r", [2], "stop", new_logprobs=lp)]
                                 ).request_outputs
    assert last.outputs[0].cumulative_logprob == -1.75
    merged = merge_outputs(first[0], last)
    assert merged.outputs[0].cumulative_logprob == -1.75
    assert merged.lora_request == merged.outputs[0].lora_request == lora
