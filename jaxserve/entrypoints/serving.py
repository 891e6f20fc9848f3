"""Handlers of POST /v1/completions, POST /v1/chat/completions (OpenAI format, SSE streaming)
and GET /v1/models.

Both generation endpoints parse and validate the body (pydantic, then SamplingParams), tokenize
(chat template for chat), check the length against max_model_len, then either collect the whole
output or stream Server-Sent Events: one ``data: {chunk}`` per text delta, an optional usage
chunk, then ``data: [DONE]``. A client that goes away mid-request (handler cancelled, or a failed
write) closes the generator, which aborts the request in the engine. Every body is one of
protocol.py's response models, built by the endpoint's ``_Bodies``.
"""

from __future__ import annotations

import abc
import contextlib
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
from jaxserve.entrypoints.responses import SSEStream, json_response
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve.api")

_SP_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids")


def _llm(request: web.Request) -> AsyncLLM:
    return request.app[LLM_KEY]


def _served_name(request: web.Request) -> str:
    return request.app[STATE_KEY]["served_model_name"] or _llm(request).model_name


def _require_ready(llm: AsyncLLM) -> None:
    if not llm.ready:
        if llm.errored:
            msg = "the engine is not running (it stopped unexpectedly)"
        elif llm.shutting_down:
            msg = "the server is shutting down"
        else:
            msg = "the engine is still starting; retry when GET /health answers 200"
        raise APIError(503, msg, code="engine_unavailable")


async def _parse(request: web.Request, model_cls):
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = model_cls.model_validate(body)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
        # Union members add their type names to the location; keep the field path only.
        field = str(err["loc"][0]) if err["loc"] else None
        msg = err["msg"]
        if err["type"] == "missing":
            msg = "field required"
        raise APIError(400, f"{loc or field}: {msg}", param=field) from None
    if req.model_extra:
        logger.warning("ignoring unknown fields in %s request: %s", request.path,
                       ", ".join(sorted(req.model_extra)))
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


def _check_prompt(llm: AsyncLLM, ids: list[int], max_tokens: int | None, field: str) -> None:
    try:
        llm.check_prompt(ids, max_tokens)
    except ValueError as e:
        raise APIError(400, str(e), param=field) from None


def _raise_for(e: Exception):
    if isinstance(e, EngineDeadError):
        raise APIError(503, str(e), code="engine_unavailable") from None
    if isinstance(e, RequestError):
        status = 400 if e.kind == "invalid_request" else 500
        raise APIError(status, str(e)) from None
    raise e


def _error_event(e: Exception) -> ErrorResponse:
    if isinstance(e, EngineDeadError):
        return error_body(str(e), "server_error", None, "engine_unavailable")
    if isinstance(e, RequestError) and e.kind == "invalid_request":
        return error_body(str(e), "invalid_request_error")
    return error_body(str(e), "server_error")


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
               *, stream: bool, include_usage: bool, return_token_ids: bool):
    """Shared body of both endpoints: generates, and answers with ``bodies``' response or
    chunks. ``return_token_ids`` adds ``prompt_token_ids`` and ``token_ids`` (generated ids,
    EOS / stop token included; deltas when streaming) to the choice, as vLLM does."""
    gen = llm.generate(ids, sp, bodies.request_id)
    prompt_token_ids = list(ids) if return_token_ids else None
    if not stream:
        text, out, out_ids = [], None, []
        try:
            async with contextlib.aclosing(gen):
                async for out in gen:
                    text.append(out.outputs[0].text)
                    out_ids += out.outputs[0].token_ids
        except (EngineDeadError, RequestError) as e:
            _raise_for(e)
        usage = _usage(len(ids), len(out_ids), out.num_cached_tokens)
        return json_response(bodies.response(
            "".join(text), usage, finish_reason=out.outputs[0].finish_reason,
            prompt_token_ids=prompt_token_ids, token_ids=out_ids if return_token_ids else None))

    sse = SSEStream(request)
    await sse.start()
    first = bodies.first_chunk()
    try:
        if first is not None:
            await sse.send(first)
        out, n_out = None, 0
        async with contextlib.aclosing(gen):
            try:
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
            except (EngineDeadError, RequestError) as e:
                await sse.send(_error_event(e))
                out = None
        if include_usage and out is not None:
            await sse.send(bodies.usage_chunk(_usage(len(ids), n_out, out.num_cached_tokens)))
        await sse.send("[DONE]")
    except ConnectionError as e:  # the client went away; gen is closed (aborted)
        logger.info("client disconnected from %s: %s", bodies.request_id, type(e).__name__)
    return sse.resp


async def create_completion(request: web.Request) -> web.StreamResponse:
    llm = _llm(request)
    _require_ready(llm)
    req: CompletionRequest = await _parse(request, CompletionRequest)
    model = _check_model(request, req.model)
    prompt = req.single_prompt()
    if isinstance(prompt, str):
        ids = llm.encode_prompt(prompt)
    else:
        ids = list(prompt)
    sp = _sampling_params(req, req.max_tokens)
    _check_prompt(llm, ids, sp.max_tokens, "prompt")
    bodies = _CompletionBodies(f"cmpl-{uuid.uuid4().hex}", model)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await _run(request, llm, ids, sp, bodies, stream=bool(req.stream),
                      include_usage=include_usage, return_token_ids=req.return_token_ids)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    llm = _llm(request)
    _require_ready(llm)
    req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
    model = _check_model(request, req.model)
    try:
        ids = llm.encode_chat(req.template_messages())
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    max_tokens = req.requested_max_tokens()
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    sp = _sampling_params(req, max_tokens)
    _check_prompt(llm, ids, sp.max_tokens, "messages" if max_tokens is None else field)
    if sp.max_tokens is None:
        sp.max_tokens = llm.max_model_len - len(ids)
    bodies = _ChatBodies(f"chatcmpl-{uuid.uuid4().hex}", model)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await _run(request, llm, ids, sp, bodies, stream=bool(req.stream),
                      include_usage=include_usage, return_token_ids=req.return_token_ids)


async def show_available_models(request: web.Request) -> web.Response:
    """GET /v1/models: the one model served."""
    llm = _llm(request)
    _require_ready(llm)
    card = ModelCard(id=_served_name(request), created=request.app[STATE_KEY]["created"],
                     root=llm.model_name, max_model_len=llm.max_model_len)
    return json_response(ModelList(data=[card]))
