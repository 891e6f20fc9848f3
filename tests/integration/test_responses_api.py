"""The Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}) over the real server
(default model) and the official ``openai`` client, which parses every body and stream event
into its own types with strict validation (``_strict_response_validation``): a plain response;
a stream whose events come in OpenAI's order with consecutive sequence numbers and deltas that
join to the final text; ``tool_choice: required`` giving function calls whose arguments
validate against the tool's parameters, streamed through the client's own event accumulator,
then a follow-up turn with the calls and their outputs (sent back, or by
``previous_response_id``) answered with a message; ``text.format`` json_schema and the client's
``responses.parse``; the store (retrieve, delete, ``store: false``); ``previous_response_id``
prepending exactly the earlier turn; a client that leaves mid-stream aborting its engine
request; and 400s naming the field for what is malformed or not served.

One server, conftest.py's ``small_server`` (shared with test_structured_outputs.py and
test_tool_calling.py); output lengths are kept small.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseFunctionToolCall, ResponseOutputMessage

try:  # the HTTP library the openai client is built on (httpx2 in its 3.x releases)
    import httpx2 as httpx
except ImportError:
    import httpx

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
WEATHER = {"type": "function", "name": "get_weather",
           "description": "Get the current weather in a city.", "strict": True,
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 40},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
CITY_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
    "required": ["name", "country"], "additionalProperties": False}
# A stream's events in OpenAI's order for a reply of text: (type, how many: 1 or "+").
TEXT_STREAM = [("response.created", 1), ("response.in_progress", 1),
               ("response.output_item.added", 1), ("response.content_part.added", 1),
               ("response.output_text.delta", "+"), ("response.output_text.done", 1),
               ("response.content_part.done", 1), ("response.output_item.done", 1)]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(small_server):
    return small_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=600, _strict_response_validation=True)


def _check_usage(r: Response) -> None:
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens


def _runs(types: list[str]) -> list[tuple[str, int]]:
    """Consecutive event types as (type, run length)."""
    out: list[tuple[str, int]] = []
    for t in types:
        if out and out[-1][0] == t:
            out[-1] = (t, out[-1][1] + 1)
        else:
            out.append((t, 1))
    return out


def test_plain_response(client):
    r = client.responses.create(model=MODEL, input="What is the capital of France?",
                                instructions="Answer in one short sentence.",
                                max_output_tokens=24, temperature=0)
    assert isinstance(r, Response) and r.id.startswith("resp_") and r.object == "response"
    assert r.model == MODEL and r.created_at > 0 and r.error is None
    assert r.instructions == "Answer in one short sentence." and r.store is True
    assert r.max_output_tokens == 24 and r.temperature == 0 and r.tool_choice == "auto"
    [message] = r.output
    assert isinstance(message, ResponseOutputMessage) and message.id.startswith("msg_")
    assert message.role == "assistant" and message.content[0].type == "output_text"
    assert r.output_text == message.content[0].text and r.output_text.strip()
    _check_usage(r)
    assert r.usage.output_tokens <= 24
    assert (r.status, message.status) in (("completed", "completed"),
                                          ("incomplete", "incomplete"))
    # Cut by max_output_tokens: incomplete, and says why.
    cut = client.responses.create(model=MODEL, input="Count from one to fifty in words.",
                                  max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.output[0].status == "incomplete"
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.completed_at >= cut.created_at


def test_stream_events_in_order(client):
    events = list(client.responses.create(model=MODEL, input="Name three colours.",
                                          max_output_tokens=24, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    runs = _runs([e.type for e in events])
    assert [(t, 1 if n == 1 else "+") for t, n in runs[:-1]] == TEXT_STREAM, runs
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete"), runs
    response = last.response
    assert events[0].response.id == response.id and events[0].response.status == "in_progress"
    assert events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == events[-4].text == response.output_text
    item = events[-2].item
    assert item.id == events[2].item.id == response.output[0].id
    assert item.content[0].text == text and events[-3].part.text == text
    assert response.status == ("completed" if last.type == "response.completed" else "incomplete")
    _check_usage(response)
    # Stored as the last event has it.
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()


def _check_calls(r: Response) -> list[ResponseFunctionToolCall]:
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and len(calls) == len(r.output), r.output
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        assert call.id.startswith("fc_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert len({c.call_id for c in calls}) == len(calls)
    return calls


def _outputs(calls: list[ResponseFunctionToolCall]) -> list[dict]:
    return [{"type": "function_call_output", "call_id": c.call_id,
             "output": json.dumps({"temperature": 21, "unit": "celsius"})} for c in calls]


def test_required_tool_call_then_its_output(client):
    """``required`` yields function calls with valid arguments; the next turn (the calls and
    their outputs sent back, or the earlier response named by previous_response_id) gets a
    message, and both ways give the model the same prompt."""
    r = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60)
    assert r.status == "completed" and r.tools[0].name == "get_weather"
    calls = _check_calls(r)
    sent_back = client.responses.create(model=MODEL, input=[*ASK, *calls, *_outputs(calls)],
                                        max_output_tokens=16, temperature=0)
    chained = client.responses.create(model=MODEL, input=_outputs(calls),
                                      previous_response_id=r.id, max_output_tokens=16,
                                      temperature=0)
    for follow_up in (sent_back, chained):
        assert follow_up.output[0].type == "message" and follow_up.output_text.strip()
    assert chained.previous_response_id == r.id
    assert chained.usage.input_tokens == sent_back.usage.input_tokens


def test_streamed_tool_call_through_the_client_accumulator(client):
    """The client's ``responses.stream`` rebuilds the response from the events (it raises on
    events that do not fit together); arguments deltas join to the done event's arguments."""
    with client.responses.stream(model=MODEL, input=ASK, tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=60) as stream:
        events = list(stream)
        final = stream.get_final_response()
    [call] = _check_calls(final)
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == events[-3].arguments == call.arguments == events[-2].item.arguments


def test_json_schema_format(client):
    r = client.responses.create(
        model=MODEL, input="Describe Paris as JSON.", max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA,
                         "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    assert r.text.format.name == "city"
    jsonschema.validate(json.loads(r.output_text), CITY_SCHEMA)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


def test_parse_with_a_pydantic_model(client):
    r = client.responses.parse(model=MODEL, input="Describe Paris as JSON.", text_format=City,
                               max_output_tokens=60)
    assert isinstance(r.output_parsed, City), r.output_text


def test_store_retrieve_and_delete(client, server):
    r = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4)
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    with pytest.raises(openai.BadRequestError, match="Cannot cancel"):
        client.responses.cancel(r.id)
    client.responses.delete(r.id)
    for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
        with pytest.raises(openai.NotFoundError) as e:
            call(r.id)
        error = e.value.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert r.id in error["message"] and error["type"] == "invalid_request_error"
    unstored = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4,
                                       store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    assert httpx.get(f"{server.url}/v1/responses/{r.id}/nope").status_code == 404


def test_previous_response_id_prepends_the_earlier_turn(client):
    """A follow-up by previous_response_id has the prompt of the same conversation sent in
    full (the earlier input and output; not the earlier instructions, which OpenAI does not
    carry over)."""
    first = [{"role": "user", "content": "My name is Alice. Reply with OK."}]
    then = [{"role": "user", "content": "What is my name?"}]
    r1 = client.responses.create(model=MODEL, input=first, instructions="Be brief.",
                                 max_output_tokens=6, temperature=0)
    r2 = client.responses.create(model=MODEL, input=then, previous_response_id=r1.id,
                                 max_output_tokens=6, temperature=0)
    in_full = client.responses.create(model=MODEL, input=[*first, *r1.output, *then],
                                      max_output_tokens=6, temperature=0)
    assert r2.previous_response_id == r1.id and r2.instructions is None
    assert r2.usage.input_tokens == in_full.usage.input_tokens > r1.usage.input_tokens
    # A chain goes on from a follow-up.
    r3 = client.responses.create(model=MODEL, input="Thanks.", previous_response_id=r2.id,
                                 max_output_tokens=4)
    assert r3.usage.input_tokens > r2.usage.input_tokens


def test_disconnect_mid_stream_aborts(server):
    async def go():
        body = {"model": MODEL, "input": "Count from one to one thousand: one, two,",
                "max_output_tokens": 600, "temperature": 0, "stream": True}
        async with aiohttp.ClientSession() as s:
            resp = await s.post(f"{server.url}/v1/responses", json=body)
            assert resp.status == 200
            deltas = 0
            async for line in resp.content:
                deltas += b'"response.output_text.delta"' in line and line.startswith(b"data:")
                if deltas >= 3:
                    break
            assert server.metrics()["jaxserve:num_requests_running"] >= 1
            resp.close()

    asyncio.run(go())
    deadline = time.monotonic() + 20
    while server.metrics()["jaxserve:num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metrics()["jaxserve:num_requests_running"] == 0


@pytest.mark.parametrize("body,param", [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),
    ({"input": "hello " * 2000}, "input"),
    ({"max_output_tokens": 2000}, "max_output_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": -1}, "max_output_tokens"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input"),
    ({"temperature": 9}, "temperature"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search_preview"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "schema": CITY_SCHEMA}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x",
                          "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "text"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
])
def test_bad_requests_are_400s_naming_the_field(server, body, param):
    full = {"model": MODEL, **({"input": "Hi"} if body and "input" not in body else {}), **body}
    r = httpx.post(f"{server.url}/v1/responses", json=full, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    # The message names the request's own fields (the Responses API has no max_tokens).
    assert "max_tokens" not in error["message"].replace("max_output_tokens", ""), error
    if param == "previous_response_id":
        assert error["code"] == "previous_response_not_found"


def test_unknown_model_is_404(server):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "gpt-x", "input": "Hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
