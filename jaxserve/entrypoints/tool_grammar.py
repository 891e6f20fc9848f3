"""The grammar that enforces ``tool_choice`` (docs/tool_calling.md).

``tool_choice: "required"`` and a named function must give calls whose arguments validate
against the function's ``parameters``, and ``strict: true`` asks the same of any call the model
makes. jaxserve enforces them with structured outputs: the request's
``SamplingParams.structured_outputs`` gets a Lark grammar (llguidance's dialect) that allows
exactly the tool-call format the server's parser reads (``ToolParser.call_start`` /
``call_end`` / ``call_separator``), each call's JSON object given as an inline JSON schema
(``%json {...}``): ``{"name": <const>, <arguments key>: <parameters>}``, both required, no other
key, written with ``": "`` and ``", "`` and no other whitespace. For the Hermes format and functions ``f`` and ``g``::

    start: call ("\\n" call)*
    call: "<tool_call>\\n" (fn_0 | fn_1) "\\n</tool_call>"
    fn_0: %json {"type": "object", "properties": {"name": {"const": "f"}, "arguments": ...}, ...}

- ``required``: one call or more (exactly one with ``parallel_tool_calls: false``), to any of
  the tools;
- a named function: exactly one call, to that function;
- ``auto`` with a ``strict`` tool: free text, in which every call (the text from
  ``call_start`` on) must be well formed: a strict function's arguments match its parameters,
  the others' are any JSON object. Formats whose calls have no opening text (Llama 3.x JSON)
  read a reply that starts with ``{`` as a call: there the reply is either text that does not
  start with ``{``, or calls.

A delimiter that is a special token of the tokenizer (``<tool_call>`` in some vocabularies) is
written as a token reference (``<tool_call>``), the rest as string literals. A function
without ``parameters`` takes an empty object, as OpenAI reads it. The parameters' local
``$ref``s are rebased onto where the schema sits in the call object's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from jaxserve.entrypoints.tool_parsers import ToolParser

_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_ANY_OBJECT = {"type": "object"}
# llguidance's JSON options: the separators of the documented call format and no other
# whitespace (free whitespace lets a model pad a call with blanks until max_tokens).
_COMPACT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
# Schema keywords whose values are data (never rebased), and those whose values map names
# (which may be anything, "enum" included) to schemas.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})


def _lark_text(text: str, special_tokens: Iterable[str]) -> str:
    """``text`` as a sequence of Lark items: special tokens as references, the rest as
    string literals (nothing for empty text)."""
    specials = sorted((t for t in special_tokens if t and t in text), key=len, reverse=True)
    pieces = re.split("(" + "|".join(map(re.escape, specials)) + ")", text) if specials else [text]
    return " ".join(p if p in specials else json.dumps(p) for p in pieces if p)


def _seq(*items: str) -> str:
    """Lark items in sequence (empty ones left out)."""
    return " ".join(i for i in items if i)


def _rebased(schema, prefix: str):
    """``schema`` with its local references (``"$ref": "#/$defs/Unit"``, ``"#"``) pointing
    below ``prefix``, the pointer of where it now sits: a reference resolves against the whole
    document, which is the call object's schema, not the parameters' (pydantic's schemas of
    nested models refer to their ``$defs`` so)."""
    if isinstance(schema, list):
        return [_rebased(s, prefix) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = prefix + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(s, prefix) for name, s in value.items()}
        else:
            out[key] = _rebased(value, prefix)
    return out


def call_schema(function: dict, arguments_key: str, *, enforce_parameters: bool = True) -> dict:
    """The JSON schema of one call object to ``function`` (an OpenAI function definition:
    ``name``, optional ``parameters``)."""
    arguments = _ANY_OBJECT
    if enforce_parameters:
        arguments = _rebased(function.get("parameters") or _NO_PARAMETERS,
                             f"#/properties/{arguments_key}")
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             arguments_key: arguments},
            "required": ["name", arguments_key], "additionalProperties": False,
            "x-guidance": _COMPACT}


def tool_call_grammar(parser: type[ToolParser], functions: list[dict], tool_choice: str, *,
                      parallel_tool_calls: bool = True,
                      special_tokens: Iterable[str] = ()) -> str | None:
    """The Lark grammar that enforces ``tool_choice`` (module docstring), or None when nothing
    is to be enforced (``auto`` without a strict function).

    Args:
      parser: the server's ToolParser class (its call format).
      functions: the request's function definitions (``name``, ``parameters``, ``strict``).
      tool_choice: ``auto``, ``required``, or the name of a function among ``functions``.
      parallel_tool_calls: whether ``required`` may give several calls.
      special_tokens: the tokenizer's special tokens (those the delimiters may be).
    """
    auto = tool_choice == "auto"
    if auto and not any(f.get("strict") for f in functions):
        return None
    if tool_choice not in ("auto", "required"):
        functions = [f for f in functions if f["name"] == tool_choice]
    key = parser.arguments_keys[0]
    rules = [f"fn_{i}: %json " + json.dumps(call_schema(
        f, key, enforce_parameters=not auto or bool(f.get("strict"))))
        for i, f in enumerate(functions)]
    body = _seq(f"({' | '.join(f'fn_{i}' for i in range(len(functions)))})",
                _lark_text(parser.call_end, special_tokens))
    calls = f"call ({_seq(_lark_text(parser.call_separator, special_tokens), 'call')})*"
    if not auto:
        start = f"start: {calls}" if tool_choice == "required" and parallel_tool_calls \
            else "start: call"
        rules += ["call: " + _seq(_lark_text(parser.call_start, special_tokens), body)]
    elif parser.call_start:
        rules += _auto_with_opening(parser.call_start, body, special_tokens)
        start = "start: block* TAIL"
    else:
        # No opening text: a reply whose first non-blank character is "{" is calls.
        start = f"start: TEXT | WS? {calls}"
        rules += [f"call: {body}", r"WS: /\s+/", r"TEXT: /\s*([^\s{](?s:.*))?/"]
    return "\n".join([start, *rules])


def _auto_with_opening(call_start: str, body: str, special_tokens: Iterable[str]) -> list[str]:
    """Rules of ``auto`` for a format whose calls open with a tag (``<tool_call>``): free
    text up to the tag, then a call; text after the last call holds no tag."""
    tag = call_start.strip()
    after = _lark_text(call_start[call_start.index(tag) + len(tag):], special_tokens)
    if tag in special_tokens:
        # Text never holds a special token: the token itself ends the text before it.
        return ["block: " + _seq("TEXT", tag, after, body), r"TEXT: /(?s:.*)/",
                r"TAIL: /(?s:.*)/"]
    return ["block: " + _seq("head", after, body), f"head[lazy]: TEXT {json.dumps(tag)}",
            r"TEXT: /(?s:.*)/", f"TAIL: /(?s:.*)/ & ~/(?s:.*){re.escape(tag)}(?s:.*)/"]
