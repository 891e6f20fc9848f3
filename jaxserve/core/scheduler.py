"""Scheduler: continuous batching under a unified token budget, in the manner of vLLM V1.

Each step hands out at most ``max_num_batched_tokens`` tokens to at most ``max_num_seqs``
sequences: running requests first, in admission order (a decode token each, or the next chunk of
an unfinished prompt), then waiting requests in arrival order (preempted ones first). A prompt
longer than the remaining budget is split across steps (chunked prefill), so decodes keep flowing
while a long prompt enters. A newly admitted request first takes the longest run of cached full
pages that starts its tokens (automatic prefix caching, see KVCacheManager) and computes only the
rest.

When pages run out, the newest running request is preempted: its pages are freed (its full pages
stay in the prefix cache until evicted) and it is recomputed later from its tokens so far, which
gives the same tokens as if it had never been preempted. As in vLLM, a step that had to preempt
admits no new request.
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
    num_tokens: int = 0


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
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

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
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        scheduled = []
        budget = self.max_num_batched_tokens
        allocate = self.kv.allocate_slots
        running = self.running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = len(req.all_token_ids) - req.num_computed_tokens
            n = min(n, budget)
            while not allocate(req, n):
                victim = running.pop()  # the newest running request
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                i += 1
        # As vLLM does: no new admissions in a step that had to preempt.
        waiting = self.waiting
        kv = self.kv
        while waiting and budget > 0 and len(running) < self.max_num_seqs and not preempted:
            req = waiting[0]
            computed = kv.get_computed_pages(req) if req.num_computed_tokens == 0 else []
            num_cached = len(computed) * kv.page_size
            n = min(req.num_tokens - req.num_computed_tokens - num_cached, budget)
            if not allocate(req, n, computed):
                break
            waiting.popleft()
            if req.num_preemptions == 0 and kv.enable_caching:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_cached
                req.num_cached_tokens = num_cached
            req.num_computed_tokens += num_cached
            req.status = RequestStatus.RUNNING
            running.append(req)
            scheduled.append((req, n))
            budget -= n
        return SchedulerOutput(scheduled, self.max_num_batched_tokens - budget)

    def update(self, sched: SchedulerOutput, sampled: list[int]) -> list[EngineCoreOutput]:
        """Advance scheduled requests by their tokens; append sampled tokens where a sequence
        reached its end this step; finish requests that stop. ``sampled[i]`` belongs to
        ``sched.scheduled[i]``."""
        outputs = []
        finished = []
        page_size = self.kv.page_size
        cache_full_pages = self.kv.cache_full_pages
        for (req, n), token in zip(sched.scheduled, sampled):
            req.num_computed_tokens += n
            if req.num_computed_tokens // page_size > req.num_registered_pages:
                cache_full_pages(req)
            if req.num_computed_tokens < len(req.all_token_ids):
                continue  # a prompt chunk: nothing sampled yet
            token = int(token)
            req.all_token_ids.append(token)
            reason, stop_reason = self._check_stop(req, token)
            outputs.append(
                EngineCoreOutput(
                    req.request_id, [token], reason, stop_reason,
                    req.num_prompt_tokens, req.num_cached_tokens,
                )
            )
            if reason is not None:
                finished.append(req)
        if finished:
            done = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in done]
            for req in finished:
                del self.requests[req.request_id]
                self._free(req)
        return outputs

    def _check_stop(self, req: Request, token: int) -> tuple[str | None, int | None]:
        sp = req.sampling_params
        if sp.stop_token_ids and token in sp.stop_token_ids:
            return "stop", token
        if token in self.eos_token_ids and not sp.ignore_eos:
            return "stop", token
        n = len(req.all_token_ids)
        if sp.max_tokens is not None and n - len(req.prompt_token_ids) >= sp.max_tokens:
            return "length", None
        if n >= self.max_model_len:
            return "length", None
        return None, None

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            num_preemptions_total=self.num_preemptions,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
        )
