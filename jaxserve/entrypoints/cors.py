"""Cross-origin requests from browser apps served by another origin (CORS, the Fetch standard's
CORS protocol): vLLM's ``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers`` and
``--allow-credentials``, by default any origin, method and header without credentials, as
vLLM's. aiohttp-cors answers each route's preflight ``OPTIONS`` and adds the
``Access-Control-*`` headers to its responses, errors included (a browser app can read a 401's
body)."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp_cors
from aiohttp import web


def _any() -> list[str]:
    return ["*"]


@dataclass
class CorsOptions:
    """Attributes:
      allowed_origins: origins (``scheme://host[:port]``) whose pages may call the API; ``*``
        any.
      allowed_methods: HTTP methods a cross-origin request may use; ``*`` any.
      allowed_headers: request headers it may send; ``*`` any.
      allow_credentials: the browser may send cookies or HTTP authentication with it.

    An allowed origin is answered with itself in ``Access-Control-Allow-Origin``.
    """

    allowed_origins: list[str] = field(default_factory=_any)
    allowed_methods: list[str] = field(default_factory=_any)
    allowed_headers: list[str] = field(default_factory=_any)
    allow_credentials: bool = False


def _one_or_list(values: list[str]) -> str | list[str]:
    return "*" if "*" in values else values


def enable_cors(app: web.Application, options: CorsOptions) -> None:
    """Make every route of ``app`` answer cross-origin requests per ``options``; call it
    after the last route is added."""
    resource = aiohttp_cors.ResourceOptions(
        allow_credentials=options.allow_credentials, expose_headers="*",
        allow_headers=_one_or_list(options.allowed_headers),
        allow_methods=_one_or_list(options.allowed_methods))
    cors = aiohttp_cors.setup(app, defaults={o: resource for o in options.allowed_origins})
    for route in list(app.router.routes()):
        cors.add(route)

