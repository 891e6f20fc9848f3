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

A request with ``n`` > 1 choices runs as one sequence (choice 0) until its prompt is computed.
In the step that computes the prompt's last token, the other choices fork from it: they join
the batch holding references to its full prompt pages and a copy of its partly filled last one
(``KVCacheManager.fork``), and draw their first tokens from the logits of that same last token,
each with its own seed. The prompt is computed once, with or without prefix caching. When the
batch or the pool has no room for them then, they start like any other request instead.

A constrained sequence (``structured_outputs``) carries its grammar's matcher: ``schedule``
lists the constrained sequences that sample in the step, ``grammar_bitmask`` gives the tokens
their grammars allow next (from the StructuredOutputManager), and ``update`` advances each
matcher with the token drawn. So ``grammar_bitmask`` must come after the update with every
earlier token: under async scheduling, after the previous step's (EngineCore.step,
docs/structured_outputs.md). A sequence still in the model's reasoning (``--reasoning-parser``)
gets an all-allowed row, and its matcher starts after the token that ends the reasoning. A
sequence with ``allowed_token_ids`` is constrained too: its fixed row is ANDed into its grammar's
(or an all-allowed) row. A matcher that fails while its sequence generates (a limit of
llguidance's, met only by some grammars and only deep into an output) allows only EOS: that
token is dropped and the sequence ends with finish_reason "error" and the matcher's message
(``EngineCoreOutput.error``), not as a "stop" whose text breaks the constraint.

With speculative decoding (``spec_config``, docs/spec_decode.md) a running sequence that decodes
gets up to k draft tokens: with the n-gram method k draft slots whose tokens the step makes
on the device (-1 each here, ``spec_decode.device_drafts``), also while its previous step is
in flight; with the draft_model, eagle and eagle3 methods, with nothing in flight, those the
runner's drafter proposed after the sequence's last step (``ModelRunnerOutput.draft_token_ids``;
that step allocated pages for k lookahead positions, where the drafter writes its drafts' K/V,
as vLLM's ``num_lookahead_tokens``). They join its step as extra scheduled tokens (budget,
pages and max_tokens / max_model_len allow for them), and until the step's tokens are known
all of them count as accepted (``num_output_placeholders``: the most the step can emit, so the
next step's positions and pages may run ahead of the true ones, which the step settles on the
device). ``update`` takes the accepted ones with the sampled token, stops at a stop token
among them, and takes back the computed positions of the rejected ones. A constrained
sequence's drafts are checked by its grammar's masks: a row per draft, each after the drafts
before it (``grammar_bitmask``; with several hosts, whose bitmask host 0 publishes before the
step makes its n-gram drafts, constrained sequences get none: ``constrained_drafts``). A
sequence short of its min_tokens gets no drafts (its min_tokens mask is built from the host's
counts), and no sequence does while more than ``disable_by_batch_size`` requests are
unfinished (None: at any number).

A request that wants prompt log-probabilities takes no prefix-cache hits (every prompt position
must be computed), and its prompt chunks are capped so that one step never holds more than
``max_prompt_logprob_rows`` such positions (the runner turns them into logits chunk by chunk).

LoRA (``max_loras`` > 0, docs/lora.md): the running requests use at most ``max_loras`` distinct
adapters (vLLM's rule, counted over every running request so that any step of them fits the
device pool). A waiting request whose adapter would be one too many keeps its place, and the
base model's requests behind it are admitted (vLLM's skipped waiting requests); the adapters'
requests behind it wait too, so that the running adapters drain and it gets its turn (under
vLLM's rule, a busy adapter's new requests could hold its slot for ever).
"""

import time
from collections import deque

import numpy as np

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from jaxserve.engine import EngineCoreOutput, LogprobsLists, SchedulerStats
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.spec_decode.metrics import SpecDecodingStats


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        max_prompt_logprob_rows: int = 0,
        structured_output_manager=None,
        max_loras: int = 0,
        spec_config: SpeculativeConfig | None = None,
        constrained_drafts: bool = True,
    ):
        self.kv = kv_cache_manager
        self.structured_output_manager = structured_output_manager
        self.max_prompt_logprob_rows = max_prompt_logprob_rows
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_req_ids: set[str] = set()  # left the batch since the last schedule()
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens_computed = 0
        self.spec_config = spec_config
        self.drafts_on_device = spec_config is not None and spec_config.method == "ngram"
        self.constrained_drafts = constrained_drafts
        # draft_model: req_id -> (its token count when drafted, the runner's drafts after it)
        self._model_drafts: dict[str, tuple[int, list[int]]] = {}
        self.spec_stats = SpecDecodingStats.new(
            spec_config.num_speculative_tokens if spec_config else 0)

    def add_request(self, request: Request) -> None:
        """Queue a request: a sequence, with its other choices in ``fork_children``."""
        self.requests[request.request_id] = request
        for child in request.fork_children:
            self.requests[child.request_id] = child
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def speculates(self) -> bool:
        """Whether the next ``schedule`` may give drafts: speculative decoding is on and at most
        ``disable_by_batch_size`` requests are unfinished (None: at any number)."""
        if self.spec_config is None:
            return False
        limit = self.spec_config.disable_by_batch_size
        return limit is None or len(self.running) + len(self.waiting) <= limit

    def drafts_on_host(self) -> bool:
        """Whether the next ``schedule`` may give drafts that a drafter proposed after the
        previous step's tokens (draft_model, eagle, eagle3): the engine then runs the step
        synchronously."""
        return self.speculates() and not self.drafts_on_device

    def has_structured_requests(self) -> bool:
        """Some unfinished sequence is constrained (a grammar or allowed_token_ids)."""
        return any(r.constrained for r in self.requests.values())

    def abort_requests(self, request_ids) -> None:
        """Abort sequences by id (a choice's id aborts that choice alone). Choices that wait for
        an aborted choice 0 to fork start on their own instead."""
        orphans = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.fork_parent is not None:  # a choice not forked yet: it holds nothing
                if req in req.fork_parent.fork_children:
                    req.fork_parent.fork_children.remove(req)
                req.status = RequestStatus.FINISHED
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._free(req)
            orphans += req.fork_children
            req.fork_children = []
        for child in reversed(orphans):
            if child.request_id in self.requests:
                child.fork_parent = None
                self.waiting.appendleft(child)

    def _free(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        self.kv.free(req)
        self.finished_req_ids.add(req.request_id)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        self.finished_req_ids.add(req.request_id)

    def _finishes_in_flight(self, req: Request) -> bool:
        """True when a token still in flight ends the request by length: scheduling it again
        would compute a token nobody reads. (Only with async scheduling: without it no token is
        in flight when the scheduler runs.)"""
        n = req.num_tokens + req.num_output_placeholders
        sp = req.sampling_params
        return req.num_output_placeholders > 0 and (
            n >= self.max_model_len
            or (sp.max_tokens is not None and n - req.num_prompt_tokens >= sp.max_tokens))

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work. Advances each scheduled request's ``num_computed_tokens`` by
        its scheduled tokens (their K/V are in the pool once the step has run, and every later
        step runs after it), and counts a token in flight (``num_output_placeholders``) for each
        request whose step ends at its last token: under async scheduling the next schedule()
        can come before that token is known, and the runner feeds it from the device."""
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        budget = self.max_num_batched_tokens
        self._logprob_rows = self.max_prompt_logprob_rows
        forks: list[Request] = []
        allocate = self.kv.allocate_slots
        running = self.running
        preempted = False
        speculates = self.speculates()
        out.propose_drafts = speculates and not self.drafts_on_device
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if self._finishes_in_flight(req):
                i += 1
                continue
            n = req.num_tokens + req.num_output_placeholders - req.num_computed_tokens
            n = self._cap(req, min(n, budget))
            if n == 0:
                i += 1
                continue
            drafts = []
            if (speculates and n == 1 and (self.constrained_drafts or not req.constrained)
                    and (self.drafts_on_device or req.num_output_placeholders == 0)):
                drafts = self._drafts(req, budget - 1)
                n += len(drafts)
            num_pages = len(req.block_ids)
            while not allocate(req, n + self._lookahead(out, req, n)):
                victim = running.pop()  # the newest running request
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                if len(req.block_ids) > num_pages:
                    out.new_block_ids[req.request_id] = req.block_ids[num_pages:]
                self._schedule(out, req, n, forks, drafts)
                budget -= n
                i += 1
        # As vLLM does: no new admissions in a step that had to preempt.
        waiting = self.waiting
        kv = self.kv
        loras = {r.lora_int_id for r in running if r.lora_int_id} if self.max_loras else set()
        skipped: list[Request] = []  # adapters' requests that wait for a slot, in order
        while waiting and budget > 0 and len(running) < self.max_num_seqs and not preempted:
            req = waiting[0]
            if req.lora_int_id and (skipped or (req.lora_int_id not in loras
                                                and len(loras) == self.max_loras)):
                skipped.append(waiting.popleft())
                continue
            plp = req.needs_prompt_logprobs
            computed = kv.get_computed_pages(req) if req.num_computed_tokens == 0 and not plp else []
            num_cached = len(computed) * kv.page_size
            n = self._cap(req, min(req.num_tokens - req.num_computed_tokens - num_cached, budget))
            lookahead = self._lookahead(out, req, num_cached + n)
            if n == 0 or not allocate(req, n + lookahead, computed):
                break
            waiting.popleft()
            if req.num_preemptions == 0 and kv.enable_caching:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_cached
                req.num_cached_tokens = num_cached
            req.num_computed_tokens += num_cached
            if req.num_output_tokens == 0:
                req.scheduled_ts = time.monotonic()
            req.status = RequestStatus.RUNNING
            if req.lora_int_id:
                loras.add(req.lora_int_id)
            running.append(req)
            out.new_reqs.append(self._new_request_data(req))
            self._schedule(out, req, n, forks)
            budget -= n
        waiting.extendleft(reversed(skipped))  # they keep their places
        for req in forks:
            self._fork(out, req)
        out.total_num_scheduled_tokens = self.max_num_batched_tokens - budget
        out.structured_output_request_ids = [
            rid for rid, samples in out.samples.items()
            if samples and self.requests[rid].constrained]
        return out

    def grammar_bitmask(self, out: SchedulerOutput,
                        drafts: dict[str, list[int]] | None = None) -> None:
        """Set ``out.grammar_bitmask``: the tokens each of its constrained sequences may draw,
        a row per logits row of the sequence: with k drafts, the rows that verify them (each
        after the drafts before it) then the row that samples (``manager.grammar_bitmask``).
        A sequence that finished since ``schedule`` (its rows' tokens will be dropped), or
        whose reasoning has not ended, gets all-allowed rows (then its allowed_token_ids).

        Args:
          out: the step.
          drafts: per sequence, the drafts its step verifies, where the step made them on the
            device (``ModelRunner.step_drafts``); default ``out.scheduled_spec_decode_tokens``.

        Raises:
          RuntimeError: a sequence's matcher has not seen a token before this step's (an
            update is missing).
        """
        if not out.structured_output_request_ids:
            return
        ids = out.structured_output_request_ids
        drafts = out.scheduled_spec_decode_tokens if drafts is None else drafts
        reqs = [self.requests.get(rid) for rid in ids]
        sizes = [1 + len(out.scheduled_spec_decode_tokens.get(rid, ())) for rid in ids]
        first = np.cumsum([0] + sizes)
        live = [i for i, r in enumerate(reqs) if r is not None]
        grammars = [i for i in live if reqs[i].grammar is not None
                    and reqs[i].reasoning_end_token_id is None]
        if any(reqs[i].num_output_placeholders > sizes[i] for i in grammars):
            raise RuntimeError("a constrained sequence's grammar is behind its tokens")
        manager = self.structured_output_manager
        mask = np.full((first[-1], manager.width), -1, np.int32)
        if grammars:
            # A draft the lookup left empty (-1, or a filler past the vocabulary) ends them.
            valid = [_valid_prefix(drafts.get(ids[i], ()), manager.vocab_size) for i in grammars]
            rows = manager.grammar_bitmask([reqs[i].grammar for i in grammars], valid)
            at = np.cumsum([0] + [1 + len(d) for d in valid])
            for i, a, b in zip(grammars, at[:-1], at[1:]):
                mask[first[i] : first[i] + b - a] = rows[a:b]
        for i in live:
            if reqs[i].allowed_bitmask is not None:
                mask[first[i] : first[i + 1]] &= reqs[i].allowed_bitmask
        out.grammar_bitmask = mask

    def _cap(self, req: Request, n: int) -> int:
        """n, or fewer tokens when the request computes prompt log-probabilities and the
        step's rows for them run short (0: not this step)."""
        if not req.needs_prompt_logprobs:
            return n
        n = min(n, self._logprob_rows)
        self._logprob_rows -= n
        return n

    def _new_request_data(self, req: Request) -> NewRequestData:
        sp = req.sampling_params
        stop_ids = list(sp.stop_token_ids) if sp.min_tokens else []
        if sp.min_tokens and not sp.ignore_eos:
            stop_ids += sorted(self.eos_token_ids)
        return NewRequestData(req.request_id, list(req.all_token_ids), req.num_prompt_tokens,
                              sp, req.seed, list(req.block_ids), req.num_computed_tokens,
                              stop_ids, req.lora_request)

    def _lookahead(self, out: SchedulerOutput, req: Request, n: int) -> int:
        """Positions past the n tokens req computes this step that its pages must cover: k
        when the draft model proposes after the step (it writes its drafts' K/V there), up to
        max_model_len."""
        if not out.propose_drafts:
            return 0
        return max(0, min(self.spec_config.num_speculative_tokens,
                          self.max_model_len - req.num_computed_tokens - n))

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """The drafts for a decoding sequence (the n-gram method's slots, -1 each, or the draft
        model's made after its newest token): at most k, the budget's tokens, and one fewer
        than the tokens max_tokens and max_model_len leave once every token in flight is
        counted (the step emits up to one more than its accepted drafts); none short of
        min_tokens for the n-gram method."""
        sp = req.sampling_params
        n = req.num_tokens + req.num_output_placeholders
        k = min(self.spec_config.num_speculative_tokens, budget, self.max_model_len - n - 1)
        if sp.max_tokens is not None:
            k = min(k, sp.max_tokens - (n - req.num_prompt_tokens) - 1)
        if k <= 0:
            return []
        if self.drafts_on_device:
            return [] if req.num_output_tokens < sp.min_tokens else [-1] * k
        num_tokens, drafts = self._model_drafts.get(req.request_id, (-1, []))
        return drafts[:k] if num_tokens == req.num_tokens else []

    def _schedule(self, out: SchedulerOutput, req: Request, n: int, forks: list,
                  drafts: list[int] = ()) -> None:
        samples = (req.num_computed_tokens + n - len(drafts)
                   == req.num_tokens + req.num_output_placeholders)
        if drafts:
            out.scheduled_spec_decode_tokens[req.request_id] = drafts
        out.num_scheduled_tokens[req.request_id] = n
        out.samples[req.request_id] = samples
        self.prompt_tokens_computed += max(
            0, min(req.num_computed_tokens + n, req.num_prompt_tokens) - req.num_computed_tokens)
        if req.needs_prompt_logprobs:
            out.prompt_logprobs.add(req.request_id)
        req.num_computed_tokens += n
        if samples:
            req.num_output_placeholders += 1 + len(drafts)
            if req.fork_children:
                forks.append(req)

    def _fork(self, out: SchedulerOutput, parent: Request) -> None:
        """Start the other choices of ``parent``, whose prompt this step computes (module
        docstring); without room for all of them, they wait as requests of their own."""
        children, parent.fork_children = parent.fork_children, []
        copies = None
        if len(self.running) + len(children) <= self.max_num_seqs:
            copies = self.kv.fork(parent, children)
        for child in children:
            child.fork_parent = None
        if copies is None:
            self.waiting.extendleft(reversed(children))
            return
        out.copy_pages += copies
        for child in children:
            child.num_computed_tokens = child.num_prompt_tokens
            child.num_output_placeholders = 1
            child.scheduled_ts = parent.scheduled_ts  # its prefill was the parent's
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            out.new_reqs.append(self._new_request_data(child))
            out.num_scheduled_tokens[child.request_id] = 0
            out.samples[child.request_id] = True
            out.forked_from[child.request_id] = parent.request_id

    def update(self, sched: SchedulerOutput, output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Take what a step produced (``output.sampled``: req_id -> token, for the requests whose
        ``sched.samples`` is True; their log-probabilities; prompt log-probabilities of prompt
        chunks), register newly computed full pages in the prefix cache, and finish requests
        that stop. Requests that finished or were aborted since the step was scheduled are
        skipped; a preempted one still takes its token (computed from its full context before
        the preemption)."""
        outputs = []
        finished = []
        running = RequestStatus.RUNNING
        self._model_drafts = {}  # made after this step's tokens, or stale
        for rid, (first, lp) in output.prompt_logprobs.items():
            req = self.requests.get(rid)
            if req is not None and req.prompt_logprobs is not None:
                # Positions already recorded (before a preemption) are computed again: skip.
                skip = len(req.prompt_logprobs) + 1 - first
                if skip < len(lp):
                    req.prompt_logprobs.extend(LogprobsLists(
                        lp.logprob_token_ids[skip:], lp.logprobs[skip:],
                        lp.sampled_token_ranks[skip:]))
        for rid in sched.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None:
                continue
            if not sched.samples[rid]:  # a prompt chunk: nothing sampled yet
                if req.status == running:
                    self.kv.cache_full_pages(req)
                continue
            drafts = sched.scheduled_spec_decode_tokens.get(rid)
            req.num_output_placeholders -= 1 + len(drafts or ())
            tokens = [*output.accepted_token_ids.get(rid, ()), int(output.sampled[rid])]
            if drafts:
                proposed = output.num_proposed.get(rid, len(drafts))
                if proposed:  # slots the n-gram lookup left empty are not drafts
                    self.spec_stats.observe(proposed, len(tokens) - 1)
                if req.status == running:  # rejected drafts' positions are computed again
                    req.num_computed_tokens -= len(drafts) + 1 - len(tokens)
            first_output = req.num_output_tokens == 0
            reason = stop_reason = error = None
            n = 0  # tokens emitted
            for token in tokens:
                if req.grammar is not None and req.grammar.is_error():
                    # llguidance failed a mask (one of its LIMITS, past which a valid spec's
                    # lexer or parser grows): the token drawn under it (EOS) is not the grammar's.
                    reason, error = "error", _grammar_error(req.grammar)
                    break
                n += 1
                req.all_token_ids.append(token)
                if req.reasoning_end_token_id is not None:
                    if token == req.reasoning_end_token_id:  # the grammar starts with the next
                        req.reasoning_end_token_id = None
                elif req.grammar is not None and not req.grammar.is_stopped():
                    # A token the mask allowed; EOS after a complete grammar stops the matcher.
                    req.grammar.consume_token(token)
                reason, stop_reason = self._check_stop(req, token)
                if reason is not None:  # accepted drafts after a stop are dropped
                    break
            if req.status == running and error is None:
                self.kv.cache_full_pages(req)
                if rid in output.draft_token_ids and reason is None:
                    self._model_drafts[rid] = (req.num_tokens, output.draft_token_ids[rid])
            prompt_lp = None
            if req.prompt_logprobs is not None and first_output:
                prompt_lp = req.prompt_logprobs
            logprobs = output.logprobs.get(rid)
            if logprobs is not None and n < len(tokens):
                logprobs = LogprobsLists(logprobs.logprob_token_ids[:n], logprobs.logprobs[:n],
                                         logprobs.sampled_token_ranks[:n])
            times = (req.queued_ts, req.scheduled_ts) if first_output else (0.0, 0.0)
            outputs.append(
                EngineCoreOutput(
                    req.request_id, tokens[:n], reason, stop_reason,
                    req.num_prompt_tokens, req.num_cached_tokens, logprobs, prompt_lp, *times,
                    error=error,
                )
            )
            if reason is not None:
                finished.append(req)
        if finished:
            done = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in done]
            for req in finished:
                if req.status != running:
                    self.waiting.remove(req)
                del self.requests[req.request_id]
                self._free(req)
        return outputs

    def _check_stop(self, req: Request, token: int) -> tuple[str | None, int | None]:
        sp = req.sampling_params
        n = len(req.all_token_ids)
        # The sampler holds stops back until min_tokens, unless a constrained sequence's
        # grammar allows nothing else (it is complete; the grammar wins): a stop token drawn
        # before min_tokens is then that. ``token`` is the last of n tokens.
        if (not sp.min_tokens or n - req.num_prompt_tokens > sp.min_tokens
                or sp.structured_outputs is not None):
            if sp.stop_token_ids and token in sp.stop_token_ids:
                return "stop", token
            if token in self.eos_token_ids and not sp.ignore_eos:
                return "stop", None  # vLLM's: stop_reason names only a stop the request set
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
            prompt_tokens_computed=self.prompt_tokens_computed,
            running_lora_adapters=self._lora_names(self.running),
            waiting_lora_adapters=self._lora_names(self.waiting),
            spec_decoding=self.spec_stats.plus(SpecDecodingStats()),  # a copy
        )

    def _lora_names(self, requests) -> list[str]:
        """The LoRA adapters' names among ``requests``, sorted (none without LoRA)."""
        if not self.max_loras:
            return []
        return sorted({r.lora_request.lora_name for r in requests if r.lora_request})


def _grammar_error(matcher) -> str:
    """The message of a request whose matcher failed while it generated."""
    why = matcher.get_error().replace("<non-verbose/>", "").strip()
    return (f"structured_outputs: the constraint failed during generation: {why} (a limit of "
            "the grammar engine, llguidance; a simpler constraint avoids it)")


def _valid_prefix(drafts, vocab_size: int) -> list[int]:
    """The drafts up to the first that is no token of the vocabulary."""
    out = []
    for d in drafts:
        if not 0 <= d < vocab_size:
            break
        out.append(int(d))
    return out
