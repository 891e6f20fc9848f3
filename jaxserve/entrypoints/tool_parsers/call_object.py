"""CallObject: one tool call's JSON object, scanned as its text arrives.

A call is a JSON object such as ``{"name": "get_weather", "arguments": {"city": "Paris"}}``
(Hermes / Qwen2.5) or ``{"name": ..., "parameters": {...}}`` (Llama 3.x). The streaming parsers
need three things before the object is complete: where it ends (a ``}`` that closes it, not one
inside a string or a nested value), the function's name as soon as its string is complete, and
the text of the arguments value so far, so that argument fragments can go out as they arrive.

So this tracks only JSON's lexical structure (strings with their escapes, nesting depth, the
top-level ``key: value`` pairs) and keeps each top-level value's raw text; it does not check
the values (``json.loads`` decodes the name; the arguments are the model's own text). The
arguments the server returns are that raw text, so a streamed call's argument fragments join
to exactly the non-streamed call's ``arguments``.
"""

from __future__ import annotations

import json


class CallObject:
    """Args:
      arguments_keys: the top-level keys whose value is the call's arguments, in order of
        preference (Llama 3.x writes ``parameters``; vLLM's parser also takes ``arguments``).

    Attributes:
      raw: the object's text consumed so far (from its ``{``).
      closed: its closing ``}`` has been consumed.
    """

    def __init__(self, arguments_keys: tuple[str, ...]):
        self.arguments_keys = arguments_keys
        self.raw = ""
        self.closed = False
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect_key = False  # at depth 1, the next string is a key
        self._key_start: int | None = None
        self._key: str | None = None  # the top-level key whose value is being read
        self._value_start: int | None = None
        self._values: dict[str, str] = {}  # top-level key -> its complete value's raw text

    def feed(self, text: str) -> int:
        """Consume ``text`` up to the object's closing ``}``; returns the characters consumed
        (all of them unless the object closed inside ``text``)."""
        for n, c in enumerate(text):
            i = len(self.raw)
            self.raw += c
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    if self._key_start is not None:
                        self._key = json_as(self.raw[self._key_start:], str)
                        self._key_start = None
                continue
            if (self._depth == 1 and self._key is not None and self._value_start is None
                    and not self._expect_key and not c.isspace()):
                self._value_start = i
            if c == '"':
                self._in_string = True
                if self._depth == 1 and self._expect_key:
                    self._key_start = i
            elif c in "{[":
                self._depth += 1
                self._expect_key = self._depth == 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._end_value(i)
                    self.closed = True
                    return n + 1
            elif self._depth == 1 and c == ":":
                self._expect_key = False
            elif self._depth == 1 and c == ",":
                self._end_value(i)
                self._expect_key = True
        return len(text)

    def _end_value(self, end: int) -> None:
        if self._key is not None and self._value_start is not None:
            self._values[self._key] = self.raw[self._value_start:end].rstrip()
        self._key, self._value_start = None, None

    @property
    def name(self) -> str | None:
        """The ``name`` value once its string is complete (None before, or when it is not a
        string)."""
        raw = self._values.get("name")
        return None if raw is None else json_as(raw, str)

    def arguments(self) -> str:
        """The arguments' text so far: the complete value, else the part read (trailing
        whitespace held back: it may end the value, and the value's text is kept without it),
        else "" (no arguments key yet). Each result extends the previous one."""
        for key in self.arguments_keys:
            if key in self._values:
                return self._values[key]
        if self._key in self.arguments_keys and self._value_start is not None:
            return self.raw[self._value_start:].rstrip()
        return ""

    def final_arguments(self) -> str:
        """The arguments of the finished call: ``arguments()``, or ``{}`` when the model closed
        the object without any (OpenAI's arguments are always a string; a function without
        parameters gets ``{}``). A call cut short keeps what it has, "" included: ``{}``
        would pass for a complete call."""
        return self.arguments() or ("{}" if self.closed else "")


def json_as(text: str, kind: type):
    """``text`` decoded when it is JSON text of a ``kind`` value (``str``, ``dict``), else
    None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, kind) else None
