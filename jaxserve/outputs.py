"""RequestOutput / CompletionOutput: what the offline API returns (vLLM's shapes)."""

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
      index: 0 (one sequence per request).
      text: generated text, special tokens and a matched stop string left out.
      token_ids: generated token ids (an EOS or stop token id that ended it included).
      finish_reason: "stop" (EOS, stop token id or stop string) or "length"
        (max_tokens or max_model_len).
      stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    """A finished request.

    Attributes:
      request_id: the engine's id for it.
      prompt: the prompt text (None when given as token ids).
      prompt_token_ids: the prompt as token ids (after the chat template, for chat).
      outputs: one CompletionOutput.
      num_cached_tokens: prompt tokens served from the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = True
