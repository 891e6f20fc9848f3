"""OutputProcessor: engine outputs (token ids) -> per-request text deltas (vLLM V1's name).

The one detokenize-and-stop loop, shared by the server (``AsyncLLM``, on the event loop: each
request's deltas go to its asyncio queue) and ``jaxserve.LLM`` (no queue: the deltas are
returned). For each live request it keeps an IncrementalDetokenizer (stop strings are matched
here, not in the engine), counts tokens, and records request metrics when given a Metrics.

Its outputs are ``jaxserve.outputs.RequestOutput`` objects used as deltas (vLLM's
RequestOutputKind.DELTA): ``outputs[0].text`` / ``token_ids`` hold what is new since the previous
one, ``finished`` is True on the last; the sum of the deltas' ``token_ids`` lengths is the number
of generated tokens (EOS / stop token included; their text is not).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from jaxserve.engine import EngineCoreOutput
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams


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
    a, b = earlier.outputs[0], later.outputs[0]
    a.text += b.text
    a.token_ids = a.token_ids + b.token_ids
    a.finish_reason, a.stop_reason = b.finish_reason, b.stop_reason
    earlier.finished = later.finished
    earlier.num_cached_tokens = later.num_cached_tokens
    return earlier


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    detokenizer: IncrementalDetokenizer
    queue: asyncio.Queue | None
    arrival_time: float
    first_token_time: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class OutputProcessorOutput:
    """Deltas of requests that have no queue, and ids the engine must abort (a stop string
    matched before the engine saw a stop)."""

    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]


class OutputProcessor:
    """Turns EngineCoreOutputs into RequestOutput deltas.

    Args:
      tokenizer: the transformers tokenizer (for detokenization).
      eos_token_ids: ids that end generation by default; kept out of the text.
      metrics: optional ``jaxserve.metrics.Metrics`` to record finished requests in.
    """

    def __init__(self, tokenizer, eos_token_ids=(), metrics=None):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.metrics = metrics
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, queue: asyncio.Queue | None = None) -> None:
        """Track a request. With a ``queue`` its deltas (and errors) go there; without one
        ``process_outputs`` returns them."""
        detok = IncrementalDetokenizer(self.tokenizer, stop=sampling_params.stop,
                                       prompt_token_ids=prompt_token_ids)
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids,
                                                 sampling_params, detok, queue, time.monotonic())

    def abort_request(self, request_id: str) -> bool:
        """Forget a request (the caller aborts it in the engine). True if it was live."""
        return self.requests.pop(request_id, None) is not None

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        """Detokenize, check stop strings, and queue or return the deltas.

        An error while handling one request's output (a queued request: the server) fails that
        request alone with a RequestError, and it is aborted in the engine; the others go on.
        Without a queue (offline) the error is raised.
        """
        to_abort, returned = [], []
        now = time.monotonic()
        for o in outputs:
            st = self.requests.get(o.request_id)
            if st is None:
                continue  # aborted meanwhile
            try:
                out, abort = self._process_one(st, o, now)
            except Exception as e:
                if st.queue is None:
                    raise
                self.requests.pop(o.request_id, None)
                st.queue.put_nowait(RequestError(
                    f"cannot process the engine's output: {type(e).__name__}: {e}"))
                to_abort.append(o.request_id)
                continue
            if abort:
                to_abort.append(o.request_id)
            if st.queue is None:
                returned.append(out)
            else:
                st.queue.put_nowait(out)
        return OutputProcessorOutput(returned, to_abort)

    def _process_one(self, st: RequestState, o: EngineCoreOutput,
                     now: float) -> tuple[RequestOutput, bool]:
        """One request's delta, and whether the engine must abort it (a stop string matched
        before the engine saw a stop). Forgets the request and records metrics when it ends."""
        if st.first_token_time is None and o.new_token_ids:
            st.first_token_time = now
        st.num_output_tokens += len(o.new_token_ids)
        st.num_cached_tokens = o.num_cached_tokens
        ids = list(o.new_token_ids)
        text_ids = ids
        if o.finish_reason == "stop" and ids:
            stoppers = self.eos_token_ids | set(st.sampling_params.stop_token_ids)
            if ids[-1] in stoppers:
                text_ids = ids[:-1]  # the EOS / stop token is not part of the text
        text = st.detokenizer.update(text_ids)
        finish_reason, stop_reason = o.finish_reason, o.stop_reason
        abort = False
        if st.detokenizer.stop_matched is not None:
            finish_reason, stop_reason = "stop", st.detokenizer.stop_matched
            abort = not o.finished
        elif finish_reason is not None:
            text += st.detokenizer.flush()
        finished = finish_reason is not None
        out = RequestOutput(
            st.request_id, st.prompt, st.prompt_token_ids,
            [CompletionOutput(0, text, ids, finish_reason, stop_reason)],
            num_cached_tokens=st.num_cached_tokens, finished=finished)
        if finished:
            del self.requests[o.request_id]
            if self.metrics is not None:
                self.metrics.record_finished(
                    finish_reason, len(st.prompt_token_ids), st.num_output_tokens,
                    (st.first_token_time or now) - st.arrival_time, now - st.arrival_time)
        return out, abort

    def propagate_error(self, request_ids, exc: BaseException) -> None:
        """Fail the given requests (all live ones if ``request_ids`` is None) with ``exc``."""
        ids = list(self.requests) if request_ids is None else request_ids
        for rid in ids:
            st = self.requests.pop(rid, None)
            if st is not None:
                st.queue.put_nowait(exc)
