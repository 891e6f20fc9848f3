"""Reproducers and limits against the real server with the stub engine (no JAX, starts
in seconds): bad values at the edge, streams that end cleanly, log lines a client cannot forge,
admission control, body / header / request timeouts, the connection cap. The reproducers that
need the real model (a bad top_k with streams in flight, a 50 MB prompt) and the short fuzz and
stress runs are in test_reliability_real.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import aiohttp
import openai
import pytest

from prometheus_client.parser import text_string_to_metric_families

from server_utils import REPO, Server, get
from stub_engine import STEP_CRASH_ID

API_KEY = "k-11"
MAX_NUM_SEQS, MAX_WAITING = 4, 2
MAX_IN_FLIGHT = MAX_NUM_SEQS + MAX_WAITING  # sequences admitted at once
MAX_CONNECTIONS = 24
FLAGS = ("--max-model-len", "512", "--api-key", API_KEY, "--max-num-seqs", str(MAX_NUM_SEQS),
         "--max-waiting-requests", str(MAX_WAITING),
         "--max-connections", str(MAX_CONNECTIONS), "--max-request-body-mib", "1",
         "--body-timeout", "1", "--keepalive-timeout", "2", "--request-timeout", "4")
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server():
    srv = Server(*FLAGS, module="stub_server", startup_timeout=120)
    yield srv
    srv.stop()


def _post(srv, body: bytes | dict, path="/v1/completions", headers=None):
    """(status, headers, body text) of one POST with the raw body."""

    async def go():
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with aiohttp.ClientSession() as s:
            async with s.post(srv.url + path, data=data, headers={
                    "Content-Type": "application/json", **AUTH, **(headers or {})}) as r:
                return r.status, r.headers, await r.text()

    return asyncio.run(go())


def _rejected(srv, reason: str) -> float:
    """jaxserve:request_rejected_total{reason=...}."""
    text = get(f"{srv.url}/metrics")[1]
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "jaxserve:request_rejected_total" and s.labels["reason"] == reason)


def _assert_400(status, text, param):
    assert status == 400, text
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


# Values past an engine array's range: a 400 naming the field, never a 500 or an accepted value.
@pytest.mark.parametrize("body,param", [
    (b'{"prompt": "hi", "top_k": 2147483648}', "top_k"),
    (b'{"prompt": "hi", "top_k": 18446744073709551616}', "top_k"),
    (b'{"prompt": "hi", "stop_token_ids": [18446744073709551616]}', "stop_token_ids"),
    (b'{"prompt": "hi", "stop_token_ids": [-9223372036854775809]}', "stop_token_ids"),
    (b'{"prompt": "hi", "stop_token_ids": [49152]}', "stop_token_ids"),  # == vocab_size
    (b'{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
    (b'{"prompt": "hi", "max_tokens": 4294967296}', "max_tokens"),
    (b'{"prompt": "hi", "stop": ["\\ud800"]}', "stop"),
    (b'{"prompt": "hi", "stop": "x", "stream": true, "user": "\\udfff"}', "user"),
    (b'{"prompt": "\\ud800"}', "prompt"),
    (b'{"prompt": ["\\ud800"]}', "prompt"),
    (b'{"prompt": "hi", "temperature": 1e308}', "temperature"),
    (b'{"prompt": "hi", "temperature": 1e400}', "temperature"),
    (b'{"prompt": "hi", "top_p": 1e-400}', "top_p"),
    (b'{"prompt": "hi", "stop": ["' + b"x" * 300 + b'"]}', "stop"),
])
def test_bad_values_are_400_naming_the_field(server, body, param):
    _assert_400(*_post(server, body)[::2], param)


def test_many_bad_items_are_a_quick_400(server):
    """Lists stop at their first bad item: 200,000 bad token ids (0.8 MB) would cost
    pydantic seconds of the event loop to validate and report in full."""
    t0 = time.monotonic()
    _assert_400(*_post(server, {"prompt": [-1] * 200_000})[::2], "prompt")
    _assert_400(*_post(server, {"messages": [{}] * 100_000}, "/v1/chat/completions")[::2],
                "messages")
    assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("body", [
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udc00"}]}]}',
])
def test_lone_surrogate_in_chat_is_400(server, body):
    _assert_400(*_post(server, body, "/v1/chat/completions")[::2], "messages")


@pytest.mark.parametrize("body", [b'{"prompt": "hi", "temperature": NaN}',
                                  b'{"prompt": "hi", "temperature": Infinity}',
                                  b'{"prompt": ' + b"[" * 100_000 + b"}",
                                  b'{"prompt": "\xff\xfe"}'])
def test_malformed_json_is_400(server, body):
    _assert_400(*_post(server, body)[::2], None)


def test_bogus_charset_is_ignored(server):
    """JSON is UTF-8 (RFC 8259), whatever charset the Content-Type names."""
    status, _, text = _post(server, {"prompt": "hi", "max_tokens": 2},
                            headers={"Content-Type": "application/json; charset=bogus-xyz"})
    assert status == 200, text


def test_undecodable_authorization_is_401(server):
    """A header that is not UTF-8 (sent as raw bytes) compares as bytes: 401, not 500."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close"
                  b"\r\n\r\n{}")
        head = s.recv(200)
    assert head.startswith(b"HTTP/1.1 401"), head


def _sse_events(text: str) -> list[str]:
    assert "HTTP/1.1" not in text
    blocks = text.split("\n\n")
    assert blocks[-1] == "" and all(b.startswith("data: ") for b in blocks[:-1]), text
    return [b[len("data: "):] for b in blocks[:-1]]


def test_stream_error_after_headers_is_one_event_then_done(server):
    """An error after the headers is an SSE error event and [DONE], in one clean
    chunked body (aiohttp would raise on a broken one), never a second HTTP response."""
    status, headers, text = _post(server, {"prompt": [STEP_CRASH_ID, 5], "max_tokens": 5,
                                           "stream": True})
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    events = _sse_events(text)
    assert events[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1 and set(errors[0]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.APIError):  # the official client sees the error too
        for _ in _client(server).completions.create(model="stub-model", prompt=[STEP_CRASH_ID, 5],
                                                    max_tokens=5, stream=True):
            pass


def _client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_request_timeout(server):
    """--request-timeout 4: 504 when not streaming, an error event + [DONE] in a stream; the
    engine request is aborted (the stub would take 10 s for 500 tokens)."""
    t0 = time.monotonic()
    status, _, text = _post(server, {"prompt": "hi", "max_tokens": 500})
    assert status == 504 and json.loads(text)["error"]["code"] == "request_timeout"
    assert time.monotonic() - t0 < 8
    status, _, text = _post(server, {"prompt": "hi", "max_tokens": 500, "stream": True})
    events = _sse_events(text)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert _rejected(server, "timeout") >= 2


def test_log_lines_cannot_be_forged_or_flooded(server):
    """An unknown field's name is quoted escaped and cut in the log."""
    before = len(server.output())
    forged = "x\n[jaxserve] ERROR jaxserve.api: FORGED LINE"
    huge = "y" * 900_000  # under the 1 MiB body limit
    status, _, text = _post(server, json.dumps({"prompt": "hi", "max_tokens": 2, forged: 1,
                                                huge: 2}).encode())
    assert status == 200, text
    log = server.output()[before:]
    assert "FORGED LINE" in log
    assert not any(line.startswith("[jaxserve] ERROR jaxserve.api: FORGED")
                   for line in log.splitlines())
    assert len(log) < 4000


def test_overload_503_with_retry_after_then_recovers(server):
    """Past --max-waiting-requests the answer is 503 with Retry-After, at once; the admitted
    ones complete and the server serves again afterwards."""

    async def one(s):
        async with s.post(server.url + "/v1/completions", headers=AUTH,
                          json={"prompt": "hi", "max_tokens": 40}) as r:
            return r.status, r.headers.get("Retry-After"), await r.text()

    async def burst():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(one(s) for _ in range(3 * MAX_IN_FLIGHT)))

    results = asyncio.run(burst())
    ok = [r for r in results if r[0] == 200]
    busy = [r for r in results if r[0] == 503]
    assert len(ok) == MAX_IN_FLIGHT and len(ok) + len(busy) == len(results), results
    assert all(r[1] == "1" and json.loads(r[2])["error"]["code"] == "overloaded" for r in busy)
    assert _post(server, {"prompt": "hi", "max_tokens": 2})[0] == 200
    assert _rejected(server, "overloaded") >= len(busy)


def test_admission_counts_each_prompt_and_choice(server):
    """A request takes prompts x n places of the in-flight cap (MAX_IN_FLIGHT): with 4
    sequences held, 3 more prompts (or 1 prompt with n=3) are a 503; 2 more prompts fit."""

    async def post(s, body):
        async with s.post(server.url + "/v1/completions", headers=AUTH, json=body,
                          timeout=aiohttp.ClientTimeout(total=20)) as r:
            return r.status, await r.text()

    async def go():
        async with aiohttp.ClientSession() as s:
            held = asyncio.create_task(post(s, {"prompt": ["a", "b", "c", "d"], "max_tokens": 60}))
            await asyncio.sleep(0.5)
            over = await post(s, {"prompt": ["a", "b", "c"], "max_tokens": 2})
            over_n = await post(s, {"prompt": "a", "n": 3, "max_tokens": 2})
            fits = await post(s, {"prompt": ["a", "b"], "max_tokens": 2})
            return await held, over, over_n, fits

    held, over, over_n, fits = asyncio.run(go())
    assert held[0] == 200 and len(json.loads(held[1])["choices"]) == 4, held
    for status, text in (over, over_n):
        assert status == 503 and json.loads(text)["error"]["code"] == "overloaded", text
    assert fits[0] == 200, fits


def test_a_prompt_list_past_max_num_seqs_queues(server):
    """More prompts than --max-num-seqs in one request are run as vLLM runs them: the engine
    queues what it cannot run yet, and every prompt gets its choice, in order."""
    status, _, text = _post(server, {"prompt": [[7, i + 1] for i in range(MAX_IN_FLIGHT)],
                                     "max_tokens": 3})
    assert status == 200, text
    body = json.loads(text)
    assert [c["index"] for c in body["choices"]] == list(range(MAX_IN_FLIGHT))
    assert body["usage"]["prompt_tokens"] == 2 * MAX_IN_FLIGHT


def test_prompt_list_is_bounded_and_others_keep_their_latency(server):
    """20,000 prompts in one request are a 400 on prompt (more sequences than the server ever
    holds in flight: --max-num-seqs + --max-waiting-requests), and a short request sent with it
    is answered as fast as alone."""

    async def post(s, body):
        t0 = time.monotonic()
        async with s.post(server.url + "/v1/completions", headers=AUTH, json=body) as r:
            return r.status, await r.text(), time.monotonic() - t0

    async def go(with_flood):
        async with aiohttp.ClientSession() as s:
            short = post(s, {"prompt": "hi", "max_tokens": 8})
            if not with_flood:
                return None, await short
            flood = post(s, {"prompt": [[1, 2]] * 20_000, "max_tokens": 4})
            return await asyncio.gather(flood, short)

    _, alone = asyncio.run(go(False))
    flood, short = asyncio.run(go(True))
    _assert_400(flood[0], flood[1], "prompt")
    assert "20000 prompts" in flood[1]
    assert short[0] == 200 and short[2] < 2 * alone[2] + 0.5, (short, alone)
    _assert_400(*_post(server, {"prompt": ["a"] * 4, "n": 2, "max_tokens": 2})[::2], "prompt")


def test_half_sent_bodies_take_no_place_in_the_queue(server):
    """Connections that send half their body hold no admission place (there are more of them
    than the in-flight cap): a well-formed request meanwhile is served."""
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS - 4):
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      + API_KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 40\r\n\r\n{\"prompt\": \"hi\",")
            socks.append(s)
        time.sleep(0.3)
        status, _, text = _post(server, {"prompt": "hi", "max_tokens": 2})
        assert status == 200, text
    finally:
        for s in socks:
            s.close()


SECRET = b"s3cr3t-KEY"
MALFORMED = [  # each quotes SECRET where aiohttp's own answer and log line would
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer\r\n " + SECRET
    + b"\r\nContent-Length: 2\r\n\r\n{}",  # a folded header (obs-fold)
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX Bad: " + SECRET + b"\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Long: " + SECRET * 1000 + b"\r\n\r\n",
    b"GET /\x01" + SECRET + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    SECRET + b" / HTTP/1.1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    + SECRET + b"\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + SECRET,
]


def test_malformed_http_is_an_openai_400_and_no_header_value_is_logged(server):
    """A request aiohttp cannot parse gets a 400 with the OpenAI error body (aiohttp's own is
    text/plain quoting the bytes), the log never holds the bytes, and a burst from one address
    writes at most one line."""
    before = len(server.output())
    for raw in MALFORMED * 3:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.settimeout(5)
            s.sendall(raw)
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 400") or head.startswith(b"HTTP/1.1 400"), data
        assert b"application/json" in head and SECRET not in data, data
        err = json.loads(body)["error"]
        assert err["code"] == "bad_http_request" and err["type"] == "invalid_request_error", err
        assert err["message"].startswith("the request is not valid HTTP/1.1: "), err
    time.sleep(0.3)
    log = server.output()[before:]
    assert "s3cr3t" not in log and "Traceback" not in log, log
    assert log.count("malformed HTTP request from 127.0.0.1") <= 1, log
    assert "malformed HTTP request from 127.0.0.1" in server.output()
    assert _post(server, {"prompt": "hi", "max_tokens": 2})[0] == 200


def test_body_too_large_is_413(server):
    status, _, text = _post(server, b'{"prompt": "' + b"a" * (2 * 2**20) + b'"}')
    assert status == 413 and json.loads(text)["error"]["type"] == "invalid_request_error"


def test_stalled_body_is_408_and_connection_closed(server):
    """Content-Length 1000 with 10 bytes sent: a 408 within the body timeout, then the
    connection closes."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(10)
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                  + API_KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n0123456789")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        elapsed = time.monotonic() - t0
    assert data.startswith(b"HTTP/1.1 408"), data
    assert elapsed < 5  # 1 s body timeout + 2 s lingering


def test_idle_and_slow_header_connections_are_closed(server):
    """aiohttp's keep-alive timer runs from the connection's start: a connection that never
    completes its headers is closed after --keepalive-timeout (2 s here)."""
    with socket.create_connection(("127.0.0.1", server.port)) as idle, \
            socket.create_connection(("127.0.0.1", server.port)) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        for s in (idle, slow):
            s.settimeout(10)
            assert s.recv(100) == b""
        assert time.monotonic() - t0 < 5


def test_connection_cap(server):
    """A request on a connection past --max-connections is answered 503 with Retry-After
    (then that connection closes), none is reset or closed unanswered; once they go, the
    server serves again."""
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 2\r\n\r\n{}")
    socks = [socket.create_connection(("127.0.0.1", server.port))
             for _ in range(MAX_CONNECTIONS + 8)]
    try:
        time.sleep(0.5)
        answers = []
        for s in socks:
            s.sendall(request)
        for s in socks:
            s.settimeout(5)
            answers.append(s.recv(4096))  # a reset would raise ConnectionResetError here
        overloaded = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
        assert len(overloaded) == 8, [a[:40] for a in answers]
        assert all(b"Retry-After: 1" in a and b'"code":"overloaded"' in a.replace(b" ", b"")
                   for a in overloaded)
        # the served ones got the request's own answer (400: no prompt)
        assert all(a.startswith(b"HTTP/1.1 400") for a in answers if a not in overloaded)
    finally:
        for s in socks:
            s.close()
    time.sleep(0.5)
    assert _post(server, {"prompt": "hi", "max_tokens": 2})[0] == 200


def test_chat_without_max_tokens_means_up_to_the_context(server):
    """OpenAI's and vLLM's meaning is kept : the stub runs out the
    context (512 tokens, ~10 s at its pace), so the request timeout (4 s) ends it."""
    status, _, text = _post(server, {"messages": [{"role": "user", "content": "hi"}]},
                            "/v1/chat/completions")
    assert status == 504, text


def test_help_names_the_env_var_and_the_new_flags():
    out = subprocess.run([sys.executable, "-m", "jaxserve.serve", "--help"], capture_output=True,
                         text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}).stdout
    flat = " ".join(out.split())
    assert "JAXSERVE_API_KEY" in flat and "`ps`" in flat
    for flag in ("--shutdown-timeout", "--max-waiting-requests", "--max-connections",
                 "--request-timeout", "--body-timeout", "--keepalive-timeout",
                 "--max-request-body-mib", "--max-engine-restarts"):
        assert flag in out


def test_server_is_idle_after_all(server):
    """After all of the above the server is healthy and nothing is left in flight."""
    assert get(f"{server.url}/health")[0] == 200
    m = server.metrics()
    assert m["jaxserve:num_requests_running"] == 0
