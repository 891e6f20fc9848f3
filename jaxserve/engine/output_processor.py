"""OutputProcessor: engine outputs (token ids) -> per-request text deltas (vLLM V1's name).

The one detokenize-and-stop loop, shared by the server (``AsyncLLM``, on the event loop: each
request's deltas go to its asyncio queue) and ``jaxserve.LLM`` (no queue: the deltas are
returned). For each live request it keeps one IncrementalDetokenizer per choice (stop strings
are matched here, not in the engine), counts tokens, turns log-probabilities into
``Logprob`` entries, and records request metrics when given a Metrics.

A request with ``n`` choices runs in the engine as ``n`` sequences (``child_request_id``);
their outputs come back here under those ids and are folded into the request's RequestOutput.

Its outputs are ``jaxserve.outputs.RequestOutput`` objects used as deltas (vLLM's
RequestOutputKind.DELTA): each holds the choices with news, whose ``text`` / ``token_ids`` /
``logprobs`` are what is new since the previous delta; ``finished`` is True on the last (every
choice has finished); the sum of a choice's deltas' ``token_ids`` lengths is the number of
tokens it generated (EOS / stop token included; their text is not).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from jaxserve.engine import EngineCoreOutput, LogprobsLists, child_request_id
from jaxserve.engine.detokenizer import IncrementalDetokenizer, TokenPieces
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve.engine")


class RequestError(RuntimeError):
    """A request failed in the engine.

    Attributes:
      kind: "invalid_request" (the engine rejected it: answer 400) or "internal" (500).
    """

    def __init__(self, message: str, kind: str = "internal"):
        super().__init__(message)
        self.kind = kind


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Fold a later delta of the same request into an earlier one (a lagging consumer)."""
    by_index = {c.index: c for c in earlier.outputs}
    for b in later.outputs:
        a = by_index.get(b.index)
        if a is None:
            earlier.outputs.append(b)
            by_index[b.index] = b
            continue
        a.text += b.text
        a.token_ids = a.token_ids + b.token_ids
        if b.logprobs is not None:
            a.logprobs = (a.logprobs or []) + b.logprobs
        a.cumulative_logprob = b.cumulative_logprob  # the later delta's covers every token
        a.finish_reason, a.stop_reason = b.finish_reason, b.stop_reason
    earlier.outputs.sort(key=lambda c: c.index)
    earlier.finished = later.finished
    earlier.num_cached_tokens = later.num_cached_tokens
    if later.prompt_logprobs is not None:
        earlier.prompt_logprobs = later.prompt_logprobs
    return earlier


@dataclass
class ChoiceState:
    """One choice's detokenizer and progress."""

    detokenizer: IncrementalDetokenizer
    num_output_tokens: int = 0
    cumulative_logprob: float = 0.0  # of its tokens so far (when logprobs are asked for)
    finished: bool = False
    last_output_time: float | None = None  # time.monotonic() of its latest tokens
    # The engine's time.monotonic() (EngineCoreOutput.queued_ts / scheduled_ts, and the step's
    # Outputs.timestamp of its first tokens): its queue, prefill and decode phases.
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    choices: list[ChoiceState]
    queue: asyncio.Queue | None
    arrival_time: float
    lora_request: LoRARequest | None = None
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    engine_ids: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)


@dataclass
class OutputProcessorOutput:
    """Deltas of requests that have no queue, and engine ids (choices) the engine must abort
    (a stop string matched before the engine saw a stop)."""

    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]


class OutputProcessor:
    """Turns EngineCoreOutputs into RequestOutput deltas.

    Args:
      tokenizer: the transformers tokenizer (for detokenization).
      eos_token_ids: ids that end generation by default; kept out of the text.
      metrics: optional ``jaxserve.metrics.Metrics`` to record finished requests in.

    Attributes:
      pieces: each token's text and bytes (TokenPieces), for log-probabilities.
    """

    def __init__(self, tokenizer, eos_token_ids=(), metrics=None):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.metrics = metrics
        self.pieces = TokenPieces(tokenizer)
        self.requests: dict[str, RequestState] = {}
        self._choice_of: dict[str, tuple[RequestState, int]] = {}  # engine id -> choice

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, queue: asyncio.Queue | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Track a request. With a ``queue`` its deltas (and errors) go there; without one
        ``process_outputs`` returns them. ``lora_request``: the adapter it runs with, named in
        its outputs."""
        sp = sampling_params
        choices = [ChoiceState(IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=sp.skip_special_tokens, stop=sp.stop,
            include_stop_str_in_output=sp.include_stop_str_in_output, min_tokens=sp.min_tokens,
            prompt_token_ids=prompt_token_ids)) for _ in range(sp.n)]
        st = RequestState(request_id, prompt, prompt_token_ids, sp, choices, queue,
                          time.monotonic(), lora_request)
        st.engine_ids = [child_request_id(request_id, i, sp.n) for i in range(sp.n)]
        self.requests[request_id] = st
        for i, eid in enumerate(st.engine_ids):
            self._choice_of[eid] = (st, i)

    def _forget(self, st: RequestState) -> None:
        self.requests.pop(st.request_id, None)
        for eid in st.engine_ids:
            self._choice_of.pop(eid, None)

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns the engine ids of its unfinished choices (the caller
        aborts them in the engine), empty if it was not live."""
        st = self.requests.get(request_id)
        if st is None:
            return []
        self._forget(st)
        return [eid for eid, c in zip(st.engine_ids, st.choices) if not c.finished]

    def request_id_of(self, engine_id: str) -> str:
        """The request an engine id (a choice's, or the request's own) belongs to."""
        hit = self._choice_of.get(engine_id)
        return engine_id if hit is None else hit[0].request_id

    def process_outputs(self, outputs: list[EngineCoreOutput],
                        engine_time: float | None = None) -> OutputProcessorOutput:
        """Detokenize, check stop strings, and queue or return the deltas.

        ``engine_time``: the engine process's ``time.monotonic()`` when the step's tokens were
        known (``messages.Outputs.timestamp``); None: now (the engine runs in this process).

        An error while handling one request's output (a queued request: the server) fails that
        request alone with a RequestError, and it is aborted in the engine; the others go on.
        Without a queue (offline) the error is raised. A choice the engine ended with
        finish_reason "error" fails its request the same way (kind "invalid_request");
        offline, the choice ends with that finish_reason and its message is logged.
        """
        to_abort, returned = [], []
        now = time.monotonic()
        if engine_time is None:
            engine_time = now
        step_tokens = 0  # as vLLM's iteration_tokens_total counts them
        for o in outputs:
            hit = self._choice_of.get(o.request_id)
            if hit is None:
                continue  # aborted meanwhile
            st, index = hit
            if st.choices[index].finished:
                continue  # a stop string ended it; tokens already in flight are dropped
            first = o.new_token_ids and not st.choices[index].num_output_tokens
            step_tokens += len(o.new_token_ids) + (len(st.prompt_token_ids) if first else 0)
            if o.finish_reason == "error":
                if st.queue is not None:  # served: the request fails (400: its constraint)
                    st.choices[index].finished = True
                    to_abort += self.abort_request(st.request_id)
                    st.queue.put_nowait(RequestError(o.error, "invalid_request"))
                    continue
                logger.warning("request %s, choice %d: %s", st.request_id, index, o.error)
            try:
                out, abort = self._process_one(st, index, o, now, engine_time)
            except Exception as e:
                if st.queue is None:
                    raise
                to_abort += self.abort_request(st.request_id)
                st.queue.put_nowait(RequestError(
                    f"cannot process the engine's output: {type(e).__name__}: {e}"))
                continue
            if abort:
                to_abort.append(o.request_id)
            if st.queue is None:
                returned.append(out)
            else:
                st.queue.put_nowait(out)
        if step_tokens and self.metrics is not None:
            self.metrics.record_iteration(step_tokens)
        return OutputProcessorOutput(returned, to_abort)

    def _logprobs(self, lists: LogprobsLists) -> list[PositionLogprobs]:
        """LogprobsLists -> one {token id: Logprob} per position; the position's own token
        first, then the alternatives (an alternative equal to it is the same entry)."""
        out = []
        for ids, lps, rank in zip(lists.logprob_token_ids, lists.logprobs,
                                  lists.sampled_token_ranks):
            entry = {ids[0]: Logprob(lps[0], rank, self.pieces.piece(ids[0])[0])}
            for r, (t, lp) in enumerate(zip(ids[1:], lps[1:]), 1):
                entry.setdefault(t, Logprob(lp, r, self.pieces.piece(t)[0]))
            out.append(entry)
        return out

    def _process_one(self, st: RequestState, index: int, o: EngineCoreOutput, now: float,
                     engine_time: float) -> tuple[RequestOutput, bool]:
        """One choice's delta, and whether the engine must abort it (a stop string matched
        before the engine saw a stop). Forgets the request and records metrics when its last
        choice ends."""
        choice = st.choices[index]
        sp = st.sampling_params
        if o.scheduled_ts:  # the choice's first output
            choice.queued_ts, choice.scheduled_ts = o.queued_ts, o.scheduled_ts
            choice.first_token_ts = engine_time
        if o.new_token_ids:
            self._record_tokens(st, choice, len(o.new_token_ids), now)
        choice.num_output_tokens += len(o.new_token_ids)
        # Choices forked from choice 0 report no hits of their own: keep the request's.
        st.num_cached_tokens = max(st.num_cached_tokens, o.num_cached_tokens)
        ids = list(o.new_token_ids)
        text_ids = ids
        if o.finish_reason == "stop" and ids and not sp.include_stop_str_in_output:
            stoppers = self.eos_token_ids | set(sp.stop_token_ids)
            if ids[-1] in stoppers:
                text_ids = ids[:-1]  # the EOS / stop token is not part of the text
        text = choice.detokenizer.update(text_ids)
        finish_reason, stop_reason = o.finish_reason, o.stop_reason
        abort = False
        if choice.detokenizer.stop_matched is not None:
            finish_reason, stop_reason = "stop", choice.detokenizer.stop_matched
            abort = not o.finished
        elif finish_reason is not None:
            text += choice.detokenizer.flush()
        choice.finished = finish_reason is not None
        if choice.finished and choice.scheduled_ts and self.metrics is not None:
            self.metrics.record_phases(choice.scheduled_ts - choice.queued_ts,
                                       choice.first_token_ts - choice.scheduled_ts,
                                       engine_time - choice.first_token_ts,
                                       choice.num_output_tokens)
        logprobs = cumulative = None
        if o.new_logprobs is not None:
            logprobs = self._logprobs(o.new_logprobs)
            choice.cumulative_logprob += sum(lps[0] for lps in o.new_logprobs.logprobs)
        if sp.logprobs is not None:
            cumulative = choice.cumulative_logprob
        prompt_logprobs = None
        if o.new_prompt_logprobs is not None:
            prompt_logprobs = [None] + self._logprobs(o.new_prompt_logprobs)
        out = RequestOutput(
            st.request_id, st.prompt, st.prompt_token_ids,
            [CompletionOutput(index, text, ids, finish_reason, stop_reason, logprobs,
                              cumulative, st.lora_request)],
            num_cached_tokens=st.num_cached_tokens, finished=st.finished,
            prompt_logprobs=prompt_logprobs, lora_request=st.lora_request)
        if out.finished:
            self._forget(st)
            if self.metrics is not None:
                self.metrics.record_finished(finish_reason, len(st.prompt_token_ids),
                                             [c.num_output_tokens for c in st.choices],
                                             now - st.arrival_time, sp.max_tokens)
        return out, abort

    def _record_tokens(self, st: RequestState, choice: ChoiceState, num_tokens: int,
                       now: float) -> None:
        """Times a choice's new tokens: the request's first token, the gap since the choice's
        previous tokens."""
        if st.first_token_time is None:
            st.first_token_time = now
            if self.metrics is not None:
                self.metrics.record_first_token(now - st.arrival_time)
        if self.metrics is not None:
            gap = None if choice.last_output_time is None else now - choice.last_output_time
            self.metrics.record_output(num_tokens, gap)
        choice.last_output_time = now

    def propagate_error(self, request_ids, exc: BaseException) -> None:
        """Fail the given requests (engine ids or request ids; all live ones if
        ``request_ids`` is None) with ``exc``."""
        ids = list(self.requests) if request_ids is None else request_ids
        for rid in dict.fromkeys(self.request_id_of(i) for i in ids):
            st = self.requests.get(rid)
            if st is not None:
                self._forget(st)
                st.queue.put_nowait(exc)
