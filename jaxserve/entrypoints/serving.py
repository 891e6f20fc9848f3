"""Handlers of POST /v1/completions and POST /v1/chat/completions (OpenAI format, SSE streaming).

Both parse and validate the body (pydantic, then SamplingParams), tokenize (chat template for
chat), check the length against max_model_len, then either collect the whole output or stream
Server-Sent Events: one ``data: {chunk}`` per text delta, an optional usage chunk, then
``data: [DONE]``. A client that goes away mid-request (handler cancelled, or a failed write)
closes the generator, which aborts the request in the engine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid

import pydantic
from aiohttp import web

from jaxserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestError
from jaxserve.entrypoints.errors import APIError, error_body
from jaxserve.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve.api")

_SP_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids")


def _llm(request: web.Request) -> AsyncLLM:
    from jaxserve.entrypoints.api_server import LLM_KEY

    return request.app[LLM_KEY]


def served_name(request: web.Request) -> str:
    from jaxserve.entrypoints.api_server import STATE_KEY

    return request.app[STATE_KEY]["served_model_name"] or _llm(request).model_name


def require_ready(llm: AsyncLLM) -> None:
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
    name = served_name(request)
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


def _usage(num_prompt: int, num_output: int, num_cached: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output,
            "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": num_cached}}


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


def _error_event(e: Exception) -> dict:
    if isinstance(e, EngineDeadError):
        return error_body(str(e), "server_error", None, "engine_unavailable")
    if isinstance(e, RequestError) and e.kind == "invalid_request":
        return error_body(str(e), "invalid_request_error")
    return error_body(str(e), "server_error")


class _Stream:
    """An SSE response; ``send`` returns False once the client is gone."""

    def __init__(self, request: web.Request):
        self.request = request
        self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                "Cache-Control": "no-cache"})

    async def start(self) -> None:
        await self.resp.prepare(self.request)

    async def send(self, obj) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
        await self.resp.write(f"data: {data}\n\n".encode())


async def _run(request, llm: AsyncLLM, ids: list[int], sp: SamplingParams, request_id: str,
               *, stream: bool, include_usage: bool, make_chunk, make_final,
               return_token_ids: bool = False):
    """Shared body of both endpoints. ``make_chunk(text, finish_reason)`` -> chunk dict;
    ``make_final(text, finish_reason, usage)`` -> the non-streaming response dict.
    ``return_token_ids`` adds ``prompt_token_ids`` and ``token_ids`` (generated ids, EOS / stop
    token included; deltas when streaming) to the choice, as vLLM does."""
    gen = llm.generate(ids, sp, request_id)
    if not stream:
        text, out, out_ids = [], None, []
        try:
            async with contextlib.aclosing(gen):
                async for out in gen:
                    text.append(out.outputs[0].text)
                    out_ids += out.outputs[0].token_ids
        except (EngineDeadError, RequestError) as e:
            _raise_for(e)
        c = out.outputs[0]
        usage = _usage(len(ids), len(out_ids), out.num_cached_tokens)
        body = make_final("".join(text), c.finish_reason, usage)
        if return_token_ids:
            body["choices"][0].update(prompt_token_ids=list(ids), token_ids=out_ids)
        return web.json_response(body)

    sse = _Stream(request)
    await sse.start()
    first = make_chunk(None, None)  # e.g. chat's role chunk; None for completions
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
                        chunk = make_chunk(c.text, c.finish_reason)
                        if return_token_ids:
                            chunk["choices"][0]["token_ids"] = list(c.token_ids)
                            if n_out == len(c.token_ids):
                                chunk["choices"][0]["prompt_token_ids"] = list(ids)
                        await sse.send(chunk)
            except (EngineDeadError, RequestError) as e:
                await sse.send(_error_event(e))
                out = None
        if include_usage and out is not None:
            chunk = make_chunk("", None)
            chunk["choices"] = []
            chunk["usage"] = _usage(len(ids), n_out, out.num_cached_tokens)
            await sse.send(chunk)
        await sse.send("[DONE]")
    except ConnectionError as e:  # the client went away; gen is closed (aborted)
        logger.info("client disconnected from %s: %s", request_id, type(e).__name__)
    return sse.resp


async def create_completion(request: web.Request) -> web.StreamResponse:
    llm = _llm(request)
    require_ready(llm)
    req: CompletionRequest = await _parse(request, CompletionRequest)
    model = _check_model(request, req.model)
    prompt = req.single_prompt()
    if isinstance(prompt, str):
        ids = llm.encode_prompt(prompt)
    else:
        ids = list(prompt)
    sp = _sampling_params(req, req.max_tokens)
    _check_prompt(llm, ids, sp.max_tokens, "prompt")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())

    def chunk(text, finish_reason):
        if text is None:
            return None
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": finish_reason}]}

    def final(text, finish_reason, usage):
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": finish_reason}],
                "usage": usage}

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await _run(request, llm, ids, sp, request_id, stream=bool(req.stream),
                      include_usage=include_usage, make_chunk=chunk, make_final=final,
                      return_token_ids=req.return_token_ids)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    llm = _llm(request)
    require_ready(llm)
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
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())

    def chunk(text, finish_reason):
        delta = {"role": "assistant", "content": ""} if text is None else (
            {"content": text} if text else {})
        return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": finish_reason}]}

    def final(text, finish_reason, usage):
        return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": finish_reason}],
                "usage": usage}

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await _run(request, llm, ids, sp, request_id, stream=bool(req.stream),
                      include_usage=include_usage, make_chunk=chunk, make_final=final,
                      return_token_ids=req.return_token_ids)
