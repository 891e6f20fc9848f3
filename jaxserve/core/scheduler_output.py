"""SchedulerOutput: the data contract from the Scheduler to the ModelRunner, and
ModelRunnerOutput, what comes back (vLLM V1's shapes).

Plain data, no live ``Request`` objects: the runner keeps its own persistent copy of each running
request's state (``jaxserve.worker.input_batch.InputBatch``) and applies only what changed.
"""

from dataclasses import dataclass, field

import numpy as np

from jaxserve.engine import LogprobsLists
from jaxserve.lora.request import LoRARequest
from jaxserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request entering the batch: first admission, or again after a preemption.

    Attributes:
      req_id: the request.
      token_ids: every token known now, prompt first (a resumed request's earlier outputs too).
      num_prompt_tokens: length of the prompt part of token_ids.
      sampling_params: its sampling settings.
      seed: its RNG seed (uint32).
      block_ids: the KV pages it holds, in sequence order.
      num_computed_tokens: tokens whose K/V are already in the pool before this step (prefix-
        cache hits; a forked choice's whole prompt).
      stop_token_ids: the ids ``min_tokens`` holds back (EOS unless ignore_eos, and the
        request's stop_token_ids).
      lora_request: its LoRA adapter, or None for the base model.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    block_ids: list[int]
    num_computed_tokens: int
    stop_token_ids: list[int] = field(default_factory=list)
    lora_request: LoRARequest | None = None


@dataclass
class SchedulerOutput:
    """The work of one step.

    Attributes:
      num_scheduled_tokens: req_id -> tokens to compute this step, in batch order.
      samples: req_id -> whether the step ends at the request's last token, so the token sampled
        from its row is its next output (False for a prompt chunk that does not finish it).
      new_reqs: requests that enter the batch this step.
      new_block_ids: req_id -> pages appended to a running request's block table this step.
      finished_req_ids: requests that left the batch since the previous step (finished,
        aborted or preempted); the runner drops them before adding new_reqs.
      total_num_scheduled_tokens: sum of num_scheduled_tokens.
      forked_from: choice req_id -> the req_id it forks from (``n`` > 1): the choice enters
        the batch with its prompt's K/V shared (0 tokens scheduled) and draws its first token
        from the logits of the parent's last prompt token, in this step.
      copy_pages: (source, destination) KV pages to copy once this step has run (a forked
        choice's own copy of the parent's partly filled last prompt page).
      prompt_logprobs: requests whose scheduled prompt tokens need prompt log-probabilities.
      structured_output_request_ids: the constrained requests that sample this step, in the
        order of ``grammar_bitmask``'s rows.
      grammar_bitmask: [len(structured_output_request_ids), ceil(V / 32)] int32, the tokens
        each may sample (bit j of word i allows token 32 i + j); None when none samples.
      scheduled_spec_decode_tokens: req_id -> the draft tokens the step verifies after the
        request's last known token (speculative decoding; counted in num_scheduled_tokens).
      propose_drafts: the draft model proposes the next step's drafts after this step (the
        draft_model method, in a step that may carry drafts; its sequences' pages reach k
        positions past their scheduled tokens).
    """

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    samples: dict[str, bool] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    total_num_scheduled_tokens: int = 0
    forked_from: dict[str, str] = field(default_factory=dict)
    copy_pages: list[tuple[int, int]] = field(default_factory=list)
    prompt_logprobs: set[str] = field(default_factory=set)
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    propose_drafts: bool = False


@dataclass
class ModelRunnerOutput:
    """What a step produced, on the host (vLLM V1's name).

    Attributes:
      sampled: req_id -> its new token, for the requests whose step ended at their last token.
      logprobs: req_id -> LogprobsLists of its new tokens (requests that asked): the accepted
        drafts, then the sampled token.
      prompt_logprobs: req_id -> (index of the first prompt token covered, LogprobsLists of
        the prompt tokens from there), for requests whose prompt chunk asked.
      accepted_token_ids: req_id -> the draft tokens accepted before ``sampled[req_id]``, for
        the requests that verified drafts (speculative decoding; docs/spec_decode.md).
      draft_token_ids: req_id -> the draft model's drafts to follow its newest token (the
        draft_model method, after a step with ``propose_drafts``).
      num_proposed: req_id -> how many of its draft slots the step filled with a draft, for
        the requests whose step made fewer than it was given (the n-gram method's lookup
        found fewer, ``spec_decode.device_drafts``).
    """

    sampled: dict[str, int]
    logprobs: dict[str, LogprobsLists]
    prompt_logprobs: dict[str, tuple[int, LogprobsLists]]
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_proposed: dict[str, int] = field(default_factory=dict)
