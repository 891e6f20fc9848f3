"""What crosses the engine boundary: requests in, per-step outputs back (token ids only).

msgspec Structs, as in vLLM V1: the pipe (``jaxserve.engine.messages``) encodes and decodes them
directly, and the in-process path (``jaxserve.LLM``) uses the same objects.
"""

import msgspec

from jaxserve.lora.request import LoRARequest
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec_decode.metrics import SpecDecodingStats


def child_request_id(request_id: str, index: int, n: int) -> str:
    """The engine's id of choice ``index`` of a request with ``n`` choices: the request's own
    id when n is 1, else vLLM's ``f"{index}_{request_id}"``. The API process and the engine
    both derive choice ids with this one function."""
    return request_id if n == 1 else f"{index}_{request_id}"


class LogprobsLists(msgspec.Struct, array_like=True):
    """Log-probabilities of some tokens (vLLM V1's name and layout), raw logits' log-softmax.

    Attributes:
      logprob_token_ids: per token, the token's id then the ids of the k most likely tokens at
        its position (most likely first).
      logprobs: the matching log-probabilities.
      sampled_token_ranks: per token, 1 + the number of tokens more likely than it.
    """

    logprob_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    logprobs: list[list[float]] = msgspec.field(default_factory=list)
    sampled_token_ranks: list[int] = msgspec.field(default_factory=list)

    def extend(self, other: "LogprobsLists") -> None:
        self.logprob_token_ids += other.logprob_token_ids
        self.logprobs += other.logprobs
        self.sampled_token_ranks += other.sampled_token_ranks

    def __len__(self) -> int:
        return len(self.sampled_token_ranks)


class EngineCoreRequest(msgspec.Struct, array_like=True):
    """A request as the engine sees it: tokenized and validated by the InputProcessor.

    Attributes:
      request_id: unique among live requests.
      prompt_token_ids: the prompt, token ids (non-empty, in the vocabulary, shorter than
        max_model_len: the engine trusts the InputProcessor's checks).
      sampling_params: validated SamplingParams (stop strings are the OutputProcessor's job).
      reasoning_end_token_id: for a request whose output starts with the model's reasoning
        (``--reasoning-parser``), the token that ends it: its structured outputs constrain
        only the tokens after that one (vLLM's rule); None: from the first token.
      lora_request: the LoRA adapter the request runs with (docs/lora.md); None: the base model.
      cache_salt: vLLM's: the prefix cache shares its pages only with requests of the same
        salt (``KVCacheManager``); None: with every request without one.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    reasoning_end_token_id: int | None = None
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request from one engine step.

    Attributes:
      request_id: the choice (``child_request_id``: the request's id when it has one choice).
      new_token_ids: tokens emitted this step: one, or with speculative decoding the accepted
        drafts and the sampled token.
      finish_reason: None while running; "stop" (EOS or a stop token id), "length"
        (max_tokens or max_model_len), "abort", or "error" (its structured-outputs grammar
        failed while it generated; ``error`` says why).
      stop_reason: the ``stop_token_ids`` entry that ended it, if any (None at EOS, as vLLM).
      num_prompt_tokens: prompt length, tokens.
      num_cached_tokens: prompt tokens served from the prefix cache, tokens.
      new_logprobs: log-probabilities of new_token_ids when the request asked for them.
      new_prompt_logprobs: those of the prompt's tokens after the first (once, with the first
        output of choice 0) when the request asked for them.
      queued_ts, scheduled_ts: with a choice's first output only (0 on the others), the engine
        process's ``time.monotonic()`` when the choice reached the engine and when it was last
        scheduled before its first token (a preemption during its prefill schedules it again):
        the start of its queue and prefill phases (vLLM's QUEUED and SCHEDULED events). The API
        process compares them only with the engine's own times (``messages.Outputs.timestamp``).
      error: with finish_reason "error", the message for the client.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct):
    """Engine counters for /metrics (docs/architecture.md, "Engine stats")."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable pages referenced by live requests
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up, cumulative
    prefix_cache_hits: int = 0  # prompt tokens found, cumulative
    # prompt tokens whose K/V the engine computed (cache hits and forked choices excluded,
    # recomputation after a preemption included), cumulative
    prompt_tokens_computed: int = 0
    # LoRA adapters (names, sorted) of the running and of the waiting requests (--enable-lora)
    running_lora_adapters: list[str] = msgspec.field(default_factory=list)
    waiting_lora_adapters: list[str] = msgspec.field(default_factory=list)
    spec_decoding: SpecDecodingStats = msgspec.field(default_factory=SpecDecodingStats)
