"""OpenAI's Responses API: POST /v1/responses (whole, or streamed as OpenAI's events),
GET /v1/responses/{id}, DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel.

A request runs as the chat request it converts into (responses_protocol.py): the previous
response's conversation (``previous_response_id``, from the store), then its input, after its
instructions, through the chat path (serving_chat.chat_inputs: tool grammar, structured
outputs, chat template, admission, where a ``--reasoning-parser``'s reasoning ends) with the
400s naming the Responses API's fields; its reply (the reasoning a ``reasoning`` item) is shaped
by responses_bodies.py and, with ``store`` (the default) on a server that keeps
responses (``--max-stored-responses``, responses_store.py), kept before it is sent.

Errors (OpenAI's error body): an unknown ``previous_response_id`` is a 400 with code
``previous_response_not_found``; an unknown id on GET, DELETE or cancel is a 404. A stored
response was computed in the foreground, so cancelling it is a 400.
"""

from __future__ import annotations

import uuid

from aiohttp import web

from jaxserve.entrypoints.app_state import STATE_KEY
from jaxserve.entrypoints.errors import APIError
from jaxserve.entrypoints.protocol import ChatCompletionMessageParam
from jaxserve.entrypoints.responses import json_response
from jaxserve.entrypoints.responses_bodies import ResponsesBodies
from jaxserve.entrypoints.responses_protocol import (
    Response, ResponseDeleted, ResponsesRequest, check_call_outputs, output_messages)
from jaxserve.entrypoints.responses_store import ResponseStore, StoredResponse
from jaxserve.entrypoints.serving_chat import chat_inputs
from jaxserve.entrypoints.serving_engine import bad_request, lora_request_of, take_in
from jaxserve.entrypoints.serving_stream import run_request, submitting
from jaxserve.exceptions import ValidationError

# The chat request's fields -> the Responses API's, for the 400s of the chat path.
CHAT_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
              "max_tokens": "max_output_tokens", "response_format": "text"}


def _store(request: web.Request) -> ResponseStore | None:
    """The server's store; None when it keeps no responses (``--max-stored-responses 0``)."""
    return request.app[STATE_KEY]["responses_store"]


def _history(request: web.Request, req: ResponsesRequest) -> list[ChatCompletionMessageParam]:
    """The conversation ``previous_response_id`` names (empty without one).

    Raises:
      APIError: 400 ``previous_response_not_found`` when the store does not hold it.
    """
    if req.previous_response_id is None:
        return []
    store = _store(request)
    entry = None if store is None else store.get(req.previous_response_id)
    if entry is None:
        why = "" if store is not None else " (this server keeps no responses)"
        raise APIError(400, f"Previous response with id {req.previous_response_id!r} not "
                       f"found.{why}", param="previous_response_id",
                       code="previous_response_not_found")
    return entry.messages


async def create_response(request: web.Request) -> web.StreamResponse:
    llm, req, model, deadline = await take_in(request, ResponsesRequest)
    try:
        req.check()
        conversation = _history(request, req) + req.input_messages()
        check_call_outputs(conversation)
        chat = req.chat_request(conversation)
    except ValidationError as e:
        raise bad_request(e) from None
    store = _store(request) if req.store is not False else None

    def keep(response: Response) -> None:
        store.put(StoredResponse(response, conversation + output_messages(response.output)))

    async with chat_inputs(request, chat, CHAT_NAMES) as inputs:
        request_id = f"resp_{uuid.uuid4().hex}"
        with submitting(llm, [inputs.ids], inputs.sp, request_id, inputs.reasoning_end_id,
                        lora_request_of(request, model), req.cache_salt) as submitted:
            bodies = ResponsesBodies(request_id, model, req.echo(inputs.sp, store is not None),
                                     inputs.tool_parser, on_done=None if store is None else keep,
                                     reasoning_parser=inputs.reasoning_parser,
                                     in_reasoning=inputs.in_reasoning,
                                     tool_calls_only=inputs.tool_calls_only)
            return await run_request(request, llm, [inputs.ids], submitted, inputs.sp, bodies,
                                     stream=bool(req.stream), echo_texts=None,
                                     deadline=deadline)


def _stored(request: web.Request) -> StoredResponse:
    """The stored response the path names.

    Raises:
      APIError: 404 when the store does not hold it.
    """
    response_id, store = request.match_info["response_id"], _store(request)
    entry = None if store is None else store.get(response_id)
    if entry is None:
        why = "" if store is not None else " (this server keeps no responses)"
        raise APIError(404, f"Response with id {response_id!r} not found.{why}",
                       param="response_id")
    return entry


async def retrieve_response(request: web.Request) -> web.Response:
    if request.query.get("stream", "false").lower() != "false":
        raise APIError(400, "stream: a stored response is returned whole (it is complete)",
                       param="stream")
    return json_response(_stored(request).response)


async def delete_response(request: web.Request) -> web.Response:
    response_id = _stored(request).response.id
    _store(request).delete(response_id)
    return json_response(ResponseDeleted(id=response_id))


async def cancel_response(request: web.Request) -> web.Response:
    _stored(request)
    raise APIError(400, "Cannot cancel a synchronous response: only background responses can "
                   "be cancelled, and this server runs none.")
