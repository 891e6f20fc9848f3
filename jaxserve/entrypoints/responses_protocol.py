"""The bodies of OpenAI's Responses API (POST /v1/responses; pydantic 2), as vLLM's
``entrypoints/openai/responses/protocol.py``. Source: OpenAI's API reference (Responses: create,
the response object, streaming events) and the Open Responses specification, whose schema lists
the fields every response object carries.

The request (``ResponsesRequest``) is checked as protocol.py's requests are (strict types,
bounded numbers, UTF-8 strings; unknown fields are logged and ignored) and runs as a chat
request (``chat_request``): ``instructions`` become the first (system) message, the input items
chat messages (``chat_messages``: a ``function_call`` item joins the assistant message before it
as a tool call, a ``function_call_output`` item is a ``tool`` message), the flat function tools
chat tools, ``text.format`` the chat ``response_format``, ``max_output_tokens``
``max_completion_tokens``. A function tool is ``strict`` unless it says ``strict: false`` (the
Responses API's default, where chat's is false). ``check`` refuses what jaxserve does not serve,
naming the field (a 400): built-in tools, ``background``, ``conversation``, ``prompt``,
``truncation: auto``, log-probabilities, reasoning settings (no served model's reasoning can be
tuned), a verbosity or service tier other than the default.

The response object (``Response``) carries every field of Open Responses' ``ResponseResource``
(null where jaxserve has nothing to say); its ``output`` holds ``message`` items (one
``output_text`` part), ``function_call`` items, and with a ``--reasoning-parser`` a
``reasoning`` item (one ``reasoning_text`` part) before them. A streamed response is a sequence of
``ResponseStreamEvent``s, each with ``type`` and ``sequence_number`` (responses_bodies.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from jaxserve.entrypoints.protocol import (
    FUNCTION_NAME_PATTERN, CacheSalt, ChatCompletionMessageParam, ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest, ChatCompletionToolsParam, ErrorInfo, FunctionCallParam,
    FunctionDefinition, Int32, Items, JsonSchemaFormat, NamedFunction, OpenAIBaseModel,
    ResponseFormat, Text, ToolCallParam, _Base)
from jaxserve.exceptions import ValidationError
from jaxserve.sampling_params import SamplingParams

# Content parts that are text: a user's, system's or developer's, and an assistant's (a
# previous response's output, sent back).
TEXT_PARTS = ("input_text", "output_text")
# OpenAI's bounds on ``metadata``.
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


class ContentPart(_Base):
    """A content part of an input message (``input_text`` or ``output_text``; any other type,
    ``input_image``, ``input_file``, is refused by ``chat_messages``)."""

    type: Text
    text: Text | None = None


class InputItem(_Base):
    """One item of ``input``: a ``message`` (the type may be left out), a ``function_call``
    the model made, a ``function_call_output`` (a call's result), or a ``reasoning`` item
    (accepted and left out of the prompt, as chat templates leave out earlier turns'
    reasoning). Which fields an item needs depends on its type (``chat_messages`` checks)."""

    type: Text = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: Text | Items(ContentPart) | None = None
    call_id: Text | None = None
    name: Text | None = None
    arguments: Text | None = None  # JSON text
    output: Text | Items(ContentPart) | None = None


class ResponsesTool(FunctionDefinition):
    """A tool: a function, ``{"type": "function", "name", "description", "parameters",
    "strict"}`` (chat's definition, flat); another type (OpenAI's built-in tools) is refused by
    ``ResponsesRequest.check``, which also requires a function's name."""

    type: Text
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)] | None = None

    def echo(self) -> dict:
        """The tool as the response object repeats it (``strict`` resolved)."""
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict is not False}


class ToolChoiceParam(_Base):
    """``tool_choice`` naming the function to call: ``{"type": "function", "name": ...}``
    (other types, ``allowed_tools`` and the built-in tools', are refused by ``check``)."""

    type: Text
    name: Text | None = None


class TextFormat(_Base):
    """``text.format``: ``text`` (the default), ``json_object``, or ``json_schema`` with
    ``name`` and ``schema`` (chat's ``response_format.json_schema``, flat)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def echo(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": self.type, "name": self.name, "description": self.description,
                "schema": self.schema_, "strict": self.strict}


class TextConfig(_Base):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningParam(_Base):
    effort: Text | None = None
    summary: Text | None = None
    generate_summary: Text | None = None  # OpenAI's older name of summary


class ResponsesStreamOptions(_Base):
    include_obfuscation: bool | None = None  # accepted: jaxserve never pads its events


def _refusals(req: ResponsesRequest) -> list[tuple[str, bool, str]]:
    """(field, whether ``req`` sets it to a value jaxserve refuses, the 400's message) of the
    fields a request may set only to their neutral value."""
    text, reasoning = req.text or TextConfig(), req.reasoning or ReasoningParam()
    logprobs = "log-probabilities are not served on /v1/responses (/v1/chat/completions has them)"
    thinking = ("reasoning settings are not supported: no served model's reasoning can be "
                "tuned; leave it out (or null; effort may be 'none')")
    # OpenAI's words for background without store, which a client may look for.
    unstored = (" (and background can only be used when `store` is true)"
                if req.store is False else "")
    return [
        ("background", bool(req.background), "background: background mode is not supported: a "
         "response is computed while its request is open (stream it to read it as it comes)"
         + unstored),
        ("conversation", req.conversation is not None, "conversation: conversations are not "
         "supported; chain responses with previous_response_id, or send the whole input"),
        ("prompt", req.prompt is not None, "prompt: prompt templates are not supported; send "
         "the input"),
        ("truncation", req.truncation == "auto", "truncation: 'auto' truncation is not "
         "supported: an input that does not fit the context is a 400"),
        ("top_logprobs", bool(req.top_logprobs), f"top_logprobs: {logprobs}"),
        ("include", "message.output_text.logprobs" in (req.include or ()),
         f"include: {logprobs}"),
        ("service_tier", req.service_tier not in (None, "auto", "default"),
         "service_tier: this server has one service tier, 'default'"),
        ("text", text.verbosity not in (None, "medium"), "text.verbosity: this model has no "
         "verbosity control; leave it out or send 'medium'"),
        ("reasoning", reasoning.effort not in (None, "none"), f"reasoning.effort: {thinking}"),
        ("reasoning", (reasoning.summary or reasoning.generate_summary) is not None,
         f"reasoning.summary: {thinking}"),
    ]


class ResponsesRequest(_Base):
    """POST /v1/responses (OpenAI's Responses API, text in and out)."""

    model: Text | None = None
    input: Text | Items(InputItem)
    instructions: Text | None = None
    previous_response_id: Text | None = None
    store: bool | None = True
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    tools: Items(ResponsesTool) | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: Int32 | None = None  # a bound on built-in tool calls: jaxserve runs none
    text: TextConfig | None = None
    max_output_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None  # Open Responses' sampling fields
    frequency_penalty: float | None = None
    metadata: dict[str, Text] | None = None
    user: Text | None = None  # identifiers, repeated in the response; not used
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    cache_salt: CacheSalt | None = None  # vLLM's
    # Refused unless neutral (``check``).
    top_logprobs: Int32 | None = None
    include: Items(Text) | None = None
    reasoning: ReasoningParam | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: Text | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None

    def check(self) -> None:
        """Refuse what jaxserve does not serve.

        Raises:
          ValidationError: on the first such field (``_refusals``; a tool that is not a
            function, or a function without a name; a ``tool_choice`` object that is not a
            function's; a ``json_schema`` format without ``name`` or ``schema``; metadata past
            OpenAI's bounds).
        """
        for field, refused, message in _refusals(self):
            if refused:
                raise ValidationError(message, parameter=field)
        for i, tool in enumerate(self.tools or ()):
            if tool.type != "function":
                raise ValidationError(
                    f"tools.{i}.type: {tool.type!r} tools are not supported: jaxserve runs "
                    "function tools only (OpenAI's built-in tools run on its own service)",
                    parameter="tools")
            if tool.name is None:
                raise ValidationError(f"tools.{i}.name: field required", parameter="tools")
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceParam) and (choice.type != "function" or not choice.name):
            raise ValidationError("tool_choice: give 'auto', 'none', 'required' or "
                                  "{'type': 'function', 'name': ...}", parameter="tool_choice")
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            for name in ("name", "schema_"):
                if getattr(fmt, name) is None:
                    raise ValidationError(f"text.format.{name.rstrip('_')}: field required for "
                                          "a json_schema format", parameter="text")
        self._check_metadata()

    def _check_metadata(self) -> None:
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA_KEYS or any(
                len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS
                for k, v in metadata.items()):
            raise ValidationError(
                f"metadata: at most {MAX_METADATA_KEYS} keys of at most "
                f"{MAX_METADATA_KEY_CHARS} characters, values of at most "
                f"{MAX_METADATA_VALUE_CHARS}", parameter="metadata")

    def input_messages(self) -> list[ChatCompletionMessageParam]:
        """``input`` as chat messages (a string is one user message).

        Raises:
          ValidationError: on ``input`` (chat_messages).
        """
        if isinstance(self.input, str):
            return [ChatCompletionMessageParam(role="user", content=self.input)]
        return chat_messages(self.input, "input")

    def chat_request(self, conversation: list[ChatCompletionMessageParam]) -> ChatCompletionRequest:
        """The chat request this one runs as, on ``conversation`` (the previous response's
        messages, then this input's), after ``instructions``.

        Raises:
          ValidationError: on ``input`` when there is no message at all.
        """
        system = ([ChatCompletionMessageParam(role="system", content=self.instructions)]
                  if self.instructions else [])
        if not system and not conversation:
            raise ValidationError("input: no input (give a message, or previous_response_id)",
                                  parameter="input")
        return ChatCompletionRequest(
            messages=system + conversation, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            tools=[_chat_tool(t) for t in self.tools] if self.tools else None,
            tool_choice=self._chat_tool_choice(), parallel_tool_calls=self.parallel_tool_calls,
            response_format=self._response_format())

    def _chat_tool_choice(self):
        if isinstance(self.tool_choice, ToolChoiceParam):
            return ChatCompletionNamedToolChoiceParam(
                type="function", function=NamedFunction(name=self.tool_choice.name))
        return self.tool_choice

    def _response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat(type="json_object")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict))

    def echo(self, sp: SamplingParams, stored: bool) -> dict:
        """The fields of the response object that repeat the request's settings: sampling
        values as the engine runs them (``sp``, the model's generation config filling in what
        the request left out), OpenAI's defaults for what it did not give. ``stored``: the
        response is kept (``store``, unless the server keeps none)."""
        fmt = self.text.format if self.text and self.text.format else TextFormat(type="text")
        choice = self.tool_choice or "auto"
        if isinstance(choice, ToolChoiceParam):
            choice = {"type": "function", "name": choice.name}
        reasoning = None
        if self.reasoning is not None:
            reasoning = {"effort": self.reasoning.effort, "summary": None}
        return dict(
            background=False, instructions=self.instructions,
            max_output_tokens=self.max_output_tokens, max_tool_calls=self.max_tool_calls,
            metadata=self.metadata or {}, parallel_tool_calls=self.parallel_tool_calls is not False,
            previous_response_id=self.previous_response_id,
            prompt_cache_key=self.prompt_cache_key, reasoning=reasoning,
            safety_identifier=self.safety_identifier, service_tier="default", store=stored,
            temperature=sp.temperature, top_p=sp.top_p, presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            text={"format": fmt.echo(), "verbosity": "medium"}, tool_choice=choice,
            tools=[t.echo() for t in self.tools or ()], top_logprobs=0, truncation="disabled",
            user=self.user)


def _chat_tool(tool: ResponsesTool) -> ChatCompletionToolsParam:
    return ChatCompletionToolsParam(type="function", function=FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.parameters,
        strict=tool.strict is not False))


def _text(value: str | list[ContentPart], where: str) -> str:
    """A message's content or a call's output as text (its text parts joined)."""
    if isinstance(value, str):
        return value
    for j, part in enumerate(value):
        if part.type not in TEXT_PARTS or part.text is None:
            raise ValidationError(f"{where}.{j}: {part.type!r} content is not supported: this "
                                  "server serves a text-only model (send input_text parts)",
                                  parameter="input")
    return "".join(p.text for p in value)


_NEEDS = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
          "function_call_output": ("call_id", "output"), "reasoning": ()}


def chat_messages(items: list[InputItem], field: str) -> list[ChatCompletionMessageParam]:
    """Input items as chat messages (see the module doc).

    Raises:
      ValidationError: on ``input``, naming ``{field}.{i}`` and the part at fault: an item of
        another type, a field the item's type needs, content that is not text.
    """
    messages: list[ChatCompletionMessageParam] = []
    for i, item in enumerate(items):
        where = f"{field}.{i}"
        if item.type not in _NEEDS:
            raise ValidationError(f"{where}.type: {item.type!r} items are not supported (send "
                                  "message, function_call and function_call_output items)",
                                  parameter="input")
        for name in _NEEDS[item.type]:
            if getattr(item, name) is None:
                raise ValidationError(f"{where}.{name}: field required for a {item.type} item",
                                      parameter="input")
        if item.type == "message":
            messages.append(ChatCompletionMessageParam(
                role=item.role, content=_text(item.content, f"{where}.content")))
        elif item.type == "function_call":
            call = ToolCallParam(id=item.call_id, type="function", function=FunctionCallParam(
                name=item.name, arguments=item.arguments))
            if messages and messages[-1].role == "assistant":
                messages[-1].tool_calls = [*(messages[-1].tool_calls or ()), call]
            else:
                messages.append(ChatCompletionMessageParam(role="assistant", tool_calls=[call]))
        elif item.type == "function_call_output":
            messages.append(ChatCompletionMessageParam(
                role="tool", content=_text(item.output, f"{where}.output"),
                tool_call_id=item.call_id))
    return messages


def check_call_outputs(conversation: list[ChatCompletionMessageParam]) -> None:
    """OpenAI's rule: each ``function_call_output`` (a tool message here) answers a function
    call made earlier in the conversation (this input's or a previous response's).

    Raises:
      ValidationError: on ``input``, naming the ``call_id`` that no call has.
    """
    calls: set[str] = set()
    for message in conversation:
        calls.update(call.id for call in message.tool_calls or ())
        if message.role == "tool" and message.tool_call_id not in calls:
            raise ValidationError(f"input: no function call found for the function_call_output "
                                  f"with call_id {message.tool_call_id!r}", parameter="input")


# -- the response object ----------------------------------------------------------------------


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)  # jaxserve makes none
    logprobs: list = Field(default_factory=list)  # log-probabilities are not served here


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIBaseModel):
    """A reasoning model's reasoning, as the ``--reasoning-parser`` separates it (jaxserve
    makes no summaries and encrypts nothing); a follow-up may send it back, and it is left out
    of the prompt (``chat_messages``)."""

    id: str  # rs_...
    type: Literal["reasoning"] = "reasoning"
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list = Field(default_factory=list)
    content: list[ReasoningText]
    encrypted_content: None = None


class OutputMessage(OpenAIBaseModel):
    """The assistant's text: a response holds one at most."""

    id: str  # msg_...
    type: Literal["message"] = "message"
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(OpenAIBaseModel):
    """A call the model made; the client runs it and sends a ``function_call_output``."""

    id: str  # fc_...
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str  # call_...: what the output item names
    name: str
    arguments: str  # JSON text, as the model wrote it


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


def output_messages(output: list[OutputItem]) -> list[ChatCompletionMessageParam]:
    """A response's output as the chat messages a follow-up sends back (previous_response_id)."""
    return chat_messages([InputItem.model_validate(item.model_dump()) for item in output],
                         "output")


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache
    cache_write_tokens: int = 0  # OpenAI's explicit prompt-cache writes: jaxserve has none


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"]


class Response(OpenAIBaseModel):
    """The response object: what POST /v1/responses answers (streamed: in its lifecycle
    events) and GET /v1/responses/{id} returns. The fields after ``usage`` repeat the
    request's settings (``ResponsesRequest.echo``)."""

    id: str  # resp_...
    object: Literal["response"] = "response"
    created_at: int  # unix seconds
    status: Literal["in_progress", "completed", "incomplete"]
    completed_at: int | None = None
    error: None = None  # a failure is an error event or an HTTP error, never a stored object
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    background: bool
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    prompt_cache_key: str | None
    reasoning: dict | None
    safety_identifier: str | None
    service_tier: str
    store: bool
    temperature: float
    top_p: float
    presence_penalty: float
    frequency_penalty: float
    text: dict
    tool_choice: str | dict
    tools: list[dict]
    top_logprobs: int
    truncation: str
    user: str | None


class ResponseDeleted(OpenAIBaseModel):
    """DELETE /v1/responses/{id}."""

    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


# -- streaming events ---------------------------------------------------------------------------


class ResponseStreamEvent(OpenAIBaseModel):
    """An event of a streamed response: on the wire ``event: {type}`` then ``data: {json}``
    (responses.SSEStream); ``sequence_number`` counts the stream's events from 0."""

    type: str
    sequence_number: int


class ResponseLifecycleEvent(ResponseStreamEvent):
    """The response as it stands: created and in progress (no output yet), then completed or
    incomplete (the last event)."""

    type: Literal["response.created", "response.in_progress", "response.completed",
                  "response.incomplete"]
    response: Response


class OutputItemEvent(ResponseStreamEvent):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class _ItemEvent(ResponseStreamEvent):
    """An event about output item ``item_id``, the response's ``output[output_index]``."""

    item_id: str
    output_index: int


class _ContentEvent(_ItemEvent):
    content_index: int  # of the item's content part


class ContentPartEvent(_ContentEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    part: OutputText | ReasoningText


class OutputTextDeltaEvent(_ContentEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    logprobs: list = Field(default_factory=list)


class OutputTextDoneEvent(_ContentEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str
    logprobs: list = Field(default_factory=list)


class ReasoningTextDeltaEvent(_ContentEvent):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    delta: str


class ReasoningTextDoneEvent(_ContentEvent):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    text: str


class ArgumentsDeltaEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta")
    delta: str


class ArgumentsDoneEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.done"] = (
        "response.function_call_arguments.done")
    arguments: str


class ErrorEvent(ResponseStreamEvent):
    """A stream that failed after its headers were sent ends with this event: OpenAI's
    fields (``code``, ``message``, ``param``) and Open Responses' ``error`` object, which also
    makes the ``openai`` client raise."""

    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None
    error: ErrorInfo
