"""scripts/bench_serving.py against a minimal OpenAI-compatible stub (aiohttp, in a thread): a
server without /metrics and without `max_model_len` in /v1/models, one token per chunk, and
every third request failing with an error event in its stream. The script must finish, count
the failures, and say "n/a" for the server's side."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading

import pytest
from aiohttp import web

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "bench_serving.py")
FAIL_EVERY = 3


def stub_app() -> web.Application:
    """/v1/models and streaming /v1/completions: `max_tokens` chunks of one token each, the
    usage chunk, [DONE]; every FAIL_EVERY-th request gets an error event after one token."""
    served = 0

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    async def completions(request):
        nonlocal served
        served += 1
        fail = served % FAIL_EVERY == 0  # decided now: other requests move `served` meanwhile
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(data):
            await resp.write(f"data: {data}\n\n".encode())

        for i in range(body["max_tokens"]):
            await send(json.dumps({"choices": [{"index": 0, "text": "x"}]}))
            if fail:
                await send(json.dumps({"error": {"message": "stub failure"}}))
                return resp
            await asyncio.sleep(0.001)
        await send(json.dumps({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}))
        await send("[DONE]")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


@pytest.fixture
def stub_url():
    """The stub on 127.0.0.1:<free port>, served from a thread's event loop."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(stub_app())
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_any_openai_server_without_metrics(stub_url, tmp_path):
    n, output_len = 6, 5
    failed = n // FAIL_EVERY
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--base-url", stub_url, "--num-prompts", str(n),
         "--num-warmup", "0", "--input-len", "8", "--output-len", str(output_len),
         "--request-rate", "200", "--result-dir", str(tmp_path), "--result-name", "stub"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO,
        timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"| output tokens | {output_len * (n - failed)} | n/a |" in proc.stdout
    result = json.loads((tmp_path / "stub.json").read_text())
    assert result["settings"]["model"] == "stub"
    assert result["settings"]["max_model_len"] == 2048  # the default when the server says nothing
    assert result["completed"] == n - failed and result["failed"] == failed
    assert result["first_error"] == "stream error: stub failure"
    assert result["total_output_tokens"] == output_len * (n - failed)
    assert result["server_generation_tokens"] is None
    assert result["server_peak_running_waiting"] is None
    # One token per chunk: output_len - 1 gaps per successful request, none kept for a failure.
    gaps = sorted(len(x) for x in result["itls_s"])
    assert gaps == [0] * failed + [output_len - 1] * (n - failed)
    assert (tmp_path / "stub.png").read_bytes().startswith(b"\x89PNG")
