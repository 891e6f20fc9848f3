"""ReasoningParser: a reasoning model's text -> its reasoning and its content, incrementally
(vLLM's name; its ``BaseThinkingReasoningParser`` rule, on text).

The model writes its reasoning, then ``end_tag``, then its answer. The output starts in the
reasoning (the chat template may have written ``start_tag`` itself, as DeepSeek-R1's and
Qwen3.5's do; a ``start_tag`` the model writes first, whitespace aside, is dropped), the
reasoning runs to the first ``end_tag`` (dropped), and all that follows is content. Without an
``end_tag`` the whole output is reasoning (the model was cut short). A request whose output does
not start in the reasoning (``starts_in_reasoning``) is all content.

One parser follows one choice: ``feed(text)`` takes the text new since the last call and returns
a ``ReasoningDelta``; it holds back only text that may be a tag split across deltas (``</thi``),
which ``finish()`` flushes. ``extract_reasoning(text)`` is the same machine fed the whole text,
so a streamed choice's deltas join to the non-streamed result whatever the chunking.
"""

from __future__ import annotations

from dataclasses import dataclass

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


@dataclass
class ReasoningDelta:
    """What one ``feed`` or ``finish`` adds: reasoning text, then content text."""

    reasoning: str = ""
    content: str = ""


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` without being all of it."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """Attributes:
      start_tag, end_tag: the text around the reasoning (the subclass's).

    Args:
      in_reasoning: the output starts in the reasoning (``starts_in_reasoning``); False: it
        is all content.
    """

    start_tag: str
    end_tag: str

    def __init__(self, in_reasoning: bool = True):
        self._state = _START if in_reasoning else _CONTENT
        self._buf = ""  # text received and not sent yet

    @classmethod
    def starts_in_reasoning(cls, prompt: str, chat_template_kwargs: dict | None = None) -> bool:
        """Whether the output of a chat rendered as ``prompt`` (the template's text) starts in
        the reasoning: unless the prompt itself ends with ``end_tag`` (trailing whitespace
        aside), as templates told not to think end it."""
        return not prompt.rstrip().endswith(cls.end_tag)

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self._buf += text
        if self._state == _START:
            head = self._buf.lstrip()
            if len(head) < len(self.start_tag) and self.start_tag.startswith(head):
                return out  # whitespace, or the start of start_tag: wait
            if head.startswith(self.start_tag):
                self._buf = head[len(self.start_tag):]
            self._state = _REASONING
        if self._state == _REASONING:
            end = self._buf.find(self.end_tag)
            if end < 0:
                cut = len(self._buf) - _partial_tag(self._buf, self.end_tag)
                out.reasoning, self._buf = self._buf[:cut], self._buf[cut:]
                return out
            out.reasoning = self._buf[:end]
            self._buf = self._buf[end + len(self.end_tag):]
            self._state = _CONTENT
        out.content, self._buf = self._buf, ""
        return out

    def finish(self) -> ReasoningDelta:
        """The text has ended: what is held back was reasoning text, not a tag."""
        out = ReasoningDelta(reasoning=self._buf)
        self._buf = ""
        return out

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """A whole choice's text -> (reasoning, content) (a fresh parser: call it once).
        Either is None when empty, except the content of an output without reasoning (as
        vLLM returns them)."""
        reasoning = content = ""
        for delta in (self.feed(text), self.finish()):
            reasoning += delta.reasoning
            content += delta.content
        if not reasoning:
            return None, content
        return reasoning, content or None
