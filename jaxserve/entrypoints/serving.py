"""Handlers of POST /v1/completions, POST /v1/chat/completions (OpenAI format, SSE streaming)
and GET /v1/models.

Both generation endpoints admit the request (503 with ``Retry-After`` past
``--max-waiting-requests``), read the body within ``--body-timeout`` (408) and the size limit
(413), parse and validate it (JSON, pydantic, then SamplingParams), tokenize (chat template for
chat) off the event loop, check the length against max_model_len, then either collect the whole
output or stream Server-Sent Events: one ``data: {chunk}`` per text delta, an optional usage
chunk, then ``data: [DONE]``. Once a stream's headers are sent, any error (the engine's, a
``--request-timeout``, a bug) becomes one SSE error event followed by ``[DONE]``, never a second
HTTP response. A client that goes away mid-request (handler cancelled, or a failed write) closes
the generator, which aborts the request in the engine. Every body is one of protocol.py's
response models, built by the endpoint's ``_Bodies``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid

import pydantic
from aiohttp import web

from jaxserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestError
from jaxserve.entrypoints.app_state import LLM_KEY, STATE_KEY
from jaxserve.entrypoints.errors import APIError, error_body
from jaxserve.entrypoints.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse, ChatMessage,
    CompletionRequest, CompletionResponse, CompletionResponseChoice,
    CompletionResponseStreamChoice, CompletionStreamResponse, DeltaMessage, ErrorResponse,
    ModelCard, ModelList, OpenAIBaseModel, PromptTokenUsageInfo, UsageInfo)
from jaxserve.entrypoints.limits import ServerLimits
from jaxserve.entrypoints.responses import SSEStream, json_response
from jaxserve.entrypoints.safe_log import clip
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve.api")

# Longest first: an error about "stop_token_ids" also starts with "stop".
_SP_FIELDS = ("stop_token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
_MAX_LOGGED_FIELDS = 10  # unknown field names quoted in one warning
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}  # pydantic's union member tags


def _llm(request: web.Request) -> AsyncLLM:
    return request.app[LLM_KEY]


def _served_name(request: web.Request) -> str:
    return request.app[STATE_KEY]["served_model_name"] or _llm(request).model_name


def _require_ready(llm: AsyncLLM) -> None:
    if not llm.ready:
        if llm.shutting_down:
            msg = "the server is shutting down"
        elif llm.restarting:
            msg = "the engine process died and is restarting; retry when GET /health answers 200"
        elif llm.errored:
            msg = "the engine is not running (it stopped unexpectedly)"
        else:
            msg = "the engine is still starting; retry when GET /health answers 200"
        raise APIError(503, msg, code="engine_unavailable")


def _limits(request: web.Request) -> ServerLimits:
    return request.app[STATE_KEY]["limits"]


@contextlib.contextmanager
def _admitted(request: web.Request):
    """Counts a generation request in flight for as long as the block runs.

    Raises:
      APIError: 503 with Retry-After when ``max_num_seqs + max_waiting_requests`` are in flight.
    """
    state, llm, limits = request.app[STATE_KEY], _llm(request), _limits(request)
    cap = (llm.engine_config.get("max_num_seqs") or 0) + limits.max_waiting_requests
    if state["in_flight"] >= cap:
        llm.metrics.record_rejected("overloaded")
        raise APIError(503, f"the server is overloaded ({state['in_flight']} requests in "
                       "flight); retry later", code="overloaded",
                       headers={"Retry-After": str(limits.retry_after_s)})
    state["in_flight"] += 1
    try:
        yield
    finally:
        state["in_flight"] -= 1


async def _read_body(request: web.Request) -> bytes:
    """The whole body, within the size limit (413) and the body timeout (408). Either error
    closes the connection: the rest of the body is not read."""
    limits = _limits(request)
    if request.content_length is not None and request.content_length > limits.max_body_bytes:
        raise APIError(413, f"the request body ({request.content_length} bytes) exceeds the "
                       f"limit of {limits.max_body_bytes} bytes", close=True)
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"the request body exceeds the limit of {limits.max_body_bytes} "
                       "bytes", close=True) from None
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
                       code="request_timeout", close=True) from None


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _loads(body: bytes):
    """JSON text (RFC 8259: UTF-8, whatever the Content-Type's charset says) -> Python value.
    Nesting is bounded by Python's recursion limit (about 1,000 levels)."""
    try:
        return json.loads(body.decode("utf-8"), parse_constant=_no_constants)
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8: {e.reason} at byte "
                       f"{e.start}") from None
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: nested too deeply") from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


async def _parse(request: web.Request, model_cls):
    body = _loads(await _read_body(request))
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = model_cls.model_validate(body)
    except pydantic.ValidationError as e:
        # A union reports one error per member; the deepest is the one about the value
        # (``stop: ["\ud800"]``: the list item's encoding, not "stop is not a string").
        err = max(e.errors(include_url=False, include_input=False),
                  key=lambda err: len(err["loc"]))
        # Union members add their type names to the location ("str", "list[...]",
        # "function-after[...]"); keep the field names and item indices only.
        loc = ".".join(str(p) for p in err["loc"]
                       if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS))
        field = str(err["loc"][0]) if err["loc"] else None
        msg = err["msg"]
        if err["type"] == "missing":
            msg = "field required"
        raise APIError(400, f"{loc or field}: {msg}", param=field) from None
    if req.model_extra:
        names = itertools.islice(req.model_extra, _MAX_LOGGED_FIELDS)  # in body order
        more = len(req.model_extra) - _MAX_LOGGED_FIELDS
        logger.warning("ignoring unknown fields in %s request: %s%s", request.path,
                       ", ".join(clip(n) for n in names), f" and {more} more" if more > 0 else "")
    bad = req.unsupported_field()
    if bad:
        raise APIError(400, f"{bad}: this value is not supported by jaxserve yet", param=bad)
    return req


def _check_model(request: web.Request, model: str | None) -> str:
    name = _served_name(request)
    if model is not None and model != name:
        raise APIError(404, f"The model `{model}` does not exist. This server serves `{name}`.",
                       param="model", code="model_not_found")
    return name


def _sampling_params(req, max_tokens: int | None) -> SamplingParams:
    try:
        return req.sampling_params(max_tokens)
    except ValueError as e:
        msg = str(e)
        field = next((f for f in _SP_FIELDS if msg.startswith(f)), None)
        raise APIError(400, msg, param=field) from None


def _usage(num_prompt: int, num_output: int, num_cached: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_output,
                     total_tokens=num_prompt + num_output,
                     prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=num_cached))


def _check_request(llm: AsyncLLM, ids: list[int], sp: SamplingParams, field: str) -> None:
    """AsyncLLM.check_request; a 400 names ``stop_token_ids`` or else ``field`` (the prompt's
    field, or the max_tokens field that made the request too long)."""
    try:
        llm.check_request(ids, sp)
    except ValueError as e:
        msg = str(e)
        raise APIError(400, msg, param="stop_token_ids" if msg.startswith("stop_token_ids")
                       else field) from None


async def _encode(coro, field: str) -> list[int]:
    """Awaits a tokenization; its ValueError (too long, template error) is a 400 on ``field``."""
    try:
        return await coro
    except ValueError as e:
        raise APIError(400, str(e), param=field) from None


def _raise_for(e: Exception):
    if isinstance(e, EngineDeadError):
        raise APIError(503, str(e), code="engine_unavailable") from None
    if isinstance(e, RequestError):
        status = 400 if e.kind == "invalid_request" else 500
        raise APIError(status, str(e)) from None
    raise e


def _timeout_message(request: web.Request) -> str:
    return f"the request ran past --request-timeout ({_limits(request).request_timeout_s:g} s)"


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


class _Bodies(abc.ABC):
    """The OpenAI bodies of one request, whole and streamed. They share the request's id,
    creation time and model name; subclasses say how the endpoint's choice looks.

    ``fields`` are the choice's ``finish_reason``, ``prompt_token_ids`` and ``token_ids`` (the
    last two None, so left out, unless the request asked for ``return_token_ids``).
    """

    response_cls: type[OpenAIBaseModel]
    stream_cls: type[OpenAIBaseModel]

    def __init__(self, request_id: str, model: str):
        self.request_id = request_id
        self.created = int(time.time())
        self.model = model

    @abc.abstractmethod
    def _choice(self, text: str, **fields) -> OpenAIBaseModel:
        """A choice of the non-streamed body."""

    @abc.abstractmethod
    def _stream_choice(self, text: str, **fields) -> OpenAIBaseModel:
        """A choice of a streamed chunk."""

    def _body(self, cls, choices: list, usage: UsageInfo | None = None) -> OpenAIBaseModel:
        return cls(id=self.request_id, created=self.created, model=self.model, choices=choices,
                   usage=usage)

    def response(self, text: str, usage: UsageInfo, **fields) -> OpenAIBaseModel:
        """The non-streamed body: the whole text."""
        return self._body(self.response_cls, [self._choice(text, **fields)], usage)

    def first_chunk(self) -> OpenAIBaseModel | None:
        """The chunk that opens the stream, before any text; None for none."""
        return None

    def chunk(self, text: str, **fields) -> OpenAIBaseModel:
        """A streamed chunk: the text (and token ids) new since the last one."""
        return self._body(self.stream_cls, [self._stream_choice(text, **fields)])

    def usage_chunk(self, usage: UsageInfo) -> OpenAIBaseModel:
        """The chunk with ``stream_options.include_usage``: usage, no choices, last before
        ``[DONE]``."""
        return self._body(self.stream_cls, [], usage)


class _CompletionBodies(_Bodies):
    response_cls = CompletionResponse
    stream_cls = CompletionStreamResponse

    def _choice(self, text: str, **fields) -> CompletionResponseChoice:
        return CompletionResponseChoice(text=text, **fields)

    def _stream_choice(self, text: str, **fields) -> CompletionResponseStreamChoice:
        return CompletionResponseStreamChoice(text=text, **fields)


class _ChatBodies(_Bodies):
    response_cls = ChatCompletionResponse
    stream_cls = ChatCompletionStreamResponse

    def _choice(self, text: str, **fields) -> ChatCompletionResponseChoice:
        return ChatCompletionResponseChoice(message=ChatMessage(content=text), **fields)

    def _stream_choice(self, text: str, **fields) -> ChatCompletionResponseStreamChoice:
        # No new text (the finishing chunk, or token ids alone): an empty delta, {}.
        return ChatCompletionResponseStreamChoice(delta=DeltaMessage(content=text or None),
                                                  **fields)

    def first_chunk(self) -> ChatCompletionStreamResponse:
        """The role chunk OpenAI opens a chat stream with."""
        choice = ChatCompletionResponseStreamChoice(
            delta=DeltaMessage(role="assistant", content=""))
        return self._body(self.stream_cls, [choice])


async def _run(request, llm: AsyncLLM, ids: list[int], sp: SamplingParams, bodies: _Bodies,
               *, stream: bool, include_usage: bool, return_token_ids: bool,
               deadline: float | None):
    """Shared body of both endpoints: generates, and answers with ``bodies``' response or
    chunks. ``return_token_ids`` adds ``prompt_token_ids`` and ``token_ids`` (generated ids,
    EOS / stop token included; deltas when streaming) to the choice, as vLLM does. ``deadline``
    (event loop time, None for none) ends the request: 504, or an error event in a stream."""
    gen = llm.generate(ids, sp, bodies.request_id)
    prompt_token_ids = list(ids) if return_token_ids else None
    if not stream:
        text, out, out_ids = [], None, []
        try:
            async with contextlib.aclosing(gen), asyncio.timeout_at(deadline):
                async for out in gen:
                    text.append(out.outputs[0].text)
                    out_ids += out.outputs[0].token_ids
        except (EngineDeadError, RequestError) as e:
            _raise_for(e)
        except TimeoutError:
            llm.metrics.record_rejected("timeout")
            raise APIError(504, _timeout_message(request), code="request_timeout") from None
        usage = _usage(len(ids), len(out_ids), out.num_cached_tokens)
        return json_response(bodies.response(
            "".join(text), usage, finish_reason=out.outputs[0].finish_reason,
            prompt_token_ids=prompt_token_ids, token_ids=out_ids if return_token_ids else None))

    sse = SSEStream(request)
    await sse.start()
    try:
        try:
            async with contextlib.aclosing(gen), asyncio.timeout_at(deadline):
                first = bodies.first_chunk()
                if first is not None:
                    await sse.send(first)
                out, n_out = None, 0
                async for out in gen:
                    c = out.outputs[0]
                    n_out += len(c.token_ids)
                    if c.text or out.finished or (return_token_ids and c.token_ids):
                        # The prompt's ids ride along with the first generated ids.
                        first_ids = n_out == len(c.token_ids)
                        await sse.send(bodies.chunk(
                            c.text, finish_reason=c.finish_reason,
                            prompt_token_ids=prompt_token_ids if first_ids else None,
                            token_ids=list(c.token_ids) if return_token_ids else None))
            if include_usage and out is not None:
                await sse.send(bodies.usage_chunk(_usage(len(ids), n_out, out.num_cached_tokens)))
        except ConnectionError:
            raise
        except Exception as e:  # noqa: BLE001 - headers are out: the error goes in the stream
            if isinstance(e, TimeoutError):
                llm.metrics.record_rejected("timeout")
            await sse.send(_error_event(request, e))
        await sse.send("[DONE]")
    except ConnectionError as e:  # the client went away; gen is closed (aborted)
        logger.info("client disconnected from %s: %s", bodies.request_id, type(e).__name__)
    return sse.resp


def _deadline(request: web.Request) -> float | None:
    """When a request that arrives now must be done (event loop time), or None."""
    timeout = _limits(request).request_timeout_s
    return None if timeout is None else asyncio.get_running_loop().time() + timeout


async def create_completion(request: web.Request) -> web.StreamResponse:
    llm = _llm(request)
    _require_ready(llm)
    deadline = _deadline(request)
    with _admitted(request):
        req: CompletionRequest = await _parse(request, CompletionRequest)
        model = _check_model(request, req.model)
        sp = _sampling_params(req, req.max_tokens)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            ids = await _encode(llm.encode_prompt(prompt), "prompt")
        else:
            ids = list(prompt)
        _check_request(llm, ids, sp, "prompt")
        bodies = _CompletionBodies(f"cmpl-{uuid.uuid4().hex}", model)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _run(request, llm, ids, sp, bodies, stream=bool(req.stream),
                          include_usage=include_usage, return_token_ids=req.return_token_ids,
                          deadline=deadline)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    llm = _llm(request)
    _require_ready(llm)
    deadline = _deadline(request)
    with _admitted(request):
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        model = _check_model(request, req.model)
        max_tokens = req.requested_max_tokens()
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        sp = _sampling_params(req, max_tokens)
        ids = await _encode(llm.encode_chat(req.template_messages()), "messages")
        _check_request(llm, ids, sp, "messages" if max_tokens is None else field)
        if sp.max_tokens is None:  # OpenAI's and vLLM's meaning: up to the context
            sp.max_tokens = llm.max_model_len - len(ids)
        bodies = _ChatBodies(f"chatcmpl-{uuid.uuid4().hex}", model)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _run(request, llm, ids, sp, bodies, stream=bool(req.stream),
                          include_usage=include_usage, return_token_ids=req.return_token_ids,
                          deadline=deadline)


async def show_available_models(request: web.Request) -> web.Response:
    """GET /v1/models: the one model served."""
    llm = _llm(request)
    _require_ready(llm)
    card = ModelCard(id=_served_name(request), created=request.app[STATE_KEY]["created"],
                     root=llm.model_name, max_model_len=llm.max_model_len)
    return json_response(ModelList(data=[card]))
