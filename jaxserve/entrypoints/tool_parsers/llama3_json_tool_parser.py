"""Llama 3.1 / 3.2 JSON tool calls (``--tool-call-parser llama3_json``, vLLM's name).

The format (Meta's Llama 3.1 and 3.2 model cards, "JSON based tool calling"): the reply is the
call itself, a JSON object ``{"name": ..., "parameters": {...}}``, optionally after the
``<|python_tag|>`` token; vLLM's parser also takes several objects separated by ``;`` and the
key ``arguments`` for ``parameters``, and so does this one.

The first non-blank text decides: ``{`` or ``<|python_tag|>`` starts calls, anything else makes
the whole reply content (as written, leading whitespace included). After a call, blanks and
``;`` separate the next ``{``; other text, or an object without a string ``name``, turns the
rest of the reply into content.
"""

from __future__ import annotations

from jaxserve.entrypoints.tool_parsers.abstract_tool_parser import ParsedDelta, ToolParser

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"  # between calls


class Llama3JsonToolParser(ToolParser):
    arguments_keys = ("parameters", "arguments")
    call_separator = "; "

    def __init__(self, calls_only: bool = False):
        super().__init__(calls_only)
        self._state = "start"  # start | between (calls) | call | content

    def _consume(self, out: ParsedDelta) -> None:
        while self._buf:
            if self._state == "start":
                body = self._buf.lstrip()
                if not body or (PYTHON_TAG.startswith(body) and body != PYTHON_TAG):
                    return  # undecided: hold it
                if body.startswith(PYTHON_TAG):
                    self._buf, self._state = body[len(PYTHON_TAG):], "between"
                elif body[0] == "{":
                    self._buf, self._state = body, "between"
                else:
                    self._state = "content"
            elif self._state == "between":
                self._buf = body = self._buf.lstrip(_SEPARATORS)
                if not body:
                    return
                if body[0] == "{":
                    self._start_call()
                else:
                    self._state = "content"
            elif self._state == "call":
                if not self._feed_call(out):
                    return
            else:
                out.content += self._buf
                self._buf = ""

    def _after_call(self) -> None:
        self._state = "between"

    def _not_a_call(self, out: ParsedDelta, raw: str) -> None:
        out.content += raw
        self._state = "content"

    def _finish(self, out: ParsedDelta) -> None:
        if self._state == "call":
            self._end_call(out)
        if self._state in ("start", "content"):
            out.content += self._buf
        self._buf = ""
