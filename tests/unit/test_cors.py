"""CORS (cors.py) through the real aiohttp app with test_openai_serving.py's FakeLLM: by default
any origin's preflight is answered, without the API key, and the answers carry
``Access-Control-Allow-Origin`` (a 401's too, so a browser app can read why); with
``--allowed-origins`` an origin not listed gets no CORS headers; the flags parse vLLM's JSON
lists and name themselves when one does not."""

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_openai_serving import FakeLLM

from jaxserve.entrypoints.api_server import build_app
from jaxserve.entrypoints.cors import CorsOptions
from jaxserve.serve import UsageError, build_parser

APP = "https://app.example"
PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
BODY = json.dumps({"prompt": "hi"})


def _requests(cors, requests, api_key="k"):
    """(status, Access-Control-Allow-Origin) of each (method, path, headers) in turn."""

    async def go():
        out = []
        app = build_app(FakeLLM(), api_key=api_key, cors=cors)
        async with TestClient(TestServer(app)) as client:
            for method, path, headers in requests:
                resp = await client.request(method, path, headers=headers,
                                            data=BODY if method == "POST" else None)
                await resp.read()
                out.append((resp.status, resp.headers.get("Access-Control-Allow-Origin")))
        return out

    return asyncio.run(go())


def test_any_origin_by_default_preflight_needs_no_key():
    origin = {"Origin": APP}
    assert _requests(None, [
        ("OPTIONS", "/v1/completions", {**origin, **PREFLIGHT}),
        ("POST", "/v1/completions", {**origin, "Authorization": "Bearer k"}),
        ("POST", "/v1/completions", origin),  # no key: 401, readable by the page
        ("GET", "/health", origin),
    ]) == [(200, APP), (200, APP), (401, APP), (200, APP)]


def test_listed_origins_only():
    cors = CorsOptions(allowed_origins=[APP])
    other = {"Origin": "https://other.example"}
    assert _requests(cors, [
        ("OPTIONS", "/v1/completions", {"Origin": APP, **PREFLIGHT}),
        ("OPTIONS", "/v1/completions", {**other, **PREFLIGHT}),
        ("POST", "/v1/completions", {**other, "Authorization": "Bearer k"}),
    ]) == [(200, APP), (403, None), (200, None)]


def test_flags():
    args = build_parser().parse_args(["--allowed-origins", f'["{APP}"]', "--allow-credentials"])
    assert (args.allowed_origins, args.allowed_methods, args.allow_credentials) == (
        [APP], ["*"], True)
    for bad in ("*", '"*"', "[1]"):
        with pytest.raises(UsageError, match="--allowed-origins.*JSON list of strings"):
            build_parser().parse_args(["--allowed-origins", bad])
