"""Running a generation request and answering it: each prompt's engine request submitted,
their outputs fanned in, turned into per-choice updates, then either the whole response or a
stream of Server-Sent Events: the endpoint's opening events, its events for each choice update
(text, or with logprobs or ``return_token_ids`` any new token; with ``continuous_usage_stats``
each with its choice's usage so far), then its closing events (for completions and chat: an
optional usage chunk, then ``data: [DONE]``).

Once a stream's headers are sent, any error (the engine's, a ``--request-timeout``, a bug)
becomes the endpoint's error events (completions and chat: one SSE error event followed by
``[DONE]``), never a second HTTP response. A client that goes away mid-request (handler
cancelled, or a failed write) has its requests aborted in the engine. Every body is one of the
response models, built by the endpoint's ``Bodies`` (bodies.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from jaxserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestError
from jaxserve.entrypoints.bodies import Bodies, ChoiceBodies, ChoiceState, token_id_piece, usage
from jaxserve.entrypoints.errors import APIError, error_body
from jaxserve.entrypoints.protocol import ErrorResponse
from jaxserve.entrypoints.responses import SSEStream, json_response
from jaxserve.entrypoints.serving_engine import limits_of
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve.api")


def _raise_for(e: Exception):
    if isinstance(e, EngineDeadError):
        raise APIError(503, str(e), code="engine_unavailable") from None
    if isinstance(e, RequestError):
        status = 400 if e.kind == "invalid_request" else 500
        raise APIError(status, str(e)) from None
    raise e


def _timeout_message(request: web.Request) -> str:
    return f"the request ran past --request-timeout ({limits_of(request).request_timeout_s:g} s)"


def _error_event(request: web.Request, e: Exception) -> ErrorResponse:
    """The SSE error event of a stream that failed after its headers were sent."""
    if isinstance(e, EngineDeadError):
        return error_body(str(e), "server_error", None, "engine_unavailable")
    if isinstance(e, RequestError):
        kind = "invalid_request_error" if e.kind == "invalid_request" else "server_error"
        return error_body(str(e), kind)
    if isinstance(e, TimeoutError):
        return error_body(_timeout_message(request), "server_error", None, "request_timeout")
    logger.error("error in the stream of %s %s", request.method, request.path, exc_info=e)
    return error_body("internal server error", "server_error")


Submitted = list[tuple[str, asyncio.Queue]]  # (engine request id, its AsyncLLM.add_request queue)


@contextlib.contextmanager
def submitting(llm: AsyncLLM, prompts: list[list[int]], sp: SamplingParams, request_id: str,
               reasoning_end_token_id: int | None = None,
               lora_request: LoRARequest | None = None, cache_salt: str | None = None):
    """Submits each prompt's engine request (``request_id``, or ``{request_id}-{i}`` for
    prompt i of several) and yields them as ``Submitted``; the requests still running are
    aborted when the block ends. Requests go to the engine before the response is set up, so
    that the engine starts on them meanwhile. ``reasoning_end_token_id``, ``lora_request``,
    ``cache_salt``: AsyncLLM.add_request's.

    Raises:
      APIError: 503 when the engine is gone.
    """
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    submitted: Submitted = []
    try:
        try:
            for rid, prompt in zip(ids, prompts):
                submitted.append((rid, llm.add_request(prompt, sp, rid, reasoning_end_token_id,
                                                       lora_request, cache_salt)))
        except EngineDeadError as e:
            _raise_for(e)
        yield submitted
    finally:
        for rid, _ in submitted:
            llm.abort(rid)


async def _outputs(llm: AsyncLLM,
                   submitted: Submitted) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, RequestOutput delta) of each submitted request, as they come.
    Closing this iterator aborts the requests still running."""
    if len(submitted) == 1:
        async with contextlib.aclosing(llm.outputs(*submitted[0])) as gen:
            async for out in gen:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, rid: str, outputs: asyncio.Queue) -> None:
        try:
            async with contextlib.aclosing(llm.outputs(rid, outputs)) as gen:
                async for out in gen:
                    queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - the consumer raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, rid, q)) for i, (rid, q) in enumerate(submitted)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                left -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Progress:
    """Turns the deltas of a request's prompts into per-choice updates: the text (with the
    echoed prompt first, when asked), the token ids and the log-probability entries new since
    the choice's last update."""

    def __init__(self, prompts: list[list[int]], echo_texts: list[str] | None,
                 sp: SamplingParams):
        self.prompts = prompts
        self.echo_texts = echo_texts
        self.n = sp.n
        self.want_logprobs = sp.logprobs is not None
        self.choices = [ChoiceState(i, token_ids=[], entries=[] if self.want_logprobs else None)
                        for i in range(len(prompts) * sp.n)]
        self.num_cached = [0] * len(prompts)
        self.prompt_logprobs: list[list | None] = [None] * len(prompts)

    def updates(self, p: int, out: RequestOutput):
        """(choice, delta, new text, new entries or None) for each choice in ``out``."""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[p] = out.prompt_logprobs
        self.num_cached[p] = out.num_cached_tokens
        for c in out.outputs:
            ch = self.choices[p * self.n + c.index]
            text = c.text
            entries = list(zip(c.token_ids, c.logprobs or ())) if self.want_logprobs else None
            if not ch.started:
                ch.started = True
                if self.echo_texts is not None:
                    text = self.echo_texts[p] + text
                    if entries is not None:
                        entries = list(zip(self.prompts[p], self.prompt_logprobs[p]
                                           or [None] * len(self.prompts[p]))) + entries
            ch.token_ids += c.token_ids
            ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
            yield ch, c, text, entries

    def usage(self):
        return usage(sum(map(len, self.prompts)), sum(len(c.token_ids) for c in self.choices),
                     sum(self.num_cached))

    def choice_usage(self, ch: ChoiceState):
        """One choice's usage so far (continuous usage stats): its prompt, its tokens."""
        p = ch.index // self.n
        return usage(len(self.prompts[p]), len(ch.token_ids), self.num_cached[p])


async def run_request(request, llm: AsyncLLM, prompts: list[list[int]], submitted: Submitted,
                      sp: SamplingParams, bodies: Bodies, *, stream: bool,
                      echo_texts: list[str] | None, deadline: float | None,
                      outputs: AsyncIterator | None = None):
    """Shared body of the generation endpoints: reads every prompt's ``n`` choices from the
    ``submitted`` requests (or from ``outputs``, an iterator of (prompt index, RequestOutput)
    of its own: beam search), and answers with ``bodies``' response or events (Bodies says
    which, in what order). ``echo_texts``: each prompt's text, to start its choices with
    (completions' ``echo``). ``deadline`` (event loop time, None for none) ends the request:
    504, or the error events in a stream."""
    progress = _Progress(prompts, echo_texts, sp)
    gen = _outputs(llm, submitted) if outputs is None else outputs
    continuous = bodies.continuous_usage
    if not stream:
        try:
            async with contextlib.aclosing(gen), asyncio.timeout_at(deadline):
                async for p, out in gen:
                    for ch, _, text, entries in progress.updates(p, out):
                        ch.text += text
                        if entries is not None:
                            ch.entries += entries
        except (EngineDeadError, RequestError) as e:
            _raise_for(e)
        except TimeoutError:
            llm.metrics.record_rejected("timeout")
            raise APIError(504, _timeout_message(request), code="request_timeout") from None
        return json_response(bodies.response(progress.choices, prompts, sp.n, progress.usage(),
                                             progress.prompt_logprobs))

    sse = SSEStream(request)
    await sse.start()
    token_news = bodies.return_token_ids or progress.want_logprobs
    try:
        try:
            async with contextlib.aclosing(gen), asyncio.timeout_at(deadline):
                opening = usage(len(prompts[0]), 0, None) if continuous else None
                for first in bodies.first_chunks(len(progress.choices), prompts[0], opening):
                    await sse.send(first)
                async for p, out in gen:
                    for ch, c, text, entries in progress.updates(p, out):
                        if text or c.finished or (token_news and c.token_ids):
                            # The prompt's ids ride along with the choice's first token ids.
                            first_ids = len(ch.token_ids) == len(c.token_ids)
                            for chunk in bodies.chunks(
                                    ch, text, c, entries, prompts[p] if first_ids else None,
                                    progress.choice_usage(ch) if continuous else None):
                                await sse.send(chunk)
            for last in bodies.last_chunks(progress.usage()):
                await sse.send(last)
        except ConnectionError:
            raise
        except Exception as e:  # noqa: BLE001 - headers are out: the error goes in the stream
            if isinstance(e, TimeoutError):
                llm.metrics.record_rejected("timeout")
            for event in bodies.error_chunks(_error_event(request, e)):
                await sse.send(event)
    except ConnectionError as e:  # the client went away; gen is closed (aborted)
        logger.info("client disconnected from %s: %s", bodies.request_id, type(e).__name__)
    return sse.resp


def make_bodies(cls, request_id: str, model: str, llm: AsyncLLM, sp: SamplingParams, req,
                as_token_ids: bool, **kwargs) -> ChoiceBodies:
    """The ChoiceBodies ``cls`` of a completions or chat request ``req``; ``as_token_ids``: the
    server's --return-tokens-as-token-ids, which the request's ``return_tokens_as_token_ids``
    overrides."""
    if req.return_tokens_as_token_ids is not None:
        as_token_ids = req.return_tokens_as_token_ids
    piece = None
    if sp.logprobs is not None:
        piece = token_id_piece if as_token_ids else llm.output_processor.pieces.piece
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
    return cls(request_id, model, num_logprobs=sp.logprobs, piece=piece,
               return_token_ids=req.return_token_ids,
               prompt_logprobs=sp.prompt_logprobs is not None and not req.stream,
               include_usage=include_usage, continuous_usage=continuous, **kwargs)
