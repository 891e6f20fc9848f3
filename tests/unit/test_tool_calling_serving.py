"""Tool calling through the real aiohttp app with a fake engine (tests/unit/test_openai_serving.py's
FakeLLM) that writes a Hermes tool call: the non-streamed message and the streamed deltas
carry the same calls, ``finish_reason`` is ``tool_calls``, every body validates against
OpenAI's schema, and bad tool fields are 400s naming the field. ``required``, a named function
and a strict tool reach the engine as tool_grammar.py's grammar, checked by the real
GrammarValidator (llguidance, the default model's tokenizer)."""

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_openai_serving import FakeLLM, _call, _events

from jaxserve.entrypoints.api_server import build_app
from jaxserve.entrypoints.tool_grammar import tool_call_grammar
from jaxserve.entrypoints.tool_parsers import TOOL_PARSERS
from jaxserve.model_loader import default_tokenizer
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.structured_output.validator import GrammarValidator
from tests.openai_schema import CHAT, CHAT_CHUNK, errors

CALL_TEXT = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
             '\n</tool_call>')
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
SPECIAL_TOKENS = ["<|im_end|>"]


class ToolCallLLM(FakeLLM):
    """Writes CALL_TEXT in pieces of 7 characters, then EOS."""

    class tokenizer:  # what serving reads of the tokenizer
        all_special_tokens = SPECIAL_TOKENS

    validator: GrammarValidator | None = None  # set by the tests that constrain

    async def check_structured_outputs(self, so):
        await self.validator.check(so)

    async def encode_chat(self, messages, add_generation_prompt=True, add_special_tokens=False,
                          tools=None, *args):
        self.last_tools = tools
        return await super().encode_chat(messages)

    async def outputs(self, request_id, ids):
        pieces = [CALL_TEXT[i:i + 7] for i in range(0, len(CALL_TEXT), 7)] + [""]
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1
            yield RequestOutput(request_id, None, ids, [CompletionOutput(
                0, text, [10 + i], "stop" if last else None)], finished=last)


def test_tool_calls_whole_and_streamed_agree():
    llm = ToolCallLLM()
    body = {"messages": MESSAGES, "tools": [WEATHER]}
    status, _, text = _call("/v1/chat/completions", body, llm)
    assert status == 200, text
    whole = json.loads(text)
    assert not errors(CHAT, whole)
    assert llm.last_tools == [WEATHER] and llm.last_sampling_params.skip_special_tokens is False
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}

    _, _, text = _call("/v1/chat/completions", {**body, "stream": True}, ToolCallLLM())
    chunks = _events(text)
    assert chunks[-1] == "[DONE]"
    content, calls, finish = "", [], None
    for chunk in chunks[:-1]:
        assert not errors(CHAT_CHUNK, {**chunk, "id": "x", "created": 0}), chunk
        (c,) = chunk["choices"]
        delta = c["delta"]
        content += delta.get("content") or ""
        for d in delta.get("tool_calls", []):
            if "id" in d:
                assert d["type"] == "function" and d["function"]["arguments"] == ""
                calls.append({"name": d["function"]["name"], "arguments": ""})
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
        finish = c["finish_reason"] or finish
    assert (content, calls, finish) == ("Checking.", [call["function"]], "tool_calls")


def test_tool_choice_none_returns_text():
    status, _, text = _call("/v1/chat/completions", {"messages": MESSAGES, "tools": [WEATHER],
                                                     "tool_choice": "none"}, ToolCallLLM())
    choice = json.loads(text)["choices"][0]
    assert status == 200 and choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == CALL_TEXT and "tool_calls" not in choice["message"]


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "get weather!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),  # no tool_call_id
    ({"messages": [{"role": "user", "content": None}]}, "messages"),  # OpenAI: content required
    ({"messages": [{"role": "system"}, {"role": "user", "content": "hi"}]}, "messages"),
    ({"messages": MESSAGES + [{"role": "assistant", "content": None}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages"),
])
def test_bad_tool_fields_are_400s_naming_the_field(fields, param):
    status, _, text = _call("/v1/chat/completions", {"messages": MESSAGES, **fields},
                            ToolCallLLM())
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == param, err


def test_history_with_tool_calls_and_results_is_accepted():
    llm = ToolCallLLM()
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    status, _, text = _call("/v1/chat/completions", {"messages": messages, "tools": [WEATHER],
                                                     "tool_choice": "none"}, llm)
    assert status == 200, text


@pytest.fixture(scope="module")
def validator():
    tokenizer = default_tokenizer()
    return GrammarValidator(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _constrained(validator, body):
    """(status, body) of a chat request with tools, and the grammar it ran under (or None)."""
    llm = ToolCallLLM()
    llm.validator = validator
    status, _, text = _call("/v1/chat/completions", {"messages": MESSAGES, **body}, llm)
    sp = getattr(llm, "last_sampling_params", None)
    so = sp and sp.structured_outputs
    return status, json.loads(text), so and so.grammar


@pytest.mark.parametrize("tool_choice,strict,enforced", [
    ("required", False, "required"),
    ({"type": "function", "function": {"name": "get_weather"}}, False, "get_weather"),
    ("auto", True, "auto"),
    ("auto", False, None),
    ("none", True, None),
])
def test_enforced_tool_choice_runs_under_its_grammar(validator, tool_choice, strict, enforced):
    tool = {"type": "function", "function": {**WEATHER["function"], "strict": strict}}
    status, body, grammar = _constrained(validator, {"tools": [tool], "tool_choice": tool_choice})
    assert status == 200, body
    expected = None if enforced is None else tool_call_grammar(
        TOOL_PARSERS["hermes"], [tool["function"]], enforced, special_tokens=SPECIAL_TOKENS)
    assert grammar == expected
    if tool_choice != "none":
        assert body["choices"][0]["finish_reason"] == "tool_calls"
        # An enforced choice's reply is calls only: text around them is no content.
        calls_only = enforced not in (None, "auto")
        assert body["choices"][0]["message"]["content"] == (None if calls_only else "Checking.")


@pytest.mark.parametrize("constraint", [{"response_format": {"type": "json_object"}},
                                        {"guided_regex": "[a-z]+"},
                                        {"structured_outputs": {"choice": ["a", "b"]}}])
def test_enforced_tool_choice_and_an_output_constraint_are_a_400(validator, constraint):
    status, body, _ = _constrained(validator, {"tools": [WEATHER], "tool_choice": "required",
                                               **constraint})
    assert status == 400 and body["error"]["param"] == "tool_choice", body
    # Under auto without a strict tool nothing is enforced: the constraint alone applies.
    status, body, _ = _constrained(validator, {"tools": [WEATHER], **constraint})
    assert status == 200, body


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}},
    {"type": "object", "properties": {"x": {"enum": [f"{i:06d}" * 20 for i in range(1000)]}}},
])
def test_a_tool_grammar_that_does_not_compile_is_a_400_on_tools(validator, parameters):
    """A dangling $ref, and a grammar past the spec size limit (the schemas are in it)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    status, body, _ = _constrained(validator, {"tools": [tool], "tool_choice": "required"})
    assert status == 400 and body["error"]["param"] == "tools", body
    assert body["error"]["message"].startswith("tools: the grammar that enforces the tool calls")


def test_parameters_nested_too_deeply_for_the_grammar_are_a_400_on_tools():
    """JSON nested about as deep as the body parser takes (900 lists: too deep for the client
    side's json.dumps here, so the body is written by hand) fails rewriting the grammar."""
    parameters = '{"anyOf": ' + "[" * 900 + "]" * 900 + "}"
    body = ('{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required", '
            '"tools": [{"type": "function", "function": {"name": "f", "parameters": '
            + parameters + "}}]}")

    async def go():
        async with TestClient(TestServer(build_app(ToolCallLLM()))) as client:
            resp = await client.post("/v1/chat/completions", data=body)
            return resp.status, await resp.json()

    status, out = asyncio.run(go())
    assert status == 400 and out["error"]["param"] == "tools", out
