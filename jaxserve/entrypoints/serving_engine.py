"""What every handler does with a request before its own work (vLLM's serving_engine.py):
readiness (503 while the engine is starting, restarting or gone), the body read within
``--body-timeout`` (408) and the size limit (413), parsed (JSON, then the endpoint's pydantic
model: a 400 naming the field), the model name checked (404), admission (503 with
``Retry-After`` past ``--max-num-seqs`` + ``--max-waiting-requests`` sequences in flight), and
a ValidationError turned into the 400 that names its field.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from typing import Any

import msgspec
import pydantic
from aiohttp import web

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.app_state import LLM_KEY, STATE_KEY
from jaxserve.entrypoints.errors import APIError
from jaxserve.entrypoints.limits import ServerLimits
from jaxserve.entrypoints.protocol import field_error
from jaxserve.entrypoints.safe_log import clip
from jaxserve.exceptions import ValidationError
from jaxserve.lora.request import LoRARequest

logger = logging.getLogger("jaxserve.api")
_MAX_LOGGED_FIELDS = 10  # unknown field names quoted in one warning
_MAX_LISTED_MODELS = 20  # served names a 404 for an unknown model lists


def llm_of(request: web.Request) -> AsyncLLM:
    return request.app[LLM_KEY]


def served_name(request: web.Request) -> str:
    return request.app[STATE_KEY]["served_model_name"] or llm_of(request).model_name


def require_ready(llm: AsyncLLM) -> None:
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


def limits_of(request: web.Request) -> ServerLimits:
    return request.app[STATE_KEY]["limits"]


def in_flight_cap(request: web.Request) -> int:
    """The most sequences (engine requests) in flight at once: what the engine runs
    (``--max-num-seqs``) and what may wait (``--max-waiting-requests``)."""
    return llm_of(request).config.max_num_seqs + limits_of(request).max_waiting_requests


@contextlib.contextmanager
def admitted(request: web.Request, sequences: int):
    """Counts a generation request's ``sequences`` (engine requests: prompts x ``n``) in
    flight for as long as the block runs. Entered once the body is read and validated, so a
    body still arriving takes no place.

    Raises:
      APIError: 503 with Retry-After when admitting them would put more than ``max_num_seqs
        + max_waiting_requests`` sequences in flight.
    """
    state, llm, limits = request.app[STATE_KEY], llm_of(request), limits_of(request)
    if state["in_flight"] + sequences > in_flight_cap(request):
        llm.metrics.record_rejected("overloaded")
        raise APIError(503, f"the server is overloaded ({state['in_flight']} sequences in "
                       "flight); retry later", code="overloaded",
                       headers={"Retry-After": str(limits.retry_after_s)})
    state["in_flight"] += sequences
    try:
        yield
    finally:
        state["in_flight"] -= sequences


async def _read_body(request: web.Request) -> bytes:
    """The whole body, within the size limit (413) and the body timeout (408). Either error
    closes the connection: the rest of the body is not read."""
    limits = limits_of(request)
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


_json_decoder = msgspec.json.Decoder()


def _loads(body: bytes):
    """JSON text (RFC 8259: UTF-8, whatever the Content-Type's charset says) -> Python value.
    Nesting is bounded by Python's recursion limit (about 1,000 levels).

    msgspec parses it, 4x faster than ``json`` (a 1,000-token-id prompt: 28 against 108 us on
    a CPU core): the value is the same. A body msgspec refuses is parsed again with ``json``,
    whose error the 400 quotes, and which takes what msgspec does not: a lone surrogate escape
    (protocol.py's check then names the field) and numbers too large for a float (inf, which
    the validation refuses)."""
    try:
        return _json_decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):  # (ValidationError is a DecodeError)
        pass
    try:
        return json.loads(body.decode("utf-8"), parse_constant=_no_constants)
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8: {e.reason} at byte "
                       f"{e.start}") from None
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: nested too deeply") from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


async def parse_request(request: web.Request, model_cls):
    body = _loads(await _read_body(request))
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = model_cls.model_validate(body)
    except pydantic.ValidationError as e:
        err = field_error(e)
        raise APIError(400, str(err), param=err.parameter) from None
    so = getattr(req, "structured_outputs", None)
    unknown = [*(req.model_extra or ()),
               *(f"structured_outputs.{k}" for k in (so.model_extra if so else None) or ())]
    if unknown:
        names = itertools.islice(unknown, _MAX_LOGGED_FIELDS)  # in body order
        more = len(unknown) - _MAX_LOGGED_FIELDS
        logger.warning("ignoring unknown fields in %s request: %s%s", request.path,
                       ", ".join(clip(n) for n in names), f" and {more} more" if more > 0 else "")
    bad = req.unsupported_field() if hasattr(req, "unsupported_field") else None
    if bad:
        raise APIError(400, f"{bad}: this value is not supported by jaxserve yet", param=bad)
    return req


def bad_request(e: ValidationError, renames: dict[str, str] | None = None) -> APIError:
    """The 400 of ``e``, its ``param`` the field at fault in the request's name (``renames``:
    the internal name -> the request's, where they differ), as is the message's leading
    ``name:`` or ``name `` when it names that field."""
    param, message = e.parameter, str(e)
    name = (renames or {}).get(param, param)
    if param is not None and message.startswith((f"{param}:", f"{param} ")):
        message = name + message[len(param):]
    return APIError(400, message, param=name)


def check_model(request: web.Request, model: str | None) -> str:
    """The name a request's ``model`` is served under: the served model's (``model`` None or
    that name) or a LoRA adapter's (``lora_request_of``).

    Raises:
      APIError: 404 for a name this server does not serve: vLLM's message, then the names
        served (the model's, then its adapters', at most ``_MAX_LISTED_MODELS``).
    """
    name = served_name(request)
    loras = request.app[STATE_KEY]["lora_requests"]
    if model in loras:
        return model
    if model is not None and model != name:
        served = [name, *loras]
        listed = ", ".join(f"`{n}`" for n in served[:_MAX_LISTED_MODELS])
        more = len(served) - _MAX_LISTED_MODELS
        raise APIError(404, f"The model `{model}` does not exist. Served models: {listed}"
                       + (f" and {more} more (GET /v1/models lists them all)" if more > 0
                          else "") + ".", param="model", code="model_not_found")
    return name


def lora_request_of(request: web.Request, model: str) -> LoRARequest | None:
    """The LoRA adapter served as ``model`` (``check_model``'s name), or None for the model."""
    return request.app[STATE_KEY]["lora_requests"].get(model)


def max_choices(llm: AsyncLLM) -> int:
    """The most choices (``n``) of one prompt: what the engine runs at once (``max_num_seqs``),
    since a prompt's choices fork from its prefill to run together."""
    return llm.config.max_num_seqs


async def encode(coro, renames: dict[str, str] | None = None):
    """Awaits a tokenization; its ValidationError (too long, template error) is a 400
    (``renames``: as bad_request's)."""
    try:
        return await coro
    except ValidationError as e:
        raise bad_request(e, renames) from None


async def take_in(request: web.Request, model_cls) -> tuple[AsyncLLM, Any, str, float | None]:
    """What every generation endpoint starts with: (the AsyncLLM, the body parsed into
    ``model_cls``, the served model name, the request's deadline: ``deadline_of`` its arrival).

    Raises:
      APIError: 503 while the engine is not ready, the body's 400 / 408 / 413, 404 for another
        model.
    """
    llm = llm_of(request)
    require_ready(llm)
    deadline = deadline_of(request)
    req = await parse_request(request, model_cls)
    return llm, req, check_model(request, req.model), deadline


def deadline_of(request: web.Request) -> float | None:
    """When a request that arrives now must be done (event loop time), or None."""
    timeout = limits_of(request).request_timeout_s
    return None if timeout is None else asyncio.get_running_loop().time() + timeout
