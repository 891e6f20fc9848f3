"""Request: the engine's state of one sequence (tokens, progress, KV pages)."""

import enum
import time

from jaxserve.engine import EngineCoreRequest, LogprobsLists, child_request_id
from jaxserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


class Request:
    """One sequence inside the engine: a request, or one choice of a request with ``n`` > 1.

    Args:
      req: the engine request.
      seed: the RNG seed of this sequence's sampling.
      index: the choice this sequence is (its id is ``child_request_id(request id, index, n)``).

    Attributes:
      all_token_ids: prompt followed by generated tokens.
      num_computed_tokens: tokens whose K/V are in the pool once every step scheduled so far
        has run (prefix-cache hits included).
      num_output_placeholders: sampled tokens in flight: scheduled steps will produce them, but
        their values are not known to the host yet (async scheduling; 0 between steps otherwise).
        A step with k drafts counts k + 1, the most it can emit (speculative decoding).
      block_ids: KV pages held, in sequence order.
      block_hashes: prefix-cache keys of the full pages of all_token_ids computed so far
        (kept across preemption: the tokens do not change).
      num_registered_pages: leading pages of block_ids already entered in the prefix cache.
      num_cached_tokens: prompt tokens served from the prefix cache at first admission.
      num_preemptions: times this request was preempted (recomputed).
      seed: the RNG seed of this request's sampling (drawn by the engine when not given).
      fork_children: the other choices of a request with n > 1, waiting for this one (choice
        0) to finish its prompt: they then share its prompt's pages (Scheduler).
      fork_parent: while this choice waits so, the choice it will fork from.
      prompt_logprobs: log-probabilities of the prompt tokens after the first, gathered chunk
        by chunk when the request asks for them (None otherwise); sent with the first output.
      grammar: the llguidance matcher of a constrained sequence (``structured_outputs``),
        advanced with each of its output tokens; None otherwise. Preemption keeps it as it
        is: recomputing replays tokens the matcher has already consumed, and samples only
        the next one.
      reasoning_end_token_id: while the sequence is still in the model's reasoning, the token
        that ends it (EngineCoreRequest's); its grammar neither constrains nor consumes until
        that token is drawn, then this is None.
      allowed_bitmask: [ceil(V / 32)] int32, the tokens ``allowed_token_ids`` lets it draw
        (shared by a request's choices), or None.
      lora_request: its LoRA adapter (EngineCoreRequest's); lora_int_id: its id, 0 for none.
      cache_salt: EngineCoreRequest's: its pages are shared only with requests of the same salt.
    """

    def __init__(self, req: EngineCoreRequest, seed: int, index: int = 0, grammar=None,
                 allowed_bitmask=None):
        n = req.sampling_params.n
        self.request_id = child_request_id(req.request_id, index, n)
        self.index = index
        self.prompt_token_ids = req.prompt_token_ids
        self.sampling_params: SamplingParams = req.sampling_params
        self.seed = seed
        self.all_token_ids = list(req.prompt_token_ids)  # grows; prompt_token_ids does not
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_cached_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_registered_pages = 0
        self.num_preemptions = 0
        # time.monotonic(): arrival, and the latest scheduling before the first token (metrics).
        self.queued_ts = time.monotonic()
        self.scheduled_ts = 0.0
        self.status = RequestStatus.WAITING
        self.fork_children: list[Request] = []
        self.fork_parent: Request | None = None
        # The prompt's log-probabilities go out once, with choice 0.
        wants = req.sampling_params.prompt_logprobs is not None and index == 0
        self.prompt_logprobs: LogprobsLists | None = LogprobsLists() if wants else None
        self.grammar = grammar
        self.reasoning_end_token_id = req.reasoning_end_token_id if grammar is not None else None
        self.allowed_bitmask = allowed_bitmask
        self.lora_request = req.lora_request
        self.lora_int_id = req.lora_request.lora_int_id if req.lora_request else 0
        self.cache_salt = req.cache_salt

    @property
    def constrained(self) -> bool:
        """Its sampling takes a bitmask row: a grammar, or allowed_token_ids."""
        return self.grammar is not None or self.allowed_bitmask is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Some prompt position's log-probabilities are still to compute."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)
