"""Tool calling (docs/tool_calling.md) over the real server (default model, ``--tool-call-parser hermes``,
the default) and the official ``openai`` client: ``auto`` answers are well formed whether or
not the model calls (parser-level behaviour is tests/unit/test_tool_parsers.py's), ``required``
and a named function always give calls whose arguments validate against the function's
parameters (enforced with structured outputs: tool_grammar.py), streamed deltas reassemble
into the non-streamed answer, ``none`` returns content only, a later turn with the assistant's
calls and the tool results is accepted, /tokenize renders the tools as chat does, and every
body on the wire validates against OpenAI's schema. One server, shared with
test_structured_outputs.py (conftest.py's ``small_server``; its ``client`` records the bodies); the tests run in file order. Requests that can run together are
sent at once: the module's runtime is mostly decode steps, which a batch shares.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest
from server_utils import in_parallel

from tests.openai_schema import CHAT, CHAT_CHUNK, errors

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
try:  # the HTTP library the openai client is built on (httpx2 in its 3.x releases)
    import httpx2 as httpx
except ImportError:
    import httpx

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(small_server):
    return small_server


def _streamed(chunks) -> tuple[str | None, list[dict], str | None]:
    """(content, calls as {"name", "arguments"}, finish_reason) joined from stream chunks."""
    content, calls, finish = "", [], None
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                if d.id is not None:
                    assert d.index == len(calls) and d.type == "function"
                    calls.append({"name": d.function.name, "arguments": ""})
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content or None, calls, finish


def _whole(r) -> tuple[str | None, list[dict], str | None]:
    m = r.choices[0].message
    calls = [{"name": c.function.name, "arguments": c.function.arguments}
             for c in m.tool_calls or ()]
    ids = [c.id for c in m.tool_calls or ()]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)
    return m.content, calls, r.choices[0].finish_reason


def _both_ways(client, requests: list[dict]) -> list[tuple[tuple, tuple]]:
    """(non-streamed, streamed) answer (``_whole``, ``_streamed``) of each request, all sent
    at once: a request and its streamed twin (same seed) run side by side."""
    jobs = [(kw, stream) for kw in requests for stream in (False, True)]

    def one(job):
        kw, stream = job
        if stream:
            return _streamed(client.chat.completions.create(**kw, stream=True))
        return _whole(client.chat.completions.create(**kw))

    answers = in_parallel(one, jobs)
    return list(zip(answers[::2], answers[1::2]))


def test_auto_is_well_formed_and_streams_the_same(client):
    """Whatever the model writes (a call, or text), the answer is one or the other in OpenAI's
    shape, finish_reason says which, and the stream joins to the same (same seed)."""
    requests = [dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, seed=seed,
                     temperature=0.7) for seed in range(4)]
    for whole, streamed in _both_ways(client, requests):
        content, calls, finish = whole
        if calls:
            assert finish in ("tool_calls", "length")
            assert {c["name"] for c in calls} <= {"get_weather", "get_time"} or finish == "length"
        else:
            assert finish in ("stop", "length") and content
        assert streamed == whole


def test_tool_choice_none_returns_content_only(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=40,
              temperature=0)
    for content, calls, finish in _both_ways(client, [kw])[0]:
        assert content and not calls and finish in ("stop", "length")


def test_a_turn_with_calls_and_results_is_answered(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 21, "sky": "clear"}'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                       max_tokens=40, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 100  # the tools block and the history are in the prompt


def test_tokenize_renders_tools_as_chat_does(server, client):
    r = httpx.post(f"{server.url}/tokenize", json={"messages": ASK, "tools": TOOLS}, timeout=60)
    plain = httpx.post(f"{server.url}/tokenize", json={"messages": ASK}, timeout=60)
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1)
    assert r.json()["count"] == chat.usage.prompt_tokens > plain.json()["count"]


def _json_or_none(text):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _check_calls(calls, names):
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    for c in calls:
        assert c["name"] in names
        jsonschema.validate(json.loads(c["arguments"]), params[c["name"]])


@pytest.mark.parametrize("choice,names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_enforced_choices_always_give_valid_calls(client, choice, names):
    """``required`` and a named function, 10 seeds sampled freely (temperature 1,
    top_p 1), each non-streamed and streamed: every answer is calls only (one for a named
    function) whose arguments validate, finish_reason is "tool_calls", and the stream joins to
    the same. ``required`` allows any number of calls: a sample that goes on calling until
    max_tokens ends "length", its complete calls valid, the cut one keeping what it has (or
    dropped, when cut before its name), and no content."""
    requests = [dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                     max_tokens=200, seed=seed, temperature=1.0, top_p=1.0)
                for seed in range(10)]
    finishes = []
    for whole, streamed in _both_ways(client, requests):
        content, calls, finish = whole
        finishes.append(finish)
        if finish == "length" and choice == "required":
            assert not content, whole
            if calls and _json_or_none(calls[-1]["arguments"]) is None:
                calls = calls[:-1]  # cut in its arguments
        else:
            assert content is None and finish == "tool_calls", whole
        assert len(calls) == 1 or choice == "required", calls
        _check_calls(calls, names)
        assert streamed == whole
    assert finishes.count("tool_calls") >= 8, finishes


class Forecast(pydantic.BaseModel):
    """Nested models: pydantic's schema refers to the inner one through ``$defs``."""

    class Place(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=30)
        country: str = pydantic.Field(max_length=30)

    place: Place
    days: int = pydantic.Field(ge=1, le=7)


def test_a_pydantic_tool_is_parsed_by_the_client(client):
    """``openai.pydantic_function_tool`` (a strict tool whose schema has ``$defs``) and the
    client's ``chat.completions.parse``: the call's arguments come back as the model."""
    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "The forecast for Paris, please."}],
        tools=[openai.pydantic_function_tool(Forecast)], max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "Forecast"}})
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Forecast), call.function.arguments
    assert r.choices[0].finish_reason == "tool_calls"


def test_every_body_validates_against_the_openapi_schema(transport):
    checked = {"whole": 0, "chunks": 0}
    for path, status, raw in transport.records:
        if status != 200 or not path.endswith("chat/completions"):
            continue
        text = raw.decode()
        if text.startswith("data: "):
            for block in text.split("\n\n"):
                data = block.removeprefix("data: ")
                if block and data != "[DONE]":
                    assert not errors(CHAT_CHUNK, json.loads(data)), data
                    checked["chunks"] += 1
        else:
            assert not errors(CHAT, json.loads(text)), text
            checked["whole"] += 1
    assert checked["whole"] >= 6 and checked["chunks"] >= 20, checked
