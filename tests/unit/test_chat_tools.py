"""Tools in the prompt (jaxserve/engine/chat_tools.py through InputProcessor.tokenize_chat): the
default model's ChatML template ignores tools, so they, the assistant's calls and the tool
results are written in the Hermes format; a template that renders tools gets them itself."""

import copy
import json

import pytest

from jaxserve.engine.chat_tools import template_handles_tools
from jaxserve.engine.input_processor import InputProcessor, chat_text_bytes

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]
# A template that knows tools (the shape of Qwen2.5's, much shortened).
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}"
    "{% for c in m.tool_calls or [] %} CALL {{ c.function | tojson }}{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.model_loader.dummy import default_tokenizer

    return default_tokenizer()


def test_default_template_gets_hermes_tools_and_history(tokenizer):
    assert not template_handles_tools(tokenizer)
    text, ids = InputProcessor(tokenizer, 4096, len(tokenizer)).tokenize_chat(
        HISTORY, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools\n")  # replaces the default system text
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n') in text
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain"
            "\n</tool_response><|im_end|>") in text
    assert "<|im_start|>tool" not in text and text.endswith("<|im_start|>assistant\n")
    assert ids == tokenizer.encode(text, add_special_tokens=False)


def test_system_message_keeps_its_text_and_gets_the_tools(tokenizer):
    text, _ = InputProcessor(tokenizer, 4096, len(tokenizer)).tokenize_chat(
        [{"role": "system", "content": "Be brief."}, HISTORY[0]], tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    plain, _ = InputProcessor(tokenizer, 4096, len(tokenizer)).tokenize_chat(HISTORY[:1])
    assert "<tools>" not in plain and "SmolLM" in plain  # no tools: the template's own prompt


def test_template_that_knows_tools_renders_them(tokenizer):
    tok = copy.copy(tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    assert template_handles_tools(tok)
    text, _ = InputProcessor(tok, 4096, len(tok)).tokenize_chat(HISTORY, tools=[WEATHER])
    assert text.startswith("TOOLS " + json.dumps([WEATHER]))
    assert 'CALL {"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "[tool] sunny" in text and "<tool_response>" not in text


def test_text_size_counts_tools_and_calls():
    assert chat_text_bytes(HISTORY[:1]) == len(HISTORY[0]["role"] + HISTORY[0]["content"])
    assert chat_text_bytes(HISTORY, [WEATHER]) > sum(len(m["content"]) for m in HISTORY) + \
        len(json.dumps(WEATHER))
