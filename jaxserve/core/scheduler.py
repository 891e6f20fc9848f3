"""Scheduler: continuous batching under a unified token budget, in the manner of vLLM V1.

Each step hands out at most ``max_num_batched_tokens`` tokens to at most ``max_num_seqs``
sequences: running requests first (a decode token each, or the next chunk of an unfinished
prompt), then waiting requests in arrival order. A prompt longer than the budget is split across
steps (chunked prefill). When pages run out, the newest running request is preempted: its pages
are freed and it is recomputed later from its tokens so far.
"""

from collections import deque
from dataclasses import dataclass, field

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request, RequestStatus
from jaxserve.engine import EngineCoreOutput, SchedulerStats


@dataclass
class SchedulerOutput:
    """The work of one step: (request, number of new tokens) in batch order."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
    ):
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_requests(self, request_ids) -> None:
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._free(req)

    def _free(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        self.kv.free(req)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                out.scheduled.append((req, n))
                budget -= n
                i += 1
        # As vLLM does: no new admissions in a step that had to preempt.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate_slots(req, n):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
        return out

    def update(self, sched: SchedulerOutput, sampled: list[int]) -> list[EngineCoreOutput]:
        """Advance scheduled requests by their tokens; append sampled tokens where a sequence
        reached its end this step; finish requests that stop. ``sampled[i]`` belongs to
        ``sched.scheduled[i]``."""
        outputs = []
        for (req, n), token in zip(sched.scheduled, sampled):
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prompt chunk: nothing sampled yet
            req.all_token_ids.append(int(token))
            reason, stop_reason = self._check_stop(req, int(token))
            outputs.append(
                EngineCoreOutput(
                    request_id=req.request_id,
                    new_token_ids=[int(token)],
                    finish_reason=reason,
                    stop_reason=stop_reason,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=req.num_cached_tokens,
                )
            )
            if reason is not None:
                self.running.remove(req)
                del self.requests[req.request_id]
                self._free(req)
        return outputs

    def _check_stop(self, req: Request, token: int) -> tuple[str | None, int | None]:
        sp = req.sampling_params
        if token in sp.stop_token_ids:
            return "stop", token
        if token in self.eos_token_ids and not sp.ignore_eos:
            return "stop", token
        if sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens:
            return "length", None
        if req.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            num_preemptions_total=self.num_preemptions,
        )
