"""/v1/responses through the real aiohttp app with a fake engine (test_openai_serving.py's
FakeLLM, scripted): every body and event validates against the ``openai`` package's own types;
a reply of text and a Hermes tool call gives the same items whole and streamed, in OpenAI's
event order; a reply cut by max_output_tokens leaves the response and its items incomplete; text after a
call closes the call first; an empty reply is one empty message; with a ``--reasoning-parser`` the reasoning is a
``reasoning`` item before the answer, whole and streamed, and a follow-up leaves it out of the
prompt; the store evicts the least recently used and can be off; a stream that fails ends with an
``error`` event and keeps nothing."""

import asyncio
import itertools
import json

from aiohttp.test_utils import TestClient, TestServer
from openai._models import validate_type
from openai.types.responses import Response, ResponseStreamEvent
from test_openai_serving import FakeLLM

from jaxserve.engine.async_llm import EngineDeadError
from jaxserve.entrypoints.api_server import build_app
from jaxserve.entrypoints.limits import ServerLimits
from jaxserve.outputs import CompletionOutput, RequestOutput

CALL_TEXT = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
             '\n</tool_call>')
WEATHER = {"type": "function", "name": "get_weather", "strict": False,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


class ScriptedLLM(FakeLLM):
    """Writes ``text`` in pieces of 7 characters, then finishes with ``finish_reason``."""

    class tokenizer:  # what serving reads of the tokenizer
        all_special_tokens = ["<|im_end|>"]

    def __init__(self, text: str = "Hello there.", finish_reason: str = "stop", **kw):
        super().__init__(**kw)
        self.text, self.finish_reason = text, finish_reason

    async def outputs(self, request_id, ids):
        if self.fail:
            raise self.fail
        pieces = [self.text[i:i + 7] for i in range(0, len(self.text), 7)] + [""]
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1
            yield RequestOutput(request_id, None, ids, [CompletionOutput(
                0, text, [10 + i], self.finish_reason if last else None)], finished=last)


def _run(llm, requests, limits=None, **app_kwargs):
    """(status, body: parsed JSON, or the SSE events' data as JSON) of each (method, path,
    body) in turn, on one app (build_app's ``app_kwargs``)."""

    async def go():
        out = []
        async with TestClient(TestServer(build_app(llm, limits=limits, **app_kwargs))) as client:
            for method, path, body in requests:
                resp = await client.request(method, path, json=body)
                text = await resp.text()
                if resp.headers["Content-Type"] == "text/event-stream":
                    events = []
                    for block in text.split("\n\n")[:-1]:
                        name, data = block.split("\n")
                        events.append(json.loads(data.removeprefix("data: ")))
                        assert name == f"event: {events[-1]['type']}"  # named by its type
                    out.append((resp.status, events))
                else:
                    out.append((resp.status, json.loads(text)))
        return out

    return asyncio.run(go())


def _create(body):
    return ("POST", "/v1/responses", body)


def _valid_response(body: dict) -> Response:
    return validate_type(type_=Response, value=body)


def _valid_events(events: list[dict]) -> list:
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return [validate_type(type_=ResponseStreamEvent, value=e) for e in events]


def _items(response: dict) -> list[dict]:
    """The output items without their ids."""
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")}
            for item in response["output"]]


def test_text_and_a_tool_call_whole_and_streamed():
    body = {"input": "Weather in Paris?", "tools": [WEATHER]}
    [(_, whole), (_, events)] = _run(ScriptedLLM(CALL_TEXT),
                                     [_create(body), _create({**body, "stream": True})])
    _valid_response(whole)
    assert _items(whole) == [
        {"type": "message", "status": "completed", "role": "assistant", "content": [
            {"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "status": "completed", "name": "get_weather",
         "arguments": '{"city": "Paris"}'}]
    _valid_events(events)
    # Event types, each run of deltas as one.
    assert [t for t, _ in itertools.groupby(e["type"] for e in events)] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    final = events[-1]["response"]
    assert final["status"] == "completed" and _items(final) == _items(whole)
    call = final["output"][1]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1] and added[1]["item"]["arguments"] == ""
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert all(e["item_id"] == call["id"] and e["output_index"] == 1 for e in deltas)
    assert "".join(e["delta"] for e in deltas) == call["arguments"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"][::-1]  # the call ends first; the message stays open to the end


def test_a_cut_reply_is_incomplete():
    [(_, whole), (_, events)] = _run(ScriptedLLM("Counting: one, two", "length"), [
        _create({"input": "Count."}), _create({"input": "Count.", "stream": True})])
    for response in (_valid_response(whole), _valid_events(events)[-1].response):
        assert response.status == "incomplete" and response.output[0].status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    assert events[-1]["type"] == "response.incomplete"


def test_text_after_a_call_closes_it_first():
    """A complete call, then a second one cut by max_output_tokens before its name (text): the
    call's done events come before the message opens, whole and streamed alike."""
    body = {"input": "Weather in Paris?", "tools": [WEATHER]}
    text = CALL_TEXT.removeprefix("Checking.") + '\n<tool_call>\n{"name":'
    [(_, whole), (_, events)] = _run(ScriptedLLM(text, "length"),
                                     [_create(body), _create({**body, "stream": True})])
    assert [(i["type"], i["status"]) for i in _items(whole)] == [
        ("function_call", "completed"), ("message", "incomplete")]
    assert whole["output"][1]["content"][0]["text"] == '<tool_call>\n{"name":'
    _valid_events(events)
    assert [t for t, _ in itertools.groupby(e["type"] for e in events)][2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]
    assert _items(events[-1]["response"]) == _items(whole)


def test_an_empty_reply_is_one_empty_message():
    [(_, whole)] = _run(ScriptedLLM(""), [_create({"input": "Hi"})])
    assert _valid_response(whole).output_text == "" and _items(whole)[0]["type"] == "message"


def test_reasoning_is_an_item_before_the_answer():
    class ThinkingLLM(ScriptedLLM):
        async def encode_chat(self, messages, *args):
            self.messages = messages
            return "<prompt><think>\n", [1, 2, 3]

    llm = ThinkingLLM("Two and two.</think>Four.<tool_call>\n"
                      '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    body = {"input": "Sum?", "tools": [WEATHER]}
    [(_, whole), (_, events)] = _run(llm, [_create(body), _create({**body, "stream": True})],
                                     reasoning_parser="qwen3")
    _valid_response(whole)
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message", "function_call"]
    reasoning = _items(whole)[0]
    assert reasoning == {"type": "reasoning", "status": "completed", "summary": [],
                         "content": [{"type": "reasoning_text", "text": "Two and two."}],
                         "encrypted_content": None}
    assert whole["output"][1]["content"][0]["text"] == "Four."
    _valid_events(events)
    assert [t for t, _ in itertools.groupby(e["type"] for e in events)][:8] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done"]
    final = events[-1]["response"]
    assert _items(final) == _items(whole)
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Two and two." and len(deltas) > 1
    # Sent back, the reasoning item stays out of the prompt (the template sees the rest).
    [(status, again)] = _run(llm, [_create({
        "input": [*whole["output"], {"type": "function_call_output",
                                      "call_id": whole["output"][2]["call_id"], "output": "4"}],
        "tools": [WEATHER]})], reasoning_parser="qwen3")
    assert status == 200 and _valid_response(again).status == "completed"
    assert [m["role"] for m in llm.messages] == ["assistant", "tool"]


def test_the_store_evicts_the_least_recently_used():
    llm, ids = ScriptedLLM(), []

    async def go():
        async with TestClient(TestServer(build_app(llm, limits=ServerLimits(
                max_stored_responses=2)))) as client:
            async def status(method, rid):
                return (await client.request(method, f"/v1/responses/{rid}")).status

            for _ in range(2):
                ids.append((await (await client.post("/v1/responses", json={"input": "a"}))
                            .json())["id"])
            assert await status("GET", ids[0]) == 200  # the first is now the most recent
            ids.append((await (await client.post("/v1/responses", json={
                "input": "b", "previous_response_id": ids[0]})).json())["id"])
            return [await status("GET", rid) for rid in ids]

    assert asyncio.run(go()) == [200, 404, 200]


def test_a_server_that_keeps_no_responses():
    off = ServerLimits(max_stored_responses=0)
    [(_, r), (get_status, get_body), (prev_status, prev_body)] = _run(ScriptedLLM(), [
        _create({"input": "Hi"}), ("GET", "/v1/responses/resp_x", None),
        _create({"input": "Hi", "previous_response_id": "resp_x"})], off)
    assert r["store"] is False
    assert get_status == 404 and "keeps no responses" in get_body["error"]["message"]
    assert prev_status == 400
    assert prev_body["error"]["code"] == "previous_response_not_found"


def test_a_failed_stream_ends_with_an_error_event_and_keeps_nothing():
    llm = ScriptedLLM(fail=EngineDeadError("the engine process died"))
    [(status, events)] = _run(llm, [_create({"input": "Hi", "stream": True})])
    assert status == 200
    error = _valid_events(events)[-1]
    assert error.type == "error" and error.code == "engine_unavailable"
    assert events[-1]["error"]["message"] == "the engine process died"
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
