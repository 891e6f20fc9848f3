"""GET / and GET /static/{name}: the web playground and dashboard (docs/architecture.md, "The
playground"), static files shipped in the package's ``static/`` folder.

A file is read when it is asked for, never at start-up, so the page costs the server's start
nothing. The files hold no data (the page gets everything through the API, with the user's key),
so they need no API key, like /health. The page's Content-Security-Policy lets it load and fetch
from this server only: it carries its scripts and styles and reaches no other host.
"""

from __future__ import annotations

import pathlib
import re

from aiohttp import web

from jaxserve.entrypoints.errors import APIError

STATIC_DIR = pathlib.Path(__file__).with_name("static")
# A plain file name of the folder: no path separator, no "..", so nothing outside it is served.
_NAME = re.compile(r"[a-z_]+\.(?:js|css|svg)")
_HEADERS = {"Content-Security-Policy": "default-src 'self'",
            # Revalidate each time (a 304 when unchanged): a server upgraded in place never
            # runs an old script against a new page.
            "Cache-Control": "no-cache"}


def _file(path: pathlib.Path) -> web.FileResponse:
    return web.FileResponse(path, headers=_HEADERS)


async def index(request: web.Request) -> web.FileResponse:
    """GET /: the page."""
    return _file(STATIC_DIR / "index.html")


async def static_file(request: web.Request) -> web.FileResponse:
    """GET /static/{name}: one of the page's scripts, its style sheet or its icon; 404 for anything
    else."""
    name = request.match_info["name"]
    path = STATIC_DIR / name
    if not _NAME.fullmatch(name) or not path.is_file():
        raise APIError(404, f"no static file {name!r}")
    return _file(path)
