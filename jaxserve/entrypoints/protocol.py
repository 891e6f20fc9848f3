"""OpenAI request bodies (pydantic 2) for /v1/completions and /v1/chat/completions.

Types are checked strictly (a string where a number belongs is a 400, as with OpenAI); value
ranges are checked by SamplingParams. Fields OpenAI defines that jaxserve does not support yet
are accepted only at their neutral value (``unsupported_field`` names the first offender); fields
nobody defines are kept in ``model_extra`` so the server can log and ignore them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.sampling_params import SamplingParams


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Base):
    """Fields shared by both endpoints (OpenAI's, plus vLLM's top_k / stop_token_ids / ignore_eos)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # vLLM's extension: token ids in each choice
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

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

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

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
    text: str


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions: system / user / assistant messages, text content only."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
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
