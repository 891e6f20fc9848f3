"""How protocol.py's response bodies go on the wire: a JSON response, or Server-Sent Events.

A JSON response is ``json.dumps`` of ``model_dump()`` (aiohttp's ``json_response``): it escapes
non-ASCII text, and with it any lone surrogate an error message quotes from the client's request,
which ``model_dump_json`` refuses to encode. An SSE event goes out once per text delta, so it is
``model_dump_json()`` (compact UTF-8), a few times cheaper than ``json.dumps(model_dump())``.
"""

from __future__ import annotations

from aiohttp import web

from jaxserve.entrypoints.protocol import OpenAIBaseModel


def json_response(body: OpenAIBaseModel, status: int = 200) -> web.Response:
    return web.json_response(body.model_dump(), status=status)


class SSEStream:
    """A ``text/event-stream`` response: one ``data: ...`` event per ``send``.

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
        await self.resp.write(f"data: {data}\n\n".encode())
