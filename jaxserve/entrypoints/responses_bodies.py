"""The bodies of one /v1/responses request (``n`` is 1: one choice): the response object, whole
or as OpenAI's streamed events, built from the choice's text as run_request (serving_stream.py)
hands it over. Source: OpenAI's API reference, "Streaming events".

One machine serves both: the reply's text goes through the ``--reasoning-parser``'s
ReasoningParser (when the reply starts in the reasoning) and what follows the reasoning through
the request's ToolParser (when it has tools) into output items, each change an event. A streamed
reply is fed delta by delta and its events sent; a whole one is fed at once and only the items
kept, so both have the same items:
- reasoning opens the ``reasoning`` item (``output_item.added``, ``content_part.added``) and adds
  to its one ``reasoning_text`` part (``reasoning_text.delta``); it closes when the content
  starts or the reply ends (``reasoning_text.done``, ``content_part.done``, ``output_item.done``);
- text opens the ``message`` item (``output_item.added``, ``content_part.added``) and adds to
  its one ``output_text`` part (``output_text.delta``); the message stays open to the end of the
  reply (a response holds one at most, all its text);
- a tool call opens a ``function_call`` item (``output_item.added``, the arguments ""), its
  arguments come as ``function_call_arguments.delta``, and it closes when text or the next call
  follows, or the reply ends (``function_call_arguments.done``, ``output_item.done``);
- the end closes what is open (the message: ``output_text.done``, ``content_part.done``,
  ``output_item.done``), after adding an empty message when the reply had nothing but its
  reasoning.
Items are numbered (``output_index``) in the order they open. A reply cut by
``max_output_tokens`` leaves its open items and the response ``incomplete``
(``incomplete_details.reason: max_output_tokens``), else ``completed``. The stream opens with
``response.created`` and ``response.in_progress`` and ends with ``response.completed`` (or
``response.incomplete``), each holding the response as it stands; a stream that fails ends with
an ``error`` event instead. No ``[DONE]``: OpenAI sends none here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from jaxserve.entrypoints.bodies import Bodies, ChoiceState
from jaxserve.entrypoints.protocol import ErrorResponse, UsageInfo
from jaxserve.entrypoints.responses_protocol import (
    ArgumentsDeltaEvent, ArgumentsDoneEvent, ContentPartEvent, ErrorEvent, FunctionCallItem,
    IncompleteDetails, InputTokensDetails, OutputItem, OutputItemEvent, OutputMessage,
    OutputText, OutputTextDeltaEvent, OutputTextDoneEvent, OutputTokensDetails, ReasoningItem,
    ReasoningText, ReasoningTextDeltaEvent, ReasoningTextDoneEvent, Response,
    ResponseLifecycleEvent, ResponseStreamEvent, ResponseUsage)
from jaxserve.entrypoints.tool_parsers import ParsedDelta, ToolParser
from jaxserve.outputs import CompletionOutput
from jaxserve.reasoning import ReasoningParser


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(u: UsageInfo) -> ResponseUsage:
    """The chat usage ``u`` in the Responses API's names."""
    cached = u.prompt_tokens_details.cached_tokens
    return ResponseUsage(
        input_tokens=u.prompt_tokens, input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=u.completion_tokens, output_tokens_details=OutputTokensDetails(),
        total_tokens=u.total_tokens)


class ResponsesBodies(Bodies):
    """Args:
      request_id: the response's id (``resp_...``).
      model: the served model name.
      echo: the response object's fields that repeat the request (ResponsesRequest.echo).
      tool_parser: the ToolParser class that reads the reply's tool calls, or None.
      tool_calls_only: it drops what is not a call (ToolParser's ``calls_only``).
      on_done: called with the finished response before it is sent (the store keeps it).
      reasoning_parser: the ReasoningParser class of ``--reasoning-parser``, or None.
      in_reasoning: the reply starts in the reasoning (ReasoningParser.starts_in_reasoning).

    Attributes:
      output: the output items, in the order they opened.
    """

    def __init__(self, request_id: str, model: str, echo: dict,
                 tool_parser: type[ToolParser] | None,
                 on_done: Callable[[Response], None] | None = None,
                 reasoning_parser: type[ReasoningParser] | None = None,
                 in_reasoning: bool = False, tool_calls_only: bool = False):
        super().__init__(request_id, model)
        self.echo = echo
        self.on_done = on_done
        self.output: list[OutputItem] = []
        self._parser = None if tool_parser is None else tool_parser(tool_calls_only)
        self._thinking = (reasoning_parser(in_reasoning)
                          if reasoning_parser is not None and in_reasoning else None)
        self._reasoning: ReasoningItem | None = None  # open until the content starts
        self._message: OutputMessage | None = None  # open to the end of the reply
        self._call: FunctionCallItem | None = None  # the call being written
        self._status = "in_progress"
        self._sequence_number = 0

    # -- Bodies ------------------------------------------------------------------------------

    def response(self, choices: list[ChoiceState], prompt_ids: list[list[int]], n: int,
                 usage_info: UsageInfo, prompt_logprobs) -> Response:
        self._feed(choices[0].text)
        self._finish(choices[0].finish_reason)
        return self._done(usage_info)

    def first_chunks(self, num_choices: int, prompt_ids: list[int],
                     usage_info: UsageInfo | None) -> list[ResponseStreamEvent]:
        return [self._event(ResponseLifecycleEvent, type=kind, response=self._response())
                for kind in ("response.created", "response.in_progress")]

    def chunks(self, ch: ChoiceState, text: str, c: CompletionOutput, entries, prompt_ids,
               usage_info: UsageInfo | None = None) -> list[ResponseStreamEvent]:
        events = self._feed(text)
        if c.finished:
            events += self._finish(ch.finish_reason)
        return events

    def last_chunks(self, usage_info: UsageInfo) -> list[ResponseStreamEvent]:
        response = self._done(usage_info)
        return [self._event(ResponseLifecycleEvent, type=f"response.{response.status}",
                            response=response)]

    def error_chunks(self, error: ErrorResponse) -> list[ResponseStreamEvent]:
        e = error.error
        return [self._event(ErrorEvent, code=e.code, message=e.message, param=e.param, error=e)]

    # -- the response object -----------------------------------------------------------------

    def _response(self, usage_info: UsageInfo | None = None) -> Response:
        done = self._status != "in_progress"
        return Response(
            id=self.request_id, created_at=self.created, status=self._status,
            completed_at=int(time.time()) if done else None,
            incomplete_details=(IncompleteDetails(reason="max_output_tokens")
                                if self._status == "incomplete" else None),
            model=self.model, output=self.output if done else [],
            usage=None if usage_info is None else response_usage(usage_info), **self.echo)

    def _done(self, usage_info: UsageInfo) -> Response:
        response = self._response(usage_info)
        if self.on_done is not None:
            self.on_done(response)
        return response

    def _event(self, cls: type[ResponseStreamEvent], **fields) -> ResponseStreamEvent:
        event = cls(sequence_number=self._sequence_number, **fields)
        self._sequence_number += 1
        return event

    # -- output items ------------------------------------------------------------------------

    def _feed(self, text: str) -> list[ResponseStreamEvent]:
        events = []
        if self._thinking is not None:
            parsed = self._thinking.feed(text)
            events, text = self._add_reasoning(parsed.reasoning), parsed.content
            if text:  # the content has started: the reasoning is complete
                events += self._close_reasoning()
        if self._parser is None:
            return events + self._add_text(text)
        return events + self._apply(self._parser.feed(text))

    def _finish(self, finish_reason: str | None) -> list[ResponseStreamEvent]:
        events = []
        if self._thinking is not None:
            events += self._add_reasoning(self._thinking.finish().reasoning)
        if self._parser is not None:
            events += self._apply(self._parser.finish())
        self._status = "incomplete" if finish_reason == "length" else "completed"
        events += self._close_reasoning() + self._close_call()
        if all(isinstance(item, ReasoningItem) for item in self.output):
            events += self._open_message()
        return events + self._close_message()

    def _apply(self, parsed: ParsedDelta) -> list[ResponseStreamEvent]:
        # Text after an open call follows it in the reply (the parser sends none mid-call):
        # the call is complete.
        events = self._close_call() if parsed.content else []
        events += self._add_text(parsed.content)
        for d in parsed.tool_calls:
            if d.id is not None:  # a new call (the one before it is complete)
                events += self._close_call()
                self._call = FunctionCallItem(id=_item_id("fc"), status="in_progress",
                                              call_id=d.id, name=d.name, arguments="")
                events.append(self._added(self._call))
            if d.arguments:
                self._call.arguments += d.arguments
                events.append(self._event(ArgumentsDeltaEvent, item_id=self._call.id,
                                          output_index=self._index(self._call),
                                          delta=d.arguments))
        return events

    def _add_reasoning(self, text: str) -> list[ResponseStreamEvent]:
        if not text:
            return []
        events = []
        if self._reasoning is None:
            self._reasoning = ReasoningItem(id=_item_id("rs"), status="in_progress", content=[])
            events = self._open_part(self._reasoning, ReasoningText(text=""))
        return events + self._part_delta(self._reasoning, ReasoningTextDeltaEvent, text)

    def _add_text(self, text: str) -> list[ResponseStreamEvent]:
        if not text:
            return []
        events = self._open_message() if self._message is None else []
        return events + self._part_delta(self._message, OutputTextDeltaEvent, text)

    def _open_message(self) -> list[ResponseStreamEvent]:
        self._message = OutputMessage(id=_item_id("msg"), status="in_progress", content=[])
        return self._open_part(self._message, OutputText(text=""))

    def _close_reasoning(self) -> list[ResponseStreamEvent]:
        item, self._reasoning = self._reasoning, None
        return self._close_part(item, ReasoningTextDoneEvent)

    def _close_message(self) -> list[ResponseStreamEvent]:
        message, self._message = self._message, None
        return self._close_part(message, OutputTextDoneEvent)

    # A message and a reasoning item hold one text part each, their events alike.
    def _open_part(self, item: OutputMessage | ReasoningItem,
                   part: OutputText | ReasoningText) -> list[ResponseStreamEvent]:
        events = [self._added(item)]
        item.content.append(part)
        return events + [self._part_event("response.content_part.added", item)]

    def _part_delta(self, item: OutputMessage | ReasoningItem, cls: type[ResponseStreamEvent],
                    text: str) -> list[ResponseStreamEvent]:
        item.content[0].text += text
        return [self._event(cls, item_id=item.id, output_index=self._index(item),
                            content_index=0, delta=text)]

    def _close_part(self, item: OutputMessage | ReasoningItem | None,
                    cls: type[ResponseStreamEvent]) -> list[ResponseStreamEvent]:
        if item is None:
            return []
        item.status = self._item_status()
        return [self._event(cls, item_id=item.id, output_index=self._index(item),
                            content_index=0, text=item.content[0].text),
                self._part_event("response.content_part.done", item), self._done_item(item)]

    def _close_call(self) -> list[ResponseStreamEvent]:
        call, self._call = self._call, None
        if call is None:
            return []
        call.status = self._item_status()
        return [self._event(ArgumentsDoneEvent, item_id=call.id, output_index=self._index(call),
                            arguments=call.arguments), self._done_item(call)]

    def _item_status(self) -> str:
        """An item closing now: completed, unless the reply was cut short while it was open."""
        return "incomplete" if self._status == "incomplete" else "completed"

    def _index(self, item: OutputItem) -> int:
        return next(i for i, x in enumerate(self.output) if x is item)

    # An event holds a copy of its item or part: the item changes on after the event is made,
    # and a stream sends the events of a delta after making them all.
    def _added(self, item: OutputItem) -> ResponseStreamEvent:
        self.output.append(item)
        return self._event(OutputItemEvent, type="response.output_item.added",
                           output_index=len(self.output) - 1, item=item.model_copy(deep=True))

    def _done_item(self, item: OutputItem) -> ResponseStreamEvent:
        return self._event(OutputItemEvent, type="response.output_item.done",
                           output_index=self._index(item), item=item.model_copy(deep=True))

    def _part_event(self, kind: str, item: OutputMessage | ReasoningItem) -> ResponseStreamEvent:
        return self._event(ContentPartEvent, type=kind, item_id=item.id,
                           output_index=self._index(item), content_index=0,
                           part=item.content[0].model_copy())
