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
  token has no log-probability (nothing precedes it): null for it and for its top ones, as
  OpenAI's legacy API and vLLM send them.
- chat (``logprobs: true``, ``top_logprobs: k``): one entry per token with its text, bytes,
  log-probability and the k most likely tokens (most likely first).
- vLLM's ``prompt_logprobs``: per prompt token, null for the first, then token id -> {logprob,
  rank, decoded_token} for the token and its k most likely alternatives; in each completions
  choice, at the top level of a chat completion (never in a stream).
With vLLM's ``return_tokens_as_token_ids`` a token's text in log-probabilities is
``token_id:{id}`` (its chat ``bytes`` that text's), so that tokens which are no valid UTF-8 on
their own stay apart. Log-probabilities below -9999.0 are sent as -9999.0 (OpenAI's value for
"very unlikely"; JSON has no -inf), as vLLM does.

Chat choices go through the ``--reasoning-parser``'s ReasoningParser first (its reasoning under
vLLM's two names) and the tool parser reads what follows the reasoning (docs/reasoning.md).
``echo`` puts the last message's content before the reply's (its own chunk in a stream, as
vLLM sends it). With ``continuous_usage_stats`` each chunk carries its choice's usage so far.
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
    OpenAIBaseModel, PromptLogprob, PromptTokenUsageInfo, ToolCall, UsageInfo)
from jaxserve.entrypoints.tool_parsers import ToolCallDelta, ToolParser
from jaxserve.outputs import CompletionOutput, PositionLogprobs
from jaxserve.reasoning import ReasoningParser

MIN_LOGPROB = -9999.0

# (token id, its log-probabilities at its position; None for a prompt's first token)
Entry = tuple[int, PositionLogprobs | None]


def usage(num_prompt: int, num_output: int, num_cached: int | None) -> UsageInfo:
    """The usage block; ``num_cached`` None (not known yet: a stream's opening chunk, sent
    before the engine has looked the prompt up) leaves ``prompt_tokens_details`` out."""
    details = None if num_cached is None else PromptTokenUsageInfo(cached_tokens=num_cached)
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_output,
                     total_tokens=num_prompt + num_output, prompt_tokens_details=details)


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _ranked(pos: PositionLogprobs) -> list[tuple[int, float]]:
    """A position's (token id, log-probability) pairs, most likely first."""
    return sorted(((t, lp.logprob) for t, lp in pos.items()), key=lambda x: -x[1])


def token_id_piece(token_id: int) -> tuple[str, bytes]:
    """vLLM's ``return_tokens_as_token_ids`` text of a token (and its bytes)."""
    text = f"token_id:{token_id}"
    return text, text.encode()


def prompt_logprobs_body(positions: list[PositionLogprobs | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs`` of one prompt (module docstring), or None."""
    if positions is None:
        return None
    return [None if pos is None else {
        t: PromptLogprob(logprob=_clamp(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
        for t, lp in pos.items()} for pos in positions]


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
      stop_reason: the stop string or stop token id that ended it (vLLM's), if one did.
      tool_parser: the parser following a streamed chat choice's text, when the request
        has tools.
      reasoning_parser: the parser following a streamed chat choice's text, with a
        ``--reasoning-parser``.
    """

    index: int
    text: str = ""
    token_ids: list[int] | None = None
    entries: list[Entry] | None = None
    text_offset: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    started: bool = False  # a streamed choice sent its echo / first chunk
    tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None


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
      continuous_usage: the stream's events carry the usage so far (vLLM's
        ``stream_options.continuous_usage_stats``): run_request hands it to ``first_chunks``
        and ``chunks``.
    """

    return_token_ids = False
    continuous_usage = False

    def __init__(self, request_id: str, model: str):
        self.request_id = request_id
        self.created = int(time.time())
        self.model = model

    @abc.abstractmethod
    def response(self, choices: list[ChoiceState], prompt_ids: list[list[int]], n: int,
                 usage_info: UsageInfo,
                 prompt_logprobs: list[list[PositionLogprobs | None] | None]) -> OpenAIBaseModel:
        """The non-streamed body of the finished choices (in index order); choice ``c`` is of
        prompt ``c // n``, whose ids and prompt log-probabilities (None where not computed)
        the lists hold."""

    def first_chunks(self, num_choices: int, prompt_ids: list[int],
                     usage_info: UsageInfo | None) -> list[OpenAIBaseModel]:
        """The events that open the stream, before any text (``prompt_ids``: the first
        prompt's; ``usage_info``: the usage so far, with ``continuous_usage``)."""
        return []

    @abc.abstractmethod
    def chunks(self, ch: ChoiceState, text: str, c: CompletionOutput,
               entries: list[Entry] | None, prompt_ids: list[int] | None,
               usage_info: UsageInfo | None = None) -> list[OpenAIBaseModel]:
        """The events of one choice update: the text, token ids and log-probabilities new since
        its last one (``prompt_ids`` rides along with its first token ids; ``usage_info``: the
        choice's usage so far, with ``continuous_usage``)."""

    @abc.abstractmethod
    def last_chunks(self, usage_info: UsageInfo) -> list[OpenAIBaseModel | str]:
        """The events that close a stream whose choices all finished."""

    def error_chunks(self, error: ErrorResponse) -> list[OpenAIBaseModel | str]:
        """The events that end a stream that failed after its headers were sent."""
        return [error, "[DONE]"]


class ChoiceBodies(Bodies):
    """The bodies of /v1/completions and /v1/chat/completions: ``choices``, whole or one
    chunk per choice update, then the usage chunk when asked, then ``[DONE]``. Subclasses say
    how the endpoint's body, streamed choice and log-probabilities look.

    Args:
      request_id: the body's ``id``.
      model: the served model name.
      num_logprobs: alternatives per token (SamplingParams.logprobs), None for no logprobs.
      piece: token id -> (text, bytes) (TokenPieces.piece, or ``token_id_piece``), for
        log-probabilities.
      return_token_ids: add the prompt's and the choice's token ids (vLLM's).
      prompt_logprobs: add vLLM's ``prompt_logprobs`` (non-streamed bodies).
      include_usage: end a stream with a usage chunk (``stream_options.include_usage``).
      continuous_usage: every chunk carries its usage so far (vLLM's
        ``stream_options.continuous_usage_stats``).
    """

    response_cls: type[OpenAIBaseModel]
    stream_cls: type[OpenAIBaseModel]

    def __init__(self, request_id: str, model: str, *, num_logprobs: int | None = None,
                 piece: Callable[[int], tuple[str, bytes]] | None = None,
                 return_token_ids: bool = False, prompt_logprobs: bool = False,
                 include_usage: bool = False, continuous_usage: bool = False):
        super().__init__(request_id, model)
        self.num_logprobs = num_logprobs
        self.piece = piece
        self.return_token_ids = return_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage

    @abc.abstractmethod
    def _stream_choice(self, ch: ChoiceState, text: str, logprobs,
                       **ids) -> OpenAIBaseModel | None:
        """A choice of a streamed chunk (None: nothing to send)."""

    @abc.abstractmethod
    def _logprobs(self, ch: ChoiceState, entries: list[Entry]) -> OpenAIBaseModel:
        """The endpoint's log-probabilities of some of ``ch``'s tokens (advances its offset)."""

    def _body(self, cls, choices: list, usage_info: UsageInfo | None = None,
              **extra) -> OpenAIBaseModel:
        return cls(id=self.request_id, created=self.created, model=self.model, choices=choices,
                   usage=usage_info, **extra)

    def _entries_logprobs(self, ch: ChoiceState):
        return None if ch.entries is None else self._logprobs(ch, ch.entries)

    def chunks(self, ch: ChoiceState, text: str, c: CompletionOutput,
               entries: list[Entry] | None, prompt_ids: list[int] | None,
               usage_info: UsageInfo | None = None) -> list[OpenAIBaseModel]:
        """One chunk of the choice, or none when there is nothing to send (a parser holds the
        text back)."""
        lp = None if entries is None else self._logprobs(ch, entries)
        ids = {}
        if self.return_token_ids:
            ids = {"token_ids": list(c.token_ids), "prompt_token_ids": prompt_ids}
        choice = self._stream_choice(ch, text, lp, **ids)
        return [] if choice is None else [self._body(self.stream_cls, [choice], usage_info)]

    def last_chunks(self, usage_info: UsageInfo) -> list[OpenAIBaseModel | str]:
        """The usage chunk (``stream_options.include_usage``: usage, no choices), then
        ``[DONE]``."""
        usage_chunk = [self._body(self.stream_cls, [], usage_info)] if self.include_usage else []
        return [*usage_chunk, "[DONE]"]


class CompletionBodies(ChoiceBodies):
    response_cls = CompletionResponse
    stream_cls = CompletionStreamResponse

    def response(self, choices, prompt_ids, n, usage_info, prompt_logprobs) -> CompletionResponse:
        out = []
        for ch in choices:
            p = ch.index // n
            out.append(CompletionResponseChoice(
                index=ch.index, text=ch.text, logprobs=self._entries_logprobs(ch),
                finish_reason=ch.finish_reason, stop_reason=ch.stop_reason,
                prompt_token_ids=prompt_ids[p] if self.return_token_ids else None,
                token_ids=ch.token_ids if self.return_token_ids else None,
                prompt_logprobs=(prompt_logprobs_body(prompt_logprobs[p])
                                 if self.prompt_logprobs else None)))
        return self._body(self.response_cls, out, usage_info)

    def _stream_choice(self, ch, text, logprobs, **ids) -> CompletionResponseStreamChoice:
        return CompletionResponseStreamChoice(index=ch.index, text=text, logprobs=logprobs,
                                              finish_reason=ch.finish_reason,
                                              **_stop_reason(ch.finish_reason, ch), **ids)

    def _logprobs(self, ch: ChoiceState, entries: list[Entry]) -> CompletionLogProbs:
        out = CompletionLogProbs()
        for token, pos in entries:
            text = self.piece(token)[0]
            if pos is None:  # a prompt's first token: nothing precedes it
                top, lp = None, None
            else:
                # The token and its k most likely alternatives (an echoed prompt's positions
                # may hold more of them: prompt_logprobs).
                others = [(t, v) for t, v in _ranked(pos) if t != token][: self.num_logprobs]
                ranked = sorted(others + [(token, pos[token].logprob)], key=lambda x: -x[1])
                top = {self.piece(t)[0]: _clamp(v) for t, v in ranked}
                lp = _clamp(pos[token].logprob)
            out.tokens.append(text)
            out.token_logprobs.append(lp)
            out.top_logprobs.append(top)
            out.text_offset.append(ch.text_offset)
            ch.text_offset += len(text)
        return out


class ChatBodies(ChoiceBodies):
    """Args (besides ChoiceBodies'):
      tool_parser: the ToolParser class that reads tool calls out of the choices' content
        (docs/tool_calling.md), or None when the request has no tools (or ``tool_choice:
        none``). A choice that returned calls and stopped has ``finish_reason: tool_calls``.
      tool_calls_only: the parsers drop what is not a call (ToolParser's ``calls_only``).
      reasoning_parser: the ``--reasoning-parser``'s ReasoningParser class, or None.
      in_reasoning: the output starts in the reasoning (ReasoningParser.starts_in_reasoning).
      include_reasoning: send the reasoning (False: it is dropped, the request's
        ``include_reasoning``).
      role: the reply's role (ChatCompletionRequest.response_role).
      echo_text: the text the reply starts with (ChatCompletionRequest.echo_text), or None.
    """

    response_cls = ChatCompletionResponse
    stream_cls = ChatCompletionStreamResponse

    def __init__(self, *args, tool_parser: type[ToolParser] | None = None,
                 tool_calls_only: bool = False,
                 reasoning_parser: type[ReasoningParser] | None = None,
                 in_reasoning: bool = False, include_reasoning: bool = True,
                 role: str = "assistant", echo_text: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_parser = tool_parser
        self.tool_calls_only = tool_calls_only
        self.reasoning_parser = reasoning_parser
        self.in_reasoning = in_reasoning
        self.include_reasoning = include_reasoning
        self.role = role
        self.echo_text = echo_text

    def response(self, choices, prompt_ids, n, usage_info,
                 prompt_logprobs) -> ChatCompletionResponse:
        out = [self._choice(ch) for ch in choices]
        plp = prompt_logprobs_body(prompt_logprobs[0]) if self.prompt_logprobs else None
        return self._body(self.response_cls, out, usage_info, prompt_logprobs=plp,
                          prompt_token_ids=prompt_ids[0] if self.return_token_ids else None)

    def _choice(self, ch: ChoiceState) -> ChatCompletionResponseChoice:
        reasoning, content, calls = None, ch.text, []
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser(self.in_reasoning).extract_reasoning(content)
        finish_reason = ch.finish_reason
        if self.tool_parser is not None and content is not None:
            parsed = self.tool_parser(self.tool_calls_only).extract_tool_calls(content)
            calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                     for c in parsed.tool_calls]
            content = parsed.content
            finish_reason = _finish_reason(finish_reason, len(calls))
        if self.echo_text:
            content = self.echo_text + (content or "")
        if not self.include_reasoning:
            reasoning = None
        message = ChatMessage(role=self.role, content=content, tool_calls=calls or None,
                              reasoning=reasoning, reasoning_content=reasoning)
        return ChatCompletionResponseChoice(
            index=ch.index, message=message, logprobs=self._entries_logprobs(ch),
            finish_reason=finish_reason, stop_reason=ch.stop_reason,
            token_ids=ch.token_ids if self.return_token_ids else None)

    def chunks(self, ch, text, c, entries, prompt_ids, usage_info=None):
        # The prompt's ids went out with the opening chunks (first_chunks).
        return super().chunks(ch, text, c, entries, None, usage_info)

    def _stream_choice(self, ch, text, logprobs, prompt_token_ids=None,
                       **ids) -> ChatCompletionResponseStreamChoice | None:
        finish_reason, reasoning, content = ch.finish_reason, "", text
        if self.reasoning_parser is not None:
            if ch.reasoning_parser is None:
                ch.reasoning_parser = self.reasoning_parser(self.in_reasoning)
            parsed = ch.reasoning_parser.feed(text)
            if finish_reason is not None:
                parsed.reasoning += ch.reasoning_parser.finish().reasoning
            reasoning, content = parsed.reasoning, parsed.content
            if not self.include_reasoning:
                reasoning = ""
        tool_calls = None
        if self.tool_parser is not None:
            if ch.tool_parser is None:
                ch.tool_parser = self.tool_parser(self.tool_calls_only)
            parsed = ch.tool_parser.feed(content)
            if finish_reason is not None:
                end = ch.tool_parser.finish()
                parsed.content += end.content
                parsed.tool_calls += end.tool_calls
            content = parsed.content
            tool_calls = [_delta_tool_call(d) for d in parsed.tool_calls] or None
            finish_reason = _finish_reason(finish_reason, ch.tool_parser.num_calls)
        # No new text (the finishing chunk, or token ids alone): an empty delta, {}.
        delta = DeltaMessage(content=content or None, reasoning=reasoning or None,
                             reasoning_content=reasoning or None, tool_calls=tool_calls)
        parsing = self.tool_parser is not None or self.reasoning_parser is not None
        if (parsing and delta == DeltaMessage() and finish_reason is None and logprobs is None
                and not ids.get("token_ids")):
            return None  # a parser holds the text back
        return ChatCompletionResponseStreamChoice(
            index=ch.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
            **_stop_reason(finish_reason, ch), **ids)

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

    def first_chunks(self, num_choices, prompt_ids,
                     usage_info) -> list[ChatCompletionStreamResponse]:
        """The role chunk OpenAI opens a chat stream with, one per choice (with the prompt's
        ids, vLLM's ``return_token_ids``), then with ``echo`` one with the echoed text."""
        ids = prompt_ids if self.return_token_ids else None
        out = [self._body(self.stream_cls, [ChatCompletionResponseStreamChoice(
            index=i, delta=DeltaMessage(role=self.role, content=""))], usage_info,
            prompt_token_ids=ids) for i in range(num_choices)]
        if self.echo_text:
            out += [self._body(self.stream_cls, [ChatCompletionResponseStreamChoice(
                index=i, delta=DeltaMessage(content=self.echo_text))], usage_info)
                for i in range(num_choices)]
        return out


def _stop_reason(finish_reason: str | None, ch: ChoiceState) -> dict:
    """A streamed choice's ``stop_reason`` field: on its finishing chunk only (null at EOS)."""
    return {} if finish_reason is None else {"stop_reason": ch.stop_reason}


def _finish_reason(finish_reason: str | None, num_calls: int) -> str | None:
    """A chat choice's finish reason: ``tool_calls`` when it stopped after returning calls
    (a choice cut by max_tokens keeps ``length``: its last call may be incomplete)."""
    return "tool_calls" if finish_reason == "stop" and num_calls else finish_reason


def _delta_tool_call(d: ToolCallDelta) -> DeltaToolCall:
    if d.id is None:
        return DeltaToolCall(index=d.index, function=DeltaFunctionCall(arguments=d.arguments))
    return DeltaToolCall(index=d.index, id=d.id, type="function",
                         function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
