"""ToolParser: a model's text -> content and OpenAI tool calls, incrementally (vLLM's name).

One parser instance follows one choice. ``feed(text)`` takes the text new since the last call
and returns a ``ParsedDelta`` (content to send, tool-call fragments to send); ``finish()`` ends
the choice. The fragments follow OpenAI's streamed format: a call's first fragment has its
``index``, ``id`` and ``name`` (arguments ""), the next ones argument text only.
``extract_tool_calls(text)`` is the same machine fed the whole text at once, folded into one
``ExtractedToolCalls``, so a streamed choice's deltas join to exactly the non-streamed result
whatever the chunking (the tests feed one character at a time).

What a subclass decides is where calls are in the text (its ``_consume`` / ``_finish``) and
what follows a call or an object that is none (``_after_call`` / ``_not_a_call``); the handling
of one call, a ``CallObject``, is shared here:
- the name fragment goes out once the ``name`` string is complete, then the arguments' text as
  it arrives (the model's own JSON text of the value; ``{}`` when its object closed without
  one);
- an object without a string ``name`` is no call: its text goes back to the content;
- a call cut short (max_tokens) keeps what it has; its arguments may then be invalid JSON,
  which OpenAI's API warns of too.
"""

from __future__ import annotations

import abc
import uuid
from dataclasses import dataclass, field

from jaxserve.entrypoints.tool_parsers.call_object import CallObject
from jaxserve.sampling_params import SamplingParams


def make_tool_call_id() -> str:
    """A unique call id in OpenAI's shape (``call_`` and 24 characters)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """A fragment of call ``index``: its first has ``id`` and ``name``, the rest None."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedDelta:
    """What one ``feed`` or ``finish`` adds to the choice."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ExtractedToolCalls:
    """A whole choice: its content (None when it is only calls) and its calls."""

    content: str | None
    tool_calls: list[ToolCall]


class ToolParser(abc.ABC):
    """Args:
      calls_only: the reply holds calls only (an enforced ``tool_choice``: ``required`` or a
        named function): what is not a call is the format's markup, or a call cut before its
        name was complete, and is dropped instead of sent as content.

    Attributes:
      arguments_keys: the call object's keys for its arguments (CallObject).
      call_start, call_end, call_separator: the format's text around and between calls.
      num_calls: calls started so far (their name sent).
    """

    arguments_keys: tuple[str, ...] = ("arguments",)
    # How the format writes calls, for the grammar that enforces them (tool_grammar.py): each
    # call is call_start + {"name": ..., arguments_keys[0]: ...} + call_end, and several
    # calls are joined by call_separator.
    call_start: str = ""
    call_end: str = ""
    call_separator: str = ""

    def __init__(self, calls_only: bool = False):
        self.calls_only = calls_only
        self.num_calls = 0
        self._buf = ""  # text received and not consumed yet
        self._call: CallObject | None = None
        self._call_id: str | None = None  # set once the current call's name went out
        self._sent_arguments = 0
        self._state = ""  # the subclass's; "call" while a call's object is being read

    @classmethod
    def adjust_sampling_params(cls, sp: SamplingParams) -> None:
        """Change a request's sampling params for this format (vLLM's ``adjust_request``)."""

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        self._consume(out)
        return self._sent(out)

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._finish(out)
        return self._sent(out)

    def _sent(self, out: ParsedDelta) -> ParsedDelta:
        if self.calls_only:
            out.content = ""
        return out

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """A whole choice's text -> content and calls (a fresh parser: call it once)."""
        content, calls = "", []
        for delta in (self.feed(text), self.finish()):
            content += delta.content
            for d in delta.tool_calls:
                if d.id is not None:
                    calls.append(ToolCall(d.id, d.name, ""))
                calls[d.index].arguments += d.arguments
        return ExtractedToolCalls(content or (None if calls else ""), calls)

    @abc.abstractmethod
    def _consume(self, out: ParsedDelta) -> None:
        """Consume what it can of ``self._buf`` into ``out``."""

    @abc.abstractmethod
    def _finish(self, out: ParsedDelta) -> None:
        """The text has ended: flush what is held into ``out``."""

    # -- the current call ------------------------------------------------------------------------

    def _start_call(self) -> None:
        self._call = CallObject(self.arguments_keys)
        self._call_id, self._sent_arguments = None, 0
        self._state = "call"

    def _feed_call(self, out: ParsedDelta) -> bool:
        """Feed the buffer to the current call and send its news; True once it has closed
        (and ended: ``_end_call``)."""
        call = self._call
        used = call.feed(self._buf)
        self._buf = self._buf[used:]
        if self._call_id is None and call.name is not None:
            self._call_id = make_tool_call_id()
            out.tool_calls.append(ToolCallDelta(self.num_calls, "", self._call_id, call.name))
            self.num_calls += 1
        self._send_arguments(out, call.arguments())
        if call.closed:
            self._end_call(out)
        return call.closed

    def _send_arguments(self, out: ParsedDelta, text: str) -> None:
        if self._call_id is not None and len(text) > self._sent_arguments:
            out.tool_calls.append(ToolCallDelta(self.num_calls - 1,
                                                text[self._sent_arguments:]))
            self._sent_arguments = len(text)

    def _end_call(self, out: ParsedDelta) -> None:
        """End the current call (closed, or cut short by the end of the text)."""
        call, self._call = self._call, None
        if self._call_id is None:
            self._not_a_call(out, call.raw)
        else:
            self._send_arguments(out, call.final_arguments())
            self._after_call()

    @abc.abstractmethod
    def _not_a_call(self, out: ParsedDelta, raw: str) -> None:
        """What looked like a call is text (``raw``: the object's text, if any)."""

    @abc.abstractmethod
    def _after_call(self) -> None:
        """A call has ended: go on after it."""
