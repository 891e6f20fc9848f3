"""OpenAI error bodies: ``{"error": {"message", "type", "param", "code"}}`` (ErrorResponse)."""

from __future__ import annotations

from aiohttp import web

from jaxserve.entrypoints.protocol import ErrorInfo, ErrorResponse
from jaxserve.entrypoints.responses import json_response

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          408: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
          503: "server_error", 504: "server_error"}


# Seconds a 503 asks the client to wait (``Retry-After``, RFC 9110 section 10.2.3): every 503
# carries it, overloaded or engine not ready.
RETRY_AFTER_S = 1


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))


def error_response(status: int, message: str, type_: str | None = None,
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, close: bool = False) -> web.Response:
    """A JSON error response with the OpenAI body; ``close`` ends the connection after it (the
    rest of an unread body is not worth reading). A 503 has ``Retry-After`` (RETRY_AFTER_S
    unless ``headers`` give one)."""
    type_ = type_ or _TYPES.get(status, "invalid_request_error")
    resp = json_response(error_body(message, type_, param, code), status)
    resp.headers.update(headers or {})
    if status == 503:
        resp.headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    if close:
        resp.force_close()
    return resp


class APIError(Exception):
    """Raised by handlers; the error middleware turns it into an OpenAI error response.

    Attributes:
      status: HTTP status (400 bad request, 401 bad key, 404 unknown model, 408 body too slow,
        413 body too large, 503 engine gone or overloaded, 504 request timeout).
      message: human-readable, names the offending field where there is one.
      param: the offending request field, if any.
      code: a short machine-readable code, if any.
      headers: extra response headers (``Retry-After``).
      close: close the connection after the response.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None, close: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type_ = type_ or _TYPES.get(status, "invalid_request_error")
        self.headers = headers
        self.close = close

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.type_, self.param, self.code,
                              self.headers, self.close)
