"""The API server's bounds (docs/reliability.md): how much one client may ask of it.

``ServerLimits`` holds them (the flags of ``python -m jaxserve.serve`` of the same names);
``CappedSockSite`` is aiohttp's SockSite with a connection cap, past which a connection's
request is answered 503 with ``Retry-After`` (then the connection closes) instead of served. What aiohttp bounds itself is set
from here too: the body size (``client_max_size``: 413 beyond it) and the time a connection may
sit without sending a complete request (``keepalive_timeout``, which aiohttp arms when the
connection opens and re-arms after each response, so it also ends connections that never finish
their headers). aiohttp has no separate timeout for slow headers; a reverse proxy in front can
set one (nginx ``client_header_timeout``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket

from aiohttp import web

from jaxserve.entrypoints.errors import RETRY_AFTER_S, error_response
from jaxserve.entrypoints.http_errors import HTTPHandler

logger = logging.getLogger("jaxserve.api")
# Connections the kernel queues before they are accepted (aiohttp's default, 128, drops the
# SYNs of a burst beyond it for the client to resend after a second or more; the kernel caps
# it at net.core.somaxconn).
LISTEN_BACKLOG = 4096


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Attributes:
      max_waiting_requests: sequences (prompts x ``n`` of each generation request) that may
        be in flight beyond the engine's ``max_num_seqs``; past that a request gets 503 with
        ``Retry-After`` at once.
      max_connections: open client connections served; a request on a connection beyond it
        gets 503 with ``Retry-After``, and the connection closes after that answer. (Only
        past the open-files limit is a connection closed unanswered: there is no descriptor
        left to answer it with.)
      max_body_bytes: largest request body, bytes (413 beyond it). It also bounds the time one
        body holds the event loop: JSON parsing and pydantic validation keep the GIL, and an
        adversarial 2 MiB body (hundreds of thousands of tiny nested lists or unknown keys)
        costs about 0.2 s of it. 2 MiB holds a 131,072-token prompt as token ids (~0.9 MB).
      body_timeout_s: seconds a request body may take to arrive (408 after).
      keepalive_timeout_s: seconds a connection may stay open without a complete request.
      request_timeout_s: seconds a generation request may run, None for no limit (504, or an
        SSE error event once a stream has started).
      max_stored_responses: responses kept for GET /v1/responses/{id} and
        ``previous_response_id`` (responses_store.py: least recently used out first); 0 keeps
        none. Each holds its conversation's text, shared with the turns before it.
      retry_after_s: the ``Retry-After`` of an overload 503, seconds.
      lingering_s: after an error answered before the whole body arrived (408, 413), seconds
        aiohttp goes on reading and dropping the body, so the client can read the answer
        before the connection closes (aiohttp's default, 10 s, holds a stalled connection 5
        times longer).
    """

    # A benchmark-style burst (10,000 requests at once) queues rather than being refused, as
    # in vLLM, which bounds neither.
    max_waiting_requests: int = 10_000
    max_connections: int = 16_384
    max_body_bytes: int = 2 * 2**20
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 30.0
    request_timeout_s: float | None = None
    max_stored_responses: int = 1000
    retry_after_s: int = RETRY_AFTER_S
    lingering_s: float = 2.0


class _Refused(asyncio.Protocol):
    """Stands in for the HTTP protocol of a connection past the open-files bound: closes it."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


def _overloaded(retry_after_s: int):
    async def answer(request: web.BaseRequest) -> web.Response:
        return error_response(503, "the server has too many open connections; retry later",
                              code="overloaded", headers={"Retry-After": str(retry_after_s)},
                              close=True)

    return answer


class CappedSockSite(web.BaseSite):
    """aiohttp's ``SockSite`` (serves on an already bound socket) that serves at most
    ``max_connections`` connections at a time. A connection past that gets aiohttp's HTTP
    protocol all the same, with a handler that answers its request 503 with ``Retry-After``
    and closes it (so a client learns to come back, rather than seeing its connection reset),
    up to ``max_open`` connections in all (the open-files limit less what the process keeps
    for itself); one past that is closed when accepted. Each connection's protocol is an
    ``http_errors.HTTPHandler`` built with ``protocol_kwargs`` (aiohttp's RequestHandler
    arguments).

    Attributes:
      answered_503: connections answered 503 because of the cap, since start.
      refused: connections closed unanswered at ``max_open``, since start.
    """

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, max_connections: int,
                 max_open: int, retry_after_s: int, **protocol_kwargs):
        super().__init__(runner, backlog=LISTEN_BACKLOG)
        self._sock = sock
        self.max_open = max_open
        self.max_connections = min(max_connections, max_open)
        self._protocol_kwargs = protocol_kwargs
        self._overflow = web.Server(_overloaded(retry_after_s), **protocol_kwargs)
        self.answered_503 = 0
        self.refused = 0
        host, port = sock.getsockname()[:2]
        self._name = f"http://{host}:{port}"

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server, overflow = self._runner.server, self._overflow
        # Protocols made in this batch of accepts: a connection joins ``connections`` only in
        # connection_made, which runs after the whole batch (a burst is one batch).
        batch = {"served": 0, "overflow": 0}

        def new_batch():
            batch.update(served=0, overflow=0)

        def protocol():
            if not any(batch.values()):
                loop.call_soon(new_batch)
            served = len(server.connections) + batch["served"]
            if served < self.max_connections:
                batch["served"] += 1
                return HTTPHandler(server, loop=loop, **self._protocol_kwargs)
            if served + len(overflow.connections) + batch["overflow"] < self.max_open:
                batch["overflow"] += 1
                self.answered_503 += 1
                if self.answered_503 == 1 or self.answered_503 % 1000 == 0:
                    logger.warning("connection limit (--max-connections %d) reached; answered "
                                   "%d connections 503 so far", self.max_connections,
                                   self.answered_503)
                return HTTPHandler(overflow, loop=loop, **self._protocol_kwargs)
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                logger.warning("open-files limit reached (%d connections); closed %d "
                               "connections unanswered so far", self.max_open, self.refused)
            return _Refused()

        self._server = await loop.create_server(protocol, sock=self._sock, backlog=self._backlog)

    async def stop(self) -> None:
        await super().stop()
        await self._overflow.shutdown(0)
