"""The API server's bounds (docs/reliability.md): how much one client may ask of it.

``ServerLimits`` holds them (the flags of ``python -m jaxserve.serve`` of the same names);
``CappedSockSite`` is aiohttp's SockSite with a connection cap. What aiohttp bounds itself is set
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

logger = logging.getLogger("jaxserve.api")


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Attributes:
      max_waiting_requests: generation requests that may be in flight beyond the engine's
        ``max_num_seqs``; past that a request gets 503 with ``Retry-After`` at once.
      max_connections: open client connections; a connection beyond it is closed as soon as it
        is accepted.
      max_body_bytes: largest request body, bytes (413 beyond it). It also bounds the time one
        body holds the event loop: JSON parsing and pydantic validation keep the GIL, and an
        adversarial 2 MiB body (hundreds of thousands of tiny nested lists or unknown keys)
        costs about 0.2 s of it. 2 MiB holds a 131,072-token prompt as token ids (~0.9 MB).
      body_timeout_s: seconds a request body may take to arrive (408 after).
      keepalive_timeout_s: seconds a connection may stay open without a complete request.
      request_timeout_s: seconds a generation request may run, None for no limit (504, or an
        SSE error event once a stream has started).
      retry_after_s: the ``Retry-After`` of an overload 503, seconds.
      lingering_s: after an error answered before the whole body arrived (408, 413), seconds
        aiohttp goes on reading and dropping the body, so the client can read the answer
        before the connection closes (aiohttp's default, 10 s, holds a stalled connection 5
        times longer).
    """

    max_waiting_requests: int = 1024
    max_connections: int = 2048
    max_body_bytes: int = 2 * 2**20
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 30.0
    request_timeout_s: float | None = None
    retry_after_s: int = 1
    lingering_s: float = 2.0


class _Refused(asyncio.Protocol):
    """Stands in for the HTTP protocol of a connection past the cap: closes it at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class CappedSockSite(web.BaseSite):
    """aiohttp's ``SockSite`` (serves on an already bound socket) that accepts at most
    ``max_connections`` connections at a time; each one past that is closed when accepted, so a
    flood of idle connections cannot exhaust file descriptors or memory.

    Attributes:
      refused: connections closed because of the cap, since start.
    """

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, max_connections: int):
        super().__init__(runner)
        self._sock = sock
        self.max_connections = max_connections
        self.refused = 0
        host, port = sock.getsockname()[:2]
        self._name = f"http://{host}:{port}"

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        await super().start()
        server = self._runner.server

        def protocol():
            if len(server.connections) >= self.max_connections:
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:
                    logger.warning("connection limit (--max-connections %d) reached; closed %d "
                                   "connections so far", self.max_connections, self.refused)
                return _Refused()
            return server()

        self._server = await asyncio.get_running_loop().create_server(
            protocol, sock=self._sock, backlog=self._backlog)
