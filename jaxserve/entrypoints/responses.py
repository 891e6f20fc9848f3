"""How the response bodies (protocol.py's, responses_protocol.py's) go on the wire: a JSON
response, or Server-Sent Events.

A JSON response is ``json.dumps`` of ``model_dump()`` (aiohttp's ``json_response``): it escapes
non-ASCII text, and with it any lone surrogate an error message quotes from the client's request,
which ``model_dump_json`` refuses to encode. An SSE event goes out once per text delta, so it is
``model_dump_json()`` (compact UTF-8), a few times cheaper than ``json.dumps(model_dump())``; a
Responses API event also names its type in an ``event:`` line, as OpenAI's do.
"""

from __future__ import annotations

from aiohttp import web

from jaxserve.entrypoints.protocol import OpenAIBaseModel
from jaxserve.entrypoints.responses_protocol import ResponseStreamEvent


def json_response(body: OpenAIBaseModel, status: int = 200) -> web.Response:
    return web.json_response(body.model_dump(), status=status)


class SSEStream:
    """A ``text/event-stream`` response: one ``data: ...`` event per ``send`` (after an
    ``event: {type}`` line for a ResponseStreamEvent).

    ``send`` raises ConnectionError once the client is gone.
    """

    def __init__(self, request: web.Request):
        self.request = request
        self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                "Cache-Control": "no-cache"})

    async def start(self) -> None:
        await self.resp.prepare(self.request)

    async def send(self, event: OpenAIBaseModel | str) -> None:
        """Sends a body, or a literal such as ``[DONE]``."""
        data = event if isinstance(event, str) else event.model_dump_json()
        name = f"event: {event.type}\n" if isinstance(event, ResponseStreamEvent) else ""
        await self.resp.write(f"{name}data: {data}\n\n".encode())
