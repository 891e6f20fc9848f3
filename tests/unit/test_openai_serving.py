"""The OpenAI bodies on the wire (entrypoints/serving_*.py through protocol.py's response models),
with a fake AsyncLLM behind the real aiohttp app: which optional fields are null and which are
left out (vLLM's fields null in whole responses, absent from chunks), the chat stream's role
chunk and empty deltas, the usage chunk, token ids, errors."""

import asyncio
import json

from aiohttp.test_utils import TestClient, TestServer

from jaxserve.config import EngineConfig, resolve_config
from jaxserve.engine.async_llm import EngineDeadError
from jaxserve.entrypoints.api_server import build_app
from jaxserve.metrics import Metrics
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.platforms import CPU

PROMPT_IDS = [5, 6, 7]
# (text, token ids) of each output; the last adds only the EOS id, no text.
DELTAS = [("Hel", [10]), ("lo é", [11, 12]), ("", [2])]
USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
         "prompt_tokens_details": {"cached_tokens": 2}}


class FakeLLM:
    """What serving uses of AsyncLLM; ``outputs`` yields DELTAS, or raises ``fail`` after the
    first."""

    ready, errored, shutting_down, restarting = True, False, False, False
    model_name = "fake-model"
    config = resolve_config(EngineConfig(max_model_len=64, max_num_seqs=2), CPU, 64)
    generation_config = {}

    def __init__(self, fail: Exception | None = None):
        self.fail = fail
        self.metrics = Metrics(self.model_name)

    async def encode_prompt(self, prompt):
        return list(PROMPT_IDS)

    async def encode_chat(self, messages, *args):
        return "<prompt>", list(PROMPT_IDS)

    def check_request(self, ids, sp):
        pass

    def add_request(self, ids, sp, request_id, reasoning_end_token_id=None, lora_request=None,
                    cache_salt=None):
        self.last_sampling_params = sp
        return ids  # the "queue" that outputs gets back

    async def outputs(self, request_id, ids):
        for i, (text, token_ids) in enumerate(DELTAS):
            if self.fail and i == 1:
                raise self.fail
            last = i == len(DELTAS) - 1
            yield RequestOutput(request_id, None, ids,
                                [CompletionOutput(0, text, token_ids, "stop" if last else None)],
                                num_cached_tokens=2, finished=last)

    def abort(self, request_id):
        pass


def _call(path, body=None, llm=None):
    """(status, Content-Type, body text) of one request to the app."""

    async def go():
        async with TestClient(TestServer(build_app(llm or FakeLLM()))) as client:
            if body is None:
                resp = await client.get(path)
            else:
                resp = await client.post(path, data=json.dumps(body))
            return resp.status, resp.headers["Content-Type"], await resp.text()

    return asyncio.run(go())


def _events(text):
    """The SSE events as parsed JSON, ``[DONE]`` kept as is; id and created checked, then
    dropped."""
    out = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        if data == "[DONE]":
            out.append(data)
            continue
        event = json.loads(data)
        if "error" not in event:
            assert event.pop("id").startswith(("cmpl-", "chatcmpl-"))
            assert isinstance(event.pop("created"), int)
        out.append(event)
    return out


def _body(text):
    body = json.loads(text)
    body.pop("id"), body.pop("created")
    return body


def test_completion_response():
    status, ctype, text = _call("/v1/completions", {"prompt": "hi"})
    assert status == 200 and ctype.startswith("application/json")
    assert _body(text) == {
        "object": "text_completion", "model": "fake-model",
        "choices": [{"index": 0, "text": "Hello é", "logprobs": None, "finish_reason": "stop",
                     "stop_reason": None, "prompt_token_ids": None, "token_ids": None, "prompt_logprobs": None}],
        "usage": USAGE}


def test_chat_response_with_token_ids():
    _, _, text = _call("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                "return_token_ids": True})
    assert _body(text) == {
        "object": "chat.completion", "model": "fake-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello é", "refusal": None,
                                             "reasoning": None, "reasoning_content": None},
                     "logprobs": None, "finish_reason": "stop", "stop_reason": None,
                     "token_ids": [10, 11, 12, 2]}],
        "usage": USAGE, "prompt_logprobs": None, "prompt_token_ids": PROMPT_IDS}


def test_completion_stream():
    status, ctype, text = _call("/v1/completions", {"prompt": "hi", "stream": True})
    assert status == 200 and ctype == "text/event-stream"
    head = {"object": "text_completion", "model": "fake-model"}
    # No chunk for the EOS alone until the output finishes; no usage key without include_usage;
    # stop_reason on the finishing chunk only (vLLM's).
    assert _events(text) == [
        {**head, "choices": [{"index": 0, "text": "Hel", "logprobs": None,
                              "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "text": "lo é", "logprobs": None,
                              "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "text": "", "logprobs": None,
                              "finish_reason": "stop", "stop_reason": None}]},
        "[DONE]"]


def test_chat_stream_with_usage_and_token_ids():
    _, _, text = _call("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True})
    head = {"object": "chat.completion.chunk", "model": "fake-model"}

    def choice(delta, finish_reason=None, **ids):
        stop_reason = {} if finish_reason is None else {"stop_reason": None}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
                **stop_reason, **ids}

    assert _events(text) == [
        {**head, "choices": [choice({"role": "assistant", "content": ""})],
         "prompt_token_ids": PROMPT_IDS},
        {**head, "choices": [choice({"content": "Hel"}, token_ids=[10])]},
        {**head, "choices": [choice({"content": "lo é"}, token_ids=[11, 12])]},
        {**head, "choices": [choice({}, "stop", token_ids=[2])]},
        {**head, "choices": [], "usage": USAGE},
        "[DONE]"]


def test_stream_error_event():
    _, _, text = _call("/v1/completions", {"prompt": "hi", "stream": True},
                       FakeLLM(fail=EngineDeadError("the engine process died")))
    events = _events(text)
    assert events[1:] == [{"error": {"message": "the engine process died", "type": "server_error",
                                     "param": None, "code": "engine_unavailable"}}, "[DONE]"]


def test_unexpected_stream_error_is_an_event_then_done():
    """Any error after the headers (here a bug's RuntimeError) ends the stream with one error
    event and [DONE], never a second HTTP response; its details stay in the log."""
    _, _, text = _call("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                "stream": True}, FakeLLM(fail=RuntimeError("x")))
    events = _events(text)
    assert events[-2:] == [{"error": {"message": "internal server error", "type": "server_error",
                                      "param": None, "code": None}}, "[DONE]"]


def test_chat_without_max_tokens_runs_to_the_context():
    """OpenAI's and vLLM's meaning, kept: up to max_model_len minus the prompt."""
    llm = FakeLLM()
    _call("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, llm)
    assert llm.last_sampling_params.max_tokens == llm.config.max_model_len - len(PROMPT_IDS)


def test_models():
    status, _, text = _call("/v1/models")
    body = json.loads(text)
    assert status == 200 and isinstance(body["data"][0].pop("created"), int)
    assert body == {"object": "list", "data": [{
        "id": "fake-model", "object": "model", "owned_by": "jaxserve", "root": "fake-model",
        "parent": None, "max_model_len": 64}]}


def test_lone_surrogate_is_a_400_naming_the_field():
    """JSON's "\\ud800" escape gives a string no encoder downstream accepts: a 400 at the edge."""
    status, ctype, text = _call("/v1/completions", {"model": "\ud800", "prompt": "hi"})
    assert status == 400 and ctype.startswith("application/json")
    error = json.loads(text)["error"]
    assert error["param"] == "model" and "surrogate" in error["message"]
