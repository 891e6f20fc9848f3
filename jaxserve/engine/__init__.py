"""What crosses the engine boundary: requests in, per-step outputs back (token ids only).

msgspec Structs, as in vLLM V1: the pipe (``jaxserve.engine.messages``) encodes and decodes them
directly, and the in-process path (``jaxserve.LLM``) uses the same objects.
"""

import msgspec

from jaxserve.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True):
    """A request as the engine sees it: tokenized and validated by the InputProcessor.

    Attributes:
      request_id: unique among live requests.
      prompt_token_ids: the prompt, token ids (non-empty, in the vocabulary, shorter than
        max_model_len: the engine trusts the InputProcessor's checks).
      sampling_params: validated SamplingParams (stop strings are the OutputProcessor's job).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request from one engine step.

    Attributes:
      request_id: the request.
      new_token_ids: tokens sampled this step (one per step today).
      finish_reason: None while running; "stop" (EOS or a stop token id), "length"
        (max_tokens or max_model_len) or "abort".
      stop_reason: the stop token id that ended it, if any.
      num_prompt_tokens: prompt length, tokens.
      num_cached_tokens: prompt tokens served from the prefix cache, tokens.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct):
    """Engine counters for /metrics (docs/design.md section 3, "Engine stats")."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable pages referenced by live requests
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up, cumulative
    prefix_cache_hits: int = 0  # prompt tokens found, cumulative
