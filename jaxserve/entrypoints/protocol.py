"""OpenAI request and response bodies (pydantic 2), as vLLM's ``entrypoints/openai/protocol.py``.

Requests (/v1/completions, /v1/chat/completions): types are checked strictly (a string where a
number belongs is a 400, as with OpenAI), and bounded here so that no value can overflow what it
is later packed into: integers fit int32 (``seed``: int64), floats are finite, and every string
can be encoded as UTF-8 (JSON's ``"\\ud800"`` escape gives a lone surrogate, which no encoder
downstream accepts); lists stop at their first bad item. Semantic ranges (temperature in
[0, 2], ...) are SamplingParams' checks. Fields OpenAI defines that jaxserve does not support
yet are accepted only at their neutral value
(``unsupported_field`` names the first offender); fields nobody defines are kept in
``model_extra`` so the server can log and ignore them.

Responses: every body the server sends (completions and chat completions, their streamed chunks,
usage, /v1/models, errors). Fields are declared in the order they go on the wire. Optional fields
that OpenAI's format leaves out when unused (the token ids of vLLM's ``return_token_ids``, a
chunk's ``usage``, a delta's ``role`` / ``content``) are omitted when None; the others
(``logprobs``, ``finish_reason``, error ``param`` / ``code``) are sent as null.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from jaxserve.sampling_params import INT32_MAX, SamplingParams


def _utf8(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the string holds a lone UTF-16 surrogate (e.g. \\ud800); it cannot "
                         "be encoded as UTF-8") from None
    return s


Text = Annotated[str, AfterValidator(_utf8)]
Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]  # the vocabulary check comes later


def Items(item: Any) -> Any:
    """``list[item]`` that stops at its first bad item: by default pydantic reports every one,
    and a body of a million bad token ids took a minute to validate and report, on the event
    loop."""
    return Annotated[list[item], Field(fail_fast=True)]


class _Base(BaseModel):
    # allow_inf_nan=False: JSON has no NaN / Infinity, and 1e400 parses to inf; both are 400s.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Base):
    """Fields shared by both endpoints (OpenAI's, plus vLLM's top_k / stop_token_ids / ignore_eos)."""

    model: Text | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    seed: Int64 | None = None
    stop: Text | Items(Text) | None = None
    stop_token_ids: Items(TokenId) | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # vLLM's extension: token ids in each choice
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Int32 | None = 1
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, Any] | None = None  # unsupported: any non-empty value is a 400
    user: Text | None = None

    def _unsupported_common(self) -> str | None:
        if self.n not in (None, 1):
            return "n"
        if self.presence_penalty not in (None, 0):
            return "presence_penalty"
        if self.frequency_penalty not in (None, 0):
            return "frequency_penalty"
        if self.logit_bias:
            return "logit_bias"
        return None

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """The request's SamplingParams. Raises ValueError naming the field out of range."""
        kw: dict[str, Any] = {"max_tokens": max_tokens}
        if self.temperature is not None:
            kw["temperature"] = self.temperature
        if self.top_p is not None:
            kw["top_p"] = self.top_p
        if self.top_k is not None:
            kw["top_k"] = self.top_k
        if self.seed is not None:
            kw["seed"] = self.seed
        if self.stop is not None:
            kw["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids:
            kw["stop_token_ids"] = list(self.stop_token_ids)
        kw["ignore_eos"] = self.ignore_eos
        return SamplingParams(**kw)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt`` is a string, a list of token ids, or a list holding one
    of those (one prompt per request: batched prompts are not supported yet)."""

    prompt: Text | Items(TokenId) | Items(Text) | Items(Items(TokenId))
    max_tokens: Int32 | None = 16
    logprobs: Int32 | None = None
    echo: bool | None = False
    best_of: Int32 | None = None
    suffix: Text | None = None

    def unsupported_field(self) -> str | None:
        """The first OpenAI field set to a value jaxserve does not support, or None."""
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            if len(self.prompt) != 1:
                return "prompt"
        for name in ("logprobs", "suffix"):
            if getattr(self, name) not in (None, ""):
                return name
        if self.echo:
            return "echo"
        if self.best_of not in (None, 1):
            return "best_of"
        return self._unsupported_common()

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return p[0]
        return p


class TextPart(_Base):
    type: Literal["text"]
    text: Text


class ChatCompletionMessageParam(_Base):
    """One message of a chat request."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | Items(TextPart) | None = None
    name: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions: system / user / assistant messages, text content only."""

    messages: Annotated[list[ChatCompletionMessageParam], Field(min_length=1, fail_fast=True)]
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: bool | None = False
    top_logprobs: Int32 | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def unsupported_field(self) -> str | None:
        """The first OpenAI field set to a value jaxserve does not support, or None."""
        if self.logprobs:
            return "logprobs"
        if self.top_logprobs not in (None, 0):
            return "top_logprobs"
        if self.tools:
            return "tools"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format"
        return self._unsupported_common()

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        """Messages for the chat template ("developer" is OpenAI's new name for "system")."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


# -- responses --------------------------------------------------------------------------------


class OpenAIBaseModel(BaseModel):
    """Base of the response bodies; an unknown field is a bug here, not a client's extension."""

    model_config = ConfigDict(extra="forbid")


def _is_none(value: Any) -> bool:
    return value is None


def _omitted_if_none():
    """A field absent from the JSON when None (OpenAI's bodies leave these out, not null)."""
    return Field(default=None, exclude_if=_is_none)


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    """Every error: an HTTP error response, or an SSE event when a stream fails midway."""

    error: ErrorInfo


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokenUsageInfo


class CompletionResponseChoice(OpenAIBaseModel):
    index: int = 0
    text: str
    logprobs: None = None  # jaxserve computes no logprobs (a request for them is a 400)
    finish_reason: str | None = None
    # vLLM's return_token_ids: the prompt's ids and the generated ids (EOS / stop token included).
    prompt_token_ids: list[int] | None = _omitted_if_none()
    token_ids: list[int] | None = _omitted_if_none()


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    """A streamed completion choice: the text and token ids new since the last chunk (the
    prompt's ids ride along in the first chunk with generated ids)."""

    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _omitted_if_none()
    prompt_token_ids: list[int] | None = _omitted_if_none()


class CompletionStreamResponse(OpenAIBaseModel):
    """One SSE chunk of /v1/completions; the usage chunk has no choices."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = _omitted_if_none()


class ChatMessage(OpenAIBaseModel):
    """The assistant's message in a non-streamed chat completion."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = _omitted_if_none()
    token_ids: list[int] | None = _omitted_if_none()


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    """What a chat chunk adds: the role once (first chunk), then text; ``{}`` when neither."""

    role: Literal["assistant"] | None = _omitted_if_none()
    content: str | None = _omitted_if_none()


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _omitted_if_none()
    prompt_token_ids: list[int] | None = _omitted_if_none()


class ChatCompletionStreamResponse(OpenAIBaseModel):
    """One SSE chunk of /v1/chat/completions; the usage chunk has no choices."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = _omitted_if_none()


class ModelCard(OpenAIBaseModel):
    id: str  # the served model name
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxserve"
    root: str  # the model's own name
    parent: None = None
    max_model_len: int


class ModelList(OpenAIBaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
