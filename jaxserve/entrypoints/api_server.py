"""The aiohttp application: routes, API-key check, OpenAI error bodies.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET and DELETE
/v1/responses/{id}, POST /v1/responses/{id}/cancel, GET /v1/models, GET /v1/models/{model}, POST
/v1/load_lora_adapter and /v1/unload_lora_adapter (with runtime LoRA updating), POST /tokenize,
POST /detokenize (handled in the serving_*.py modules), GET /health, GET and POST /ping (vLLM's,
for SageMaker: /health's answer), GET /version, GET /metrics,
GET /metrics/summary (metrics_summary.py), and the playground's GET / and GET /static/{name}
(playground.py). Every error, including unknown routes and unexpected exceptions, is an OpenAI
error body ``{"error": {"message", "type", "param", "code"}}``; tracebacks go to the server log
only.

``/health``, ``/ping``, ``/version``, ``/metrics`` and ``/metrics/summary`` need no API key, as in vLLM:
Prometheus scrapers seldom send one, and the metrics hold counts, no request content
(docs/reliability.md: restrict them at a reverse proxy if that matters). Nor do the playground's
files, which hold no data. ``/tokenize`` and ``/detokenize`` need it (vLLM leaves them open).
"""

from __future__ import annotations

import hmac
import itertools
import logging
import time

from aiohttp import web

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.app_state import LLM_KEY, STATE_KEY
from jaxserve.entrypoints.cors import CorsOptions, enable_cors
from jaxserve.entrypoints.errors import APIError, error_response
from jaxserve.entrypoints.limits import ServerLimits
from jaxserve.entrypoints.metrics_summary import metrics_summary
from jaxserve.entrypoints.playground import index, static_file
from jaxserve.entrypoints.safe_log import clip
from jaxserve.entrypoints.serving_chat import create_chat_completion
from jaxserve.entrypoints.serving_completion import create_completion
from jaxserve.entrypoints.responses_store import ResponseStore
from jaxserve.entrypoints.serving_models import (load_lora_adapter, retrieve_model,
                                                 runtime_lora_updating_off,
                                                 show_available_models, unload_lora_adapter)
from jaxserve.entrypoints.serving_responses import (
    cancel_response, create_response, delete_response, retrieve_response)
from jaxserve.entrypoints.serving_tokenization import detokenize, tokenize
from jaxserve.entrypoints.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS
from jaxserve.metrics import CONTENT_TYPE
from jaxserve.reasoning import REASONING_PARSERS

logger = logging.getLogger("jaxserve.api")
# Paths the API key guards: the OpenAI API and the tokenizer endpoints (vLLM leaves the latter
# open; they use the server's one tokenizer thread, so here they need the key too).
_GUARDED = ("/v1", "/tokenize", "/detokenize")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("jaxserve")
    except Exception:  # noqa: BLE001
        return "unknown"


@web.middleware
async def _errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.status, e.reason or "error", "invalid_request_error")
    except Exception:  # noqa: BLE001 - never a traceback in a response
        logger.exception("unhandled error in %s %s", request.method, clip(request.path))
        return error_response(500, "internal server error", "server_error")


def _auth_middleware(api_key: str | None):
    @web.middleware
    async def check(request: web.Request, handler):
        # A CORS preflight (OPTIONS) carries no credentials: the browser sends them after.
        if api_key and request.path.startswith(_GUARDED) and request.method != "OPTIONS":
            # aiohttp decodes header bytes as UTF-8 with surrogateescape: encode them back the
            # same way, so any bytes a client sends compare (and never raise).
            got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            scheme, _, token = got.partition(b" ")
            want = api_key.encode("utf-8", "surrogateescape")
            # The scheme is case-insensitive (RFC 9110 section 11.1); the key is not.
            if not (hmac.compare_digest(token, want) and scheme.lower() == b"bearer"):
                raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                               code="invalid_api_key")
        return await handler(request)

    return check


async def _health(request: web.Request) -> web.Response:
    llm = request.app[LLM_KEY]
    if llm.ready:
        return web.json_response({"status": "ok"})
    status = "starting" if not (llm.errored or llm.shutting_down) else "unavailable"
    return error_response(503, f"the engine is {status}", "server_error", code="engine_unavailable")


async def _version_route(request: web.Request) -> web.Response:
    return web.json_response({"version": _version()})


async def _metrics(request: web.Request) -> web.Response:
    llm = request.app[LLM_KEY]
    if llm.metrics is None:
        return web.Response(body=b"", headers={"Content-Type": CONTENT_TYPE})
    return web.Response(body=llm.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def build_app(llm: AsyncLLM, *, served_model_name: str | None = None,
              api_key: str | None = None, limits: ServerLimits | None = None,
              tool_call_parser: str = DEFAULT_TOOL_PARSER, reasoning_parser: str | None = None,
              return_tokens_as_token_ids: bool = False, cors: CorsOptions | None = None,
              allow_runtime_lora_updating: bool = False) -> web.Application:
    """The aiohttp app serving ``llm``.

    Args:
      llm: an AsyncLLM (it may still be starting: endpoints answer 503 until it is ready).
      served_model_name: the name clients use in ``model``; None = the model's name
        (``AsyncLLM.model_name``: ``--model`` as given).
      api_key: if set, /v1/*, /tokenize and /detokenize require ``Authorization: Bearer
        <api_key>`` (else 401).
      limits: the server's bounds (ServerLimits' defaults if None).
      tool_call_parser: the format of the model's tool calls (a key of TOOL_PARSERS).
      reasoning_parser: how the model's reasoning is marked (a key of REASONING_PARSERS), or
        None for a model whose output is all content.
      return_tokens_as_token_ids: log-probability tokens as ``token_id:{id}`` by default.
      cors: who may call it from a browser page of another origin (CorsOptions' defaults,
        any origin, if None).
      allow_runtime_lora_updating: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter
        (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).
    """
    limits = limits or ServerLimits()
    app = web.Application(middlewares=[_errors_middleware, _auth_middleware(api_key)],
                          client_max_size=limits.max_body_bytes)
    app[LLM_KEY] = llm
    store = ResponseStore(limits.max_stored_responses) if limits.max_stored_responses else None
    app[STATE_KEY] = {"served_model_name": served_model_name, "created": int(time.time()),
                      "limits": limits, "in_flight": 0,
                      "tool_parser": TOOL_PARSERS[tool_call_parser],
                      "reasoning_parser": (None if reasoning_parser is None
                                           else REASONING_PARSERS[reasoning_parser]),
                      "return_tokens_as_token_ids": return_tokens_as_token_ids,
                      "responses_store": store, "lora_requests": {},
                      "lora_ids": itertools.count(1)}
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    app.router.add_get("/v1/models", show_available_models)
    app.router.add_get("/v1/models/{model}", retrieve_model)
    on = allow_runtime_lora_updating
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter if on
                        else runtime_lora_updating_off)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter if on
                        else runtime_lora_updating_off)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", _health)
    app.router.add_get("/ping", _health)
    app.router.add_post("/ping", _health)
    app.router.add_get("/version", _version_route)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/metrics/summary", metrics_summary)
    app.router.add_get("/", index)
    app.router.add_get("/static/{name}", static_file)
    enable_cors(app, cors or CorsOptions())
    return app
