"""Tool-call parsers (jaxserve/entrypoints/tool_parsers/) on model outputs in each format, as
the models' own documentation shows them, plus the edge cases the streaming machine must get
right. Every case is parsed whole and streamed (one character at a time, and in random
chunks): the streamed deltas must join to exactly the whole result."""

import json
import random

import pytest

from jaxserve.entrypoints.tool_parsers import TOOL_PARSERS

# Qwen2.5's "Function Calling" guide (qwen.readthedocs.io, framework/function_call): the model's
# answer to "What's the temperature in San Francisco now? How about tomorrow?", two parallel
# calls in Hermes blocks (the template's <|im_end|> is a stop token, not text).
QWEN25_PARALLEL = """<tool_call>
{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}
</tool_call>
<tool_call>
{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01"}}
</tool_call>"""

# Hermes 2 Pro's model card (huggingface.co/NousResearch/Hermes-2-Pro-Llama-3-8B, "Prompt Format
# for Function Calling"): the call as the model writes it, arguments before the name.
HERMES2PRO_CALL = """<tool_call>
{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}
</tool_call>"""

# Llama 3.1's prompt format (llama.com, model-cards-and-prompt-formats/llama3_1, "JSON based
# tool calling"; the Llama 3.2 card uses the same format): the reply is the JSON call.
LLAMA31_CALL = ('{"name": "get_current_conditions", "parameters": {"location": "San Francisco, '
                'CA", "unit": "Fahrenheit"}}')


def _stream(name: str, text: str, cuts: list[int], calls_only: bool = False):
    """(content or None, [(id, name, arguments)]) from streaming ``text`` cut at ``cuts``; checks
    the fragments' shape on the way."""
    parser = TOOL_PARSERS[name](calls_only)
    content, calls = "", []
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += delta.content
        for d in delta.tool_calls:
            if d.id is not None:
                assert d.index == len(calls) and d.arguments == "" and d.name
                calls.append([d.id, d.name, ""])
            else:
                assert d.name is None and d.arguments and d.index == len(calls) - 1
                calls[d.index][2] += d.arguments
    return content or (None if calls else ""), [tuple(c) for c in calls]


def parse(name: str, text: str, calls_only: bool = False):
    """The whole result, after checking that streaming in any chunks gives the same."""
    whole = TOOL_PARSERS[name](calls_only).extract_tool_calls(text)
    result = (whole.content, [(c.name, c.arguments) for c in whole.tool_calls])
    rng = random.Random(text)
    for cuts in [list(range(1, len(text)))] + [
            sorted(rng.sample(range(1, len(text)), min(k, max(len(text) - 1, 0))))
            for k in (2, 5, 9)]:
        content, calls = _stream(name, text, cuts, calls_only)
        assert (content, [c[1:] for c in calls]) == result, cuts
        assert all(c[0].startswith("call_") and len(c[0]) == 29 for c in calls)
    ids = [c.id for c in whole.tool_calls]
    assert len(set(ids)) == len(ids)
    return result


def test_hermes_qwen25_parallel_calls():
    content, calls = parse("hermes", QWEN25_PARALLEL)
    assert content is None
    assert calls == [
        ("get_current_temperature", '{"location": "San Francisco, CA, USA"}'),
        ("get_temperature_date", '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}')]
    for _, args in calls:
        json.loads(args)


def test_hermes_2_pro_call_with_arguments_first():
    assert parse("hermes", HERMES2PRO_CALL) == (None, [("get_stock_fundamentals",
                                                        '{"symbol": "TSLA"}')])


def test_hermes_text_around_calls_is_content():
    text = "Let me check the weather.\n\n" + HERMES2PRO_CALL + "\nI will get back to you. "
    content, calls = parse("hermes", text)
    assert content == "Let me check the weather.\nI will get back to you."
    assert [c[0] for c in calls] == ["get_stock_fundamentals"]


@pytest.mark.parametrize("text", [
    "The capital of France is Paris.\n",
    "  Indented, with a tag cut short at the end: <tool_ca",
    "Not a call: <tool_call> call get_weather(Paris) </tool_call> done",
    '<tool_call>\n{"function": "get_weather"}\n</tool_call>',  # no name: text
    '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',
])
def test_hermes_text_without_calls_is_kept_as_written(text):
    assert parse("hermes", text) == (text, [])


def test_hermes_json_aware_ends_and_leftovers():
    # The end tag and braces inside a string do not end the call; text after the object in
    # the block is dropped; a block without its end tag still counts; no arguments: {}.
    text = ('<tool_call>\n{"name": "echo", "arguments": {"s": "}</tool_call>\\"{"}} extra\n'
            '</tool_call>\n<tool_call>\n{"name": "now"}')
    assert parse("hermes", text) == (None, [("echo", '{"s": "}</tool_call>\\"{"}'),
                                            ("now", "{}")])


def test_hermes_call_cut_short_keeps_partial_arguments():
    assert parse("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2') == \
        (None, [("f", '{"a": [1, 2')])
    # Cut before its arguments: "" (not "{}", which would pass for a complete call)
    assert parse("hermes", '<tool_call>\n{"name": "f", "') == (None, [("f", "")])
    assert parse("llama3_json", '{"name": "f", "parameters": ') == (None, [("f", "")])


def test_calls_only_drops_what_is_no_call():
    """Under an enforced tool_choice the reply is calls only: a call cut before its name is
    complete, and the markup around calls, are no content."""
    cut = QWEN25_PARALLEL[:QWEN25_PARALLEL.index("get_temperature_date") + 8]
    assert parse("hermes", cut, calls_only=True) == (None, [
        ("get_current_temperature", '{"location": "San Francisco, CA, USA"}')])
    assert parse("hermes", '<tool_call>\n{"name": "', calls_only=True) == ("", [])
    assert parse("hermes", '<tool_call>\n{"name": "') == ('<tool_call>\n{"name": "', [])


def test_hermes_keeps_special_tokens():
    from jaxserve import SamplingParams

    sp = SamplingParams()
    TOOL_PARSERS["hermes"].adjust_sampling_params(sp)
    assert sp.skip_special_tokens is False


def test_llama3_json_model_card_call():
    assert parse("llama3_json", LLAMA31_CALL) == (None, [(
        "get_current_conditions", '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')])


def test_llama3_json_python_tag_several_calls_and_arguments_key():
    # vLLM's llama3_json parser reads these too: the <|python_tag|> opening, calls joined by
    # "; ", and "arguments" for "parameters".
    text = ('<|python_tag|>' + LLAMA31_CALL + '; {"name": "get_time", "arguments": '
            '{"zone": "PST"}}')
    content, calls = parse("llama3_json", text)
    assert content is None
    assert calls[1] == ("get_time", '{"zone": "PST"}') and len(calls) == 2


@pytest.mark.parametrize("text", [
    "  The weather in San Francisco is sunny.",
    '{"answer": 42}',  # JSON, but no call
    "",
])
def test_llama3_json_text_is_content(text):
    assert parse("llama3_json", text) == (text, [])


def test_llama3_json_text_after_calls_is_content():
    assert parse("llama3_json", LLAMA31_CALL + " Hope this helps.") == (
        "Hope this helps.", [("get_current_conditions",
                              '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')])
