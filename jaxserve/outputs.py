"""RequestOutput / CompletionOutput / Logprob: what the offline API returns (vLLM's shapes)."""

from dataclasses import dataclass, field

from jaxserve.lora.request import LoRARequest


@dataclass
class Logprob:
    """One token's log-probability at a position (vLLM's ``Logprob``).

    Attributes:
      logprob: natural log of its probability (log-softmax of the raw logits).
      rank: 1 + the number of tokens more likely than it at that position.
      decoded_token: its text (UTF-8 of its own bytes; U+FFFD where a token holds only part of
        a character).
    """

    logprob: float
    rank: int
    decoded_token: str


# Per position: token id -> Logprob, holding the position's token and its most likely
# alternatives (vLLM's SampleLogprobs / PromptLogprobs; a prompt's first position is None).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence (one choice).

    Attributes:
      index: the choice, 0 .. n-1.
      text: generated text, special tokens and a matched stop string left out (unless
        include_stop_str_in_output / skip_special_tokens say otherwise).
      token_ids: generated token ids (an EOS or stop token id that ended it included).
      finish_reason: "stop" (EOS, stop token id or stop string), "length"
        (max_tokens or max_model_len), or "error" (``jaxserve.LLM``: its structured-outputs
        constraint failed while it generated; the engine's logger has the message; the
        server answers such a request with an error instead).
      stop_reason: the stop string or ``stop_token_ids`` entry that ended it, if any (None
        at EOS, as vLLM).
      logprobs: one PositionLogprobs per token of token_ids when the request asked for
        logprobs, else None.
      cumulative_logprob: when the request asked for logprobs, the sum of the log-probabilities
        of the choice's tokens so far (in a delta too: all of them, not the delta's, as vLLM);
        else None.
      lora_request: the LoRA adapter that generated it, None for the base model.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    lora_request: LoRARequest | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's result, or (from the OutputProcessor) what is new since the last one.

    Attributes:
      request_id: the engine's id for it.
      prompt: the prompt text (None when given as token ids).
      prompt_token_ids: the prompt as token ids (after the chat template, for chat).
      outputs: one CompletionOutput per choice (a delta holds only the choices that changed).
      num_cached_tokens: prompt tokens served from the prefix cache.
      finished: every choice has finished.
      prompt_logprobs: with SamplingParams.prompt_logprobs, one entry per prompt token: None
        for the first, then its PositionLogprobs (in the first delta that has them).
      lora_request: the LoRA adapter it ran with, None for the base model.
      metrics, encoder_prompt, encoder_prompt_token_ids: vLLM V1's fields, always None here:
        no per-request stats are kept (vLLM's ``LLM`` keeps none either by default), and the
        models are decoder-only.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = True
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    lora_request: LoRARequest | None = None
    metrics: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
