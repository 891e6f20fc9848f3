"""Requests aiohttp cannot parse: a malformed request line or header, a line past 8,190 bytes,
bad chunked framing in the bytes that came with the headers (RFC 9112; bad framing that comes
later leaves the body unfinished: 408 after ``--body-timeout``).

aiohttp answers those itself, before any handler or middleware runs, with a text/plain 400 that
quotes the client's bytes, and logs an ERROR with a traceback whose message holds the same bytes
(a folded ``Authorization: Bearer\\r\\n KEY`` header puts the key in the log). ``HTTPHandler``,
the connection protocol the server makes, answers them with an OpenAI error body instead
(400, code ``bad_http_request``, then the connection closes), and ``describe`` names the kind of
error only: aiohttp's own words for it, never the bytes. ``ParseErrorLog`` writes one WARNING line
per client address per interval, counting the rest.
"""

from __future__ import annotations

import logging
import re
import time

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMethod, BadStatusLine, HttpProcessingError, InvalidHeader, InvalidURLError,
    LineTooLong, TransferEncodingError)

from jaxserve.entrypoints.errors import error_response

logger = logging.getLogger("jaxserve.api")

LOG_INTERVAL_S = 60.0  # one log line per client address per interval
MAX_TRACKED_ADDRESSES = 10_000  # addresses remembered at once; the table is cleared past it

# The kind of error, by exception class (most specific first): what the client and the log see.
_KINDS = ((BadHttpMethod, "bad method in the request line"),
          (BadStatusLine, "malformed request line"),
          (InvalidURLError, "malformed request target"),
          (LineTooLong, "a request line or header is too long"),
          (InvalidHeader, "malformed header"),
          (TransferEncodingError, "malformed chunked body"))
# A description as llhttp words it ("Invalid header token", "Unexpected whitespace after header
# value"): aiohttp puts it before a colon and the quoted bytes.
_DESCRIPTION = re.compile(r"[A-Za-z][A-Za-z -]{0,79}")


def describe(exc: HttpProcessingError) -> str:
    """What is wrong with the request, in words that quote none of its bytes."""
    if isinstance(exc, BadHttpMethod) and str(exc.message).startswith("Received HTTPS"):
        return "HTTPS traffic on an HTTP port"
    head = str(exc.message).split(":", 1)[0].strip()
    if _DESCRIPTION.fullmatch(head) and head != "Bad Request":
        return head[0].lower() + head[1:]
    return next((kind for cls, kind in _KINDS if isinstance(exc, cls)), "malformed request")


class ParseErrorLog:
    """Logs a malformed request once per client address per ``interval_s``; the next line for
    that address says how many came in between."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S):
        self.interval_s = interval_s
        self._seen: dict[str, tuple[float, int]] = {}  # address -> (last logged, since then)

    def record(self, remote: str | None, what: str) -> None:
        now, remote = time.monotonic(), remote or "unknown"
        last, skipped = self._seen.get(remote, (None, 0))
        if last is not None and now - last < self.interval_s:
            self._seen[remote] = (last, skipped + 1)
            return
        if len(self._seen) >= MAX_TRACKED_ADDRESSES:
            self._seen.clear()
        self._seen[remote] = (now, 0)
        more = f" ({skipped} more from this address since its last line)" if skipped else ""
        logger.warning("malformed HTTP request from %s: %s%s", remote, what, more)


class HTTPHandler(web.RequestHandler):
    """aiohttp's connection protocol, with requests it cannot parse answered as the module doc
    says. Constructed like ``web.RequestHandler`` (``HTTPHandler(server, loop=..., **kwargs)``)."""

    __slots__ = ()
    parse_errors = ParseErrorLog()  # one for the process: a client's connections share it

    def handle_error(self, request, status=500, exc=None, message=None):
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        what = describe(exc)
        self.parse_errors.record(request.remote, what)
        return error_response(400, f"the request is not valid HTTP/1.1: {what}",
                              code="bad_http_request", close=True)
