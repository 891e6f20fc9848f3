"""Hermes / Qwen2.5 tool calls (``--tool-call-parser hermes``, vLLM's name).

The format (Hermes 2 Pro's and Qwen2.5's chat templates, and the one jaxserve renders into the
system prompt for templates without tools, docs/tool_calling.md): each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``, on lines of
its own, e.g.::

    <tool_call>
    {"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}
    </tool_call>

Text outside the blocks is the content. Whitespace that only separates blocks from each other
or from the text (the newlines around them) is not content: whitespace is held until more text
follows; a block drops the whitespace before it, the content drops the whitespace after a block
when no content came before, and a reply with calls drops its trailing whitespace. A block whose
first non-blank character is not ``{``, or whose object has no string ``name``, is content as
written. Inside a block, text after the call's object is dropped; a block without its closing
tag still counts (a model that stops after the object).
"""

from __future__ import annotations

from jaxserve.entrypoints.tool_parsers.abstract_tool_parser import ParsedDelta, ToolParser
from jaxserve.sampling_params import SamplingParams

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (it may be the tag, cut)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class Hermes2ProToolParser(ToolParser):
    call_start = TOOL_CALL_START + "\n"
    call_end = "\n" + TOOL_CALL_END
    call_separator = "\n"

    def __init__(self, calls_only: bool = False):
        super().__init__(calls_only)
        self._state = "content"  # content | open (after the start tag) | call | close
        self._held = ""  # content held back: whitespace, or a block's opening
        self._has_content = False  # some content was sent
        self._drop_leading = False  # a block came first: drop the whitespace after it

    @classmethod
    def adjust_sampling_params(cls, sp: SamplingParams) -> None:
        # The tags are special tokens in some models' vocabularies (vLLM does the same).
        sp.skip_special_tokens = False

    def _content(self, out: ParsedDelta, text: str) -> None:
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        if body:
            if self._drop_leading:
                body, self._drop_leading = body.lstrip(), False
            out.content += body
            self._has_content = True

    def _consume(self, out: ParsedDelta) -> None:
        while self._buf:
            if self._state == "content":
                i = self._buf.find(TOOL_CALL_START)
                if i < 0:
                    keep = _partial_suffix(self._buf, TOOL_CALL_START)
                    self._content(out, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self._content(out, self._buf[:i])
                self._held += TOOL_CALL_START  # content again if this is no call
                self._buf = self._buf[i + len(TOOL_CALL_START):]
                self._state = "open"
            elif self._state == "open":
                body = self._buf.lstrip()
                self._held += self._buf[:len(self._buf) - len(body)]
                self._buf = body
                if not body:
                    return
                if body[0] == "{":
                    self._start_call()
                else:
                    self._not_a_call(out, "")
            elif self._state == "call":
                if not self._feed_call(out):
                    return
            else:  # close: drop what precedes the end tag
                i = self._buf.find(TOOL_CALL_END)
                if i < 0:
                    self._buf = self._buf[len(self._buf)
                                          - _partial_suffix(self._buf, TOOL_CALL_END):]
                    return
                self._buf = self._buf[i + len(TOOL_CALL_END):]
                self._state = "content"
                self._drop_leading = not self._has_content

    def _after_call(self) -> None:
        self._held = ""  # the whitespace before the block
        self._state = "close"

    def _not_a_call(self, out: ParsedDelta, raw: str) -> None:
        """The block is text: its opening (held) and ``raw`` go to the content."""
        held, self._held = self._held, ""
        self._content(out, held + raw)
        self._state = "content"

    def _finish(self, out: ParsedDelta) -> None:
        if self._state == "call":
            self._end_call(out)
        if self._state in ("content", "open"):
            rest = self._held + self._buf
            if self.num_calls:
                rest = rest.rstrip()
            out.content += rest.lstrip() if self._drop_leading else rest
        self._held = self._buf = ""
