"""Tools and tool turns for chat templates that do not render them (docs/tool_calling.md).

A chat template that knows tools (Hermes 2 Pro, Qwen2.5, Llama 3.1 ...) gets the request's
``tools`` through transformers' ``apply_chat_template(tools=...)`` and the history as OpenAI
sends it: assistant messages with ``tool_calls`` and ``tool`` messages. Many templates know
none of it; the default model's ChatML template renders only roles and contents. For those,
``hermes_messages`` writes everything into plain messages in the Hermes / Qwen2.5 format that
``--tool-call-parser hermes`` (the default) reads back:
- the tools: a block appended to the system message (a system message is added when there is
  none), listing each tool's JSON between ``<tools>`` and ``</tools>`` and asking for calls as
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``;
- an assistant message's calls: that same block per call after its text;
- ``tool`` messages: a user message holding each result between ``<tool_response>`` and
  ``</tool_response>`` (consecutive results share one message, as Qwen2.5's template does).

``template_handles_tools`` decides which path a tokenizer takes: it renders a probe
conversation with and without a probe tool (InputProcessor asks once); a template whose text does
not change ignores tools, and such a template is taken to ignore tool calls and tool messages
too (the templates that render tools render both).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

_TOOLS_PROMPT = """# Tools

You may call one or more functions to help with the user's request. The functions you can \
call are described in JSON between <tools></tools> tags:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object holding its name and its arguments between \
<tool_call></tool_call> tags, one block per call:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>"""

_PROBE_MESSAGES = [{"role": "user", "content": "Hello"}]
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "jaxserve_probe", "description": "probe",
    "parameters": {"type": "object", "properties": {}}}}]


def template_handles_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders ``tools``. A template that fails on the
    probe counts as one that does not."""
    try:
        with_tools = tokenizer.apply_chat_template(
            _PROBE_MESSAGES, tools=_PROBE_TOOLS, tokenize=False, add_generation_prompt=True)
        without = tokenizer.apply_chat_template(
            _PROBE_MESSAGES, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - the template's own errors, whatever they are
        return False
    return with_tools != without


def _call_block(call: dict) -> str:
    fn = call["function"]
    return ("<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": fn["arguments"]},
                                         ensure_ascii=False) + "\n</tool_call>")


def hermes_messages(messages: Sequence[dict], tools: Sequence[dict] | None) -> list[dict]:
    """Messages in the transformers chat format (``tool_calls``, ``tool`` roles) -> plain
    ``{"role", "content"}`` messages in the Hermes format (module docstring); other keys of a
    message (its reasoning) are kept.

    Args:
      messages: the conversation; a ``tool_calls`` entry's ``function.arguments`` is a dict,
        or the client's string when it was not a JSON object.
      tools: OpenAI tool definitions (``{"type": "function", "function": {...}}``), or None.
    """
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif m.get("tool_calls"):
            parts = [m["content"]] if m["content"] else []
            parts += [_call_block(c) for c in m["tool_calls"]]
            kept = {k: v for k, v in m.items() if k != "tool_calls"}
            out.append({**kept, "content": "\n".join(parts)})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("tool_results", None)
    if tools:
        prompt = _TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False)
                                                      for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
