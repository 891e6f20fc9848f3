"""The OpenAI bodies of one generation request: ``Bodies``, what ``serving_stream.run_request``
asks of an endpoint (the whole body, the stream's events), and its implementation for
/v1/completions and /v1/chat/completions (``ChoiceBodies``): whole responses and stream chunks
built from RequestOutput deltas (protocol.py's models), with their choices' log-probabilities in
each endpoint's format. (/v1/responses: responses_bodies.py.)

A request has one or more prompts (a completions prompt list) and ``n`` choices per prompt:
choice ``c`` of prompt ``p`` is the body's choice ``p * n + c``, as OpenAI numbers them. Every
choice keeps its own progress (``ChoiceState``), so a streamed choice's chunks add up to the
non-streamed choice, log-probabilities included.

Log-probability formats:
- completions (OpenAI's legacy ``logprobs: int``): ``tokens`` (each token's text),
  ``token_logprobs``, ``top_logprobs`` (token text -> log-probability: the token and the k most
  likely, most likely first) and ``text_offset`` (each token's character offset, counting the
  token texts before it; an echoed prompt starts the count). A choice's first echoed prompt
  token has no log-probability (nothing precedes it): OpenAI's legacy API and vLLM send null
  there, which OpenAI's own schema does not allow, so jaxserve treats that token as given:
  log-probability 0.0, itself its only alternative.
- chat (``logprobs: true``, ``top_logprobs: k``): one entry per token with its text, bytes,
  log-probability and the k most likely tokens (most likely first).
Log-probabilities below -9999.0 are sent as -9999.0 (OpenAI's value for "very unlikely"; JSON
has no -inf), as vLLM does.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass

from jaxserve.entrypoints.protocol import (
    ChatCompletionLogProb, ChatCompletionLogProbs, ChatCompletionLogProbsContent,
    ChatCompletionResponse, ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse, ChatMessage, CompletionLogProbs, CompletionResponse,
    CompletionResponseChoice, CompletionResponseStreamChoice, CompletionStreamResponse,
    DeltaFunctionCall, DeltaMessage, DeltaToolCall, ErrorResponse, FunctionCall,
    OpenAIBaseModel, PromptTokenUsageInfo, ToolCall, UsageInfo)
from jaxserve.entrypoints.tool_parsers import ToolCallDelta, ToolParser
from jaxserve.outputs import CompletionOutput, PositionLogprobs

MIN_LOGPROB = -9999.0

# (token id, its log-probabilities at its position; None for a prompt's first token)
Entry = tuple[int, PositionLogprobs | None]


def usage(num_prompt: int, num_output: int, num_cached: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_output,
                     total_tokens=num_prompt + num_output,
                     prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=num_cached))


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _ranked(pos: PositionLogprobs) -> list[tuple[int, float]]:
    """A position's (token id, log-probability) pairs, most likely first."""
    return sorted(((t, lp.logprob) for t, lp in pos.items()), key=lambda x: -x[1])


@dataclass
class ChoiceState:
    """One choice of the body: what it has produced so far.

    Attributes:
      index: its index in the body.
      text: its whole text (non-streamed body).
      token_ids: its generated ids.
      entries: its tokens' log-probability entries (when asked for).
      text_offset: characters of token text counted so far (completions logprobs).
      finish_reason: set once it ended.
      tool_parser: the parser following a streamed chat choice's text, when the request
        has tools.
    """

    index: int
    text: str = ""
    token_ids: list[int] | None = None
    entries: list[Entry] | None = None
    text_offset: int = 0
    finish_reason: str | None = None
    started: bool = False  # a streamed choice sent its echo / first chunk
    tool_parser: ToolParser | None = None  # a streamed chat choice's, with tools


class Bodies(abc.ABC):
    """What ``serving_stream.run_request`` sends for one request: the whole body, or the
    stream's events in order (the opening ones, those of each choice update, the closing ones,
    or the error ones once the stream has failed). An event is a response model, or a literal
    such as ``[DONE]``.

    Attributes:
      request_id: the body's ``id``.
      created: the request's creation time (unix seconds).
      model: the served model name.
      return_token_ids: the choices carry their token ids (vLLM's ``return_token_ids``), so a
        choice update with new ids and no text is an event too.
    """

    return_token_ids = False

    def __init__(self, request_id: str, model: str):
        self.request_id = request_id
        self.created = int(time.time())
        self.model = model

    @abc.abstractmethod
    def response(self, choices: list[ChoiceState], prompt_ids: list[list[int]], n: int,
                 usage_info: UsageInfo) -> OpenAIBaseModel:
        """The non-streamed body of the finished choices (in index order)."""

    def first_chunks(self, num_choices: int) -> list[OpenAIBaseModel]:
        """The events that open the stream, before any text."""
        return []

    @abc.abstractmethod
    def chunks(self, ch: ChoiceState, text: str, c: CompletionOutput,
               entries: list[Entry] | None,
               prompt_ids: list[int] | None) -> list[OpenAIBaseModel]:
        """The events of one choice update: the text, token ids and log-probabilities new since
        its last one (``prompt_ids`` rides along with its first token ids)."""

    @abc.abstractmethod
    def last_chunks(self, usage_info: UsageInfo) -> list[OpenAIBaseModel | str]:
        """The events that close a stream whose choices all finished."""

    def error_chunks(self, error: ErrorResponse) -> list[OpenAIBaseModel | str]:
        """The events that end a stream that failed after its headers were sent."""
        return [error, "[DONE]"]


class ChoiceBodies(Bodies):
    """The bodies of /v1/completions and /v1/chat/completions: ``choices``, whole or one
    chunk per choice update, then the usage chunk when asked, then ``[DONE]``. Subclasses say
    how the endpoint's choice and log-probabilities look.

    Args:
      request_id: the body's ``id``.
      model: the served model name.
      num_logprobs: alternatives per token (SamplingParams.logprobs), None for no logprobs.
      piece: token id -> (text, bytes) (TokenPieces.piece), for log-probabilities.
      return_token_ids: add the choice's ``prompt_token_ids`` and ``token_ids`` (vLLM's).
      include_usage: end a stream with a usage chunk (``stream_options.include_usage``).
    """

    response_cls: type[OpenAIBaseModel]
    stream_cls: type[OpenAIBaseModel]

    def __init__(self, request_id: str, model: str, *, num_logprobs: int | None = None,
                 piece: Callable[[int], tuple[str, bytes]] | None = None,
                 return_token_ids: bool = False, include_usage: bool = False):
        super().__init__(request_id, model)
        self.num_logprobs = num_logprobs
        self.piece = piece
        self.return_token_ids = return_token_ids
        self.include_usage = include_usage

    @abc.abstractmethod
    def _choice(self, ch: ChoiceState, text: str, logprobs, **ids) -> OpenAIBaseModel:
        """A choice of the non-streamed body."""

    @abc.abstractmethod
    def _stream_choice(self, ch: ChoiceState, text: str, logprobs,
                       **ids) -> OpenAIBaseModel | None:
        """A choice of a streamed chunk (None: nothing to send)."""

    @abc.abstractmethod
    def _logprobs(self, ch: ChoiceState, entries: list[Entry]) -> OpenAIBaseModel:
        """The endpoint's log-probabilities of some of ``ch``'s tokens (advances its offset)."""

    def _body(self, cls, choices: list, usage_info: UsageInfo | None = None) -> OpenAIBaseModel:
        return cls(id=self.request_id, created=self.created, model=self.model, choices=choices,
                   usage=usage_info)

    def _ids(self, prompt_ids: list[int] | None, token_ids: list[int]) -> dict:
        if not self.return_token_ids:
            return {}
        return {"prompt_token_ids": prompt_ids, "token_ids": token_ids}

    def response(self, choices: list[ChoiceState], prompt_ids: list[list[int]], n: int,
                 usage_info: UsageInfo) -> OpenAIBaseModel:
        out = []
        for ch in choices:
            lp = None if ch.entries is None else self._logprobs(ch, ch.entries)
            out.append(self._choice(ch, ch.text, lp, **self._ids(prompt_ids[ch.index // n],
                                                                   ch.token_ids or [])))
        return self._body(self.response_cls, out, usage_info)

    def chunks(self, ch: ChoiceState, text: str, c: CompletionOutput,
               entries: list[Entry] | None,
               prompt_ids: list[int] | None) -> list[OpenAIBaseModel]:
        """One chunk of the choice, or none when there is nothing to send (a tool parser holds
        the text back)."""
        lp = None if entries is None else self._logprobs(ch, entries)
        ids = self._ids(prompt_ids, list(c.token_ids))
        choice = self._stream_choice(ch, text, lp, **ids)
        return [] if choice is None else [self._body(self.stream_cls, [choice])]

    def last_chunks(self, usage_info: UsageInfo) -> list[OpenAIBaseModel | str]:
        """The usage chunk (``stream_options.include_usage``: usage, no choices), then
        ``[DONE]``."""
        usage_chunk = [self._body(self.stream_cls, [], usage_info)] if self.include_usage else []
        return [*usage_chunk, "[DONE]"]


class CompletionBodies(ChoiceBodies):
    response_cls = CompletionResponse
    stream_cls = CompletionStreamResponse

    def _choice(self, ch, text, logprobs, **ids) -> CompletionResponseChoice:
        return CompletionResponseChoice(index=ch.index, text=text, logprobs=logprobs,
                                        finish_reason=ch.finish_reason, **ids)

    def _stream_choice(self, ch, text, logprobs, **ids) -> CompletionResponseStreamChoice:
        return CompletionResponseStreamChoice(index=ch.index, text=text, logprobs=logprobs,
                                              finish_reason=ch.finish_reason, **ids)

    def _logprobs(self, ch: ChoiceState, entries: list[Entry]) -> CompletionLogProbs:
        out = CompletionLogProbs()
        for token, pos in entries:
            text = self.piece(token)[0]
            if pos is None:  # a prompt's first token: given (module docstring)
                top, lp = {text: 0.0}, 0.0
            else:
                top = {self.piece(t)[0]: _clamp(v) for t, v in _ranked(pos)}
                lp = _clamp(pos[token].logprob)
            out.tokens.append(text)
            out.token_logprobs.append(lp)
            out.top_logprobs.append(top)
            out.text_offset.append(ch.text_offset)
            ch.text_offset += len(text)
        return out


class ChatBodies(ChoiceBodies):
    """Args (besides ChoiceBodies'):
      tool_parser: the ToolParser class that reads tool calls out of the choices' text
        (docs/tool_calling.md), or None when the request has no tools (or ``tool_choice:
        none``). A choice that returned calls and stopped has ``finish_reason: tool_calls``.
    """

    response_cls = ChatCompletionResponse
    stream_cls = ChatCompletionStreamResponse

    def __init__(self, *args, tool_parser: type[ToolParser] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_parser = tool_parser

    def _choice(self, ch, text, logprobs, **ids) -> ChatCompletionResponseChoice:
        message, finish_reason = ChatMessage(content=text), ch.finish_reason
        if self.tool_parser is not None:
            parsed = self.tool_parser().extract_tool_calls(text)
            calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                     for c in parsed.tool_calls]
            message = ChatMessage(content=parsed.content, tool_calls=calls or None)
            finish_reason = _finish_reason(finish_reason, len(calls))
        return ChatCompletionResponseChoice(index=ch.index, message=message, logprobs=logprobs,
                                            finish_reason=finish_reason, **ids)

    def _stream_choice(self, ch, text, logprobs, **ids) -> ChatCompletionResponseStreamChoice | None:
        # No new text (the finishing chunk, or token ids alone): an empty delta, {}.
        delta, finish_reason = DeltaMessage(content=text or None), ch.finish_reason
        if self.tool_parser is not None:
            if ch.tool_parser is None:
                ch.tool_parser = self.tool_parser()
            parsed = ch.tool_parser.feed(text)
            if finish_reason is not None:
                end = ch.tool_parser.finish()
                parsed.content += end.content
                parsed.tool_calls += end.tool_calls
            delta = DeltaMessage(content=parsed.content or None, tool_calls=[
                _delta_tool_call(d) for d in parsed.tool_calls] or None)
            finish_reason = _finish_reason(finish_reason, ch.tool_parser.num_calls)
            if (delta.content is None and delta.tool_calls is None and finish_reason is None
                    and logprobs is None and not ids.get("token_ids")):
                return None
        return ChatCompletionResponseStreamChoice(
            index=ch.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason, **ids)

    def _entry(self, token: int, logprob: float) -> ChatCompletionLogProb:
        text, data = self.piece(token)
        return ChatCompletionLogProb(token=text, logprob=_clamp(logprob), bytes=list(data))

    def _logprobs(self, ch: ChoiceState, entries: list[Entry]) -> ChatCompletionLogProbs:
        content = []
        for token, pos in entries:
            top = [self._entry(t, v) for t, v in _ranked(pos)[: self.num_logprobs]]
            e = self._entry(token, pos[token].logprob)
            content.append(ChatCompletionLogProbsContent(**e.model_dump(), top_logprobs=top))
        return ChatCompletionLogProbs(content=content)

    def first_chunks(self, num_choices: int) -> list[ChatCompletionStreamResponse]:
        """The role chunk OpenAI opens a chat stream with, one per choice."""
        return [self._body(self.stream_cls, [ChatCompletionResponseStreamChoice(
            index=i, delta=DeltaMessage(role="assistant", content=""))])
            for i in range(num_choices)]


def _finish_reason(finish_reason: str | None, num_calls: int) -> str | None:
    """A chat choice's finish reason: ``tool_calls`` when it stopped after returning calls
    (a choice cut by max_tokens keeps ``length``: its last call may be incomplete)."""
    return "tool_calls" if finish_reason == "stop" and num_calls else finish_reason


def _delta_tool_call(d: ToolCallDelta) -> DeltaToolCall:
    if d.id is None:
        return DeltaToolCall(index=d.index, function=DeltaFunctionCall(arguments=d.arguments))
    return DeltaToolCall(index=d.index, id=d.id, type="function",
                         function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
