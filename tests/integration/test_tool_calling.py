"""Issue 14's tool calling over the real server (default model, ``--tool-call-parser hermes``,
the default) and the official ``openai`` client: ``auto`` answers are well formed whether or
not the model calls (parser-level behaviour is tests/unit/test_tool_parsers.py's), streamed
deltas reassemble into the non-streamed answer, ``none`` returns content only, a later turn
with the assistant's calls and the tool results is accepted, /tokenize renders the tools as
chat does, and every body on the wire validates against OpenAI's schema.

``required`` and a named function are enforced with structured outputs
(``SamplingParams.structured_outputs``, tool_grammar.py): until that field exists they are
refused, and the acceptance tests for them (100% of responses carry calls whose arguments
validate) are skipped. One server for the module (conftest.py's ``client`` records the
bodies); the tests run in file order.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_utils import Server

from jaxserve.sampling_params import SamplingParams
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
HAS_STRUCTURED_OUTPUTS = "structured_outputs" in SamplingParams.__struct_fields__
try:  # the HTTP library the openai client is built on (httpx2 in its 3.x releases)
    import httpx2 as httpx
except ImportError:
    import httpx

needs_structured_outputs = pytest.mark.skipif(
    not HAS_STRUCTURED_OUTPUTS, reason="needs SamplingParams.structured_outputs (issue 14)")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    srv = Server("--max-model-len", "1024", "--max-num-seqs", "8",
                 "--max-num-batched-tokens", "256")
    yield srv
    srv.stop()


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


@pytest.mark.parametrize("seed", range(4))
def test_auto_is_well_formed_and_streams_the_same(client, seed):
    """Whatever the model writes (a call, or text), the answer is one or the other in OpenAI's
    shape, finish_reason says which, and the stream joins to the same (same seed)."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, seed=seed, temperature=0.7)
    whole = _whole(client.chat.completions.create(**kw))
    content, calls, finish = whole
    if calls:
        assert finish in ("tool_calls", "length")
        assert {c["name"] for c in calls} <= {"get_weather", "get_time"} or finish == "length"
    else:
        assert finish in ("stop", "length") and content
    assert _streamed(client.chat.completions.create(**kw, stream=True)) == whole


def test_tool_choice_none_returns_content_only(client):
    for stream in (False, True):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=40,
                  temperature=0)
        if stream:
            content, calls, finish = _streamed(client.chat.completions.create(**kw, stream=True))
        else:
            content, calls, finish = _whole(client.chat.completions.create(**kw))
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


@pytest.mark.skipif(HAS_STRUCTURED_OUTPUTS, reason="structured outputs are here: enforced")
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_enforced_choices_are_refused_until_structured_outputs(client, choice):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice=choice, max_tokens=8)
    assert e.value.body["param"] == "tool_choice"


def _check_calls(calls, names):
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    for c in calls:
        assert c["name"] in names
        jsonschema.validate(json.loads(c["arguments"]), params[c["name"]])


@needs_structured_outputs
@pytest.mark.parametrize("stream", [False, True])
def test_required_always_gives_valid_calls(client, stream):
    for seed in range(10):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                  max_tokens=120, seed=seed, temperature=1.0)
        if stream:
            _, calls, finish = _streamed(client.chat.completions.create(**kw, stream=True))
        else:
            _, calls, finish = _whole(client.chat.completions.create(**kw))
        assert finish == "tool_calls"
        _check_calls(calls, {"get_weather", "get_time"})


@needs_structured_outputs
@pytest.mark.parametrize("stream", [False, True])
def test_named_function_always_gives_a_valid_call(client, stream):
    for seed in range(10):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, seed=seed,
                  temperature=1.0,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
        if stream:
            _, calls, finish = _streamed(client.chat.completions.create(**kw, stream=True))
        else:
            _, calls, finish = _whole(client.chat.completions.create(**kw))
        assert finish == "tool_calls" and len(calls) == 1
        _check_calls(calls, {"get_time"})


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
