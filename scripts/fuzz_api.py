"""Fuzz a running jaxserve (or any OpenAI-compatible server) with hostile request bodies.

Bodies come from the server's own protocol types: hypothesis-jsonschema draws JSON objects from
the JSON schema of ``CompletionRequest`` / ``ChatCompletionRequest`` (jaxserve/entrypoints/
protocol.py), then hypothesis mutates some of their fields (huge and negative integers, floats
past float32, lone surrogates, control characters, long strings, deep nesting, wrong types).
Raw malformed bodies (random bytes, cut JSON, bad UTF-8, 100,000 nested brackets, NaN, bogus
charsets) and requests to the other endpoints are mixed in. Generation is capped at
``--max-tokens`` tokens (a drawn ``max_tokens`` is kept only where it is invalid), so 2,000 bodies
take minutes on 2 CPU cores.

Every response is checked: no 5xx, an answer within ``--timeout`` s, a 4xx has exactly the
OpenAI error body ``{"error": {"message", "type", "param", "code"}}``, a 200 is a whole JSON body
or a well-formed SSE stream that ends with ``data: [DONE]`` (no second HTTP response inside).
Before and after, one greedy request must give the same text. With ``--canary``, a greedy
streamed request (``CANARY_BODY``) runs ``--canary`` times alone first, then back to back for as
long as the fuzz runs: the fuzz must not slow it past ``--canary-max-ratio`` (its p99 latency
during the fuzz against its median alone). Exit code 1 on any failure.

    python scripts/fuzz_api.py --url http://127.0.0.1:8000 --num-bodies 2000 --seed 0 --canary 10

Prints one JSON summary line: ``bodies``, ``by_status``, ``failures`` (the first 20, each with
the case and what was wrong), ``max_latency_s`` and the ``slowest`` case, ``duration_s``,
``greedy_same``; with ``--canary``, ``canary`` (``alone_p50_s``, ``during_p50_s``,
``during_p99_s``, ``ratio``, ``count``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import random
import sys
import time

import aiohttp
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

ENDPOINTS = {"/v1/completions": "CompletionRequest",
             "/v1/chat/completions": "ChatCompletionRequest"}
GREEDY_BODY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
CANARY_BODY = {"messages": [{"role": "user", "content": "Name three colours."}],
               "max_tokens": 16, "temperature": 0, "stream": True}
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclasses.dataclass
class Case:
    """One request: ``body`` is a JSON-able object, or raw bytes sent as they are."""

    method: str
    path: str
    body: object = None
    headers: dict = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        body = self.body if isinstance(self.body, bytes) else json.dumps(self.body)
        return f"{self.method} {self.path} {self.headers or ''} {body[:300]!r}"


# -- generation ---------------------------------------------------------------------------------

def _nest(depth: int):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


_NASTY_INTS = st.sampled_from([0, -1, 2**31 - 1, 2**31, -(2**31) - 1, 2**63, 2**64, -(2**64),
                               10**30, 49152, 128256])
_NASTY_FLOATS = st.sampled_from([0.0, -0.0, 1e-45, 1e-300, 1e308, -1e308, 3.5e38, 2.0000001,
                                 -1.0, 1e-8])
_NASTY_TEXT = st.one_of(
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "\n[jaxserve] ERROR FORGED", "\u2028",
                     "😀" * 50, "", " ", "<|im_start|>", "\\", '"']),
    st.text(min_size=0, max_size=40),
    st.integers(1000, 200_000).map(lambda n: "word " * (n // 5)),
)
_NASTY = st.one_of(_NASTY_INTS, _NASTY_FLOATS, _NASTY_TEXT, st.none(), st.booleans(),
                   st.lists(_NASTY_INTS, max_size=5), st.lists(_NASTY_TEXT, max_size=3),
                   st.integers(1, 900).map(_nest),  # json.dumps itself stops near 1,000
                   st.dictionaries(_NASTY_TEXT, _NASTY_INTS, max_size=3))


def _schemas() -> dict[str, dict]:
    from jaxserve.entrypoints import protocol

    return {path: getattr(protocol, name).model_json_schema() for path, name in ENDPOINTS.items()}


def _cap_generation(body: dict, max_tokens: int, rng: random.Random) -> dict:
    """Small valid max_tokens (so generation stays short); invalid drawn values are kept."""
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 1 <= v:
            body[key] = rng.randint(1, max_tokens)
    # Both absent or null means "up to the context" (OpenAI's and vLLM's meaning): thousands of
    # tokens, minutes on a CPU. Cap it too.
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = rng.randint(1, max_tokens)
    return body


def _raw_cases(rng: random.Random, n: int) -> list[Case]:
    """Malformed bodies and odd requests, drawn from a fixed list of shapes."""
    valid = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    shapes = [
        lambda: Case("POST", "/v1/completions", rng.randbytes(rng.randint(0, 300))),
        lambda: Case("POST", "/v1/completions", valid[:rng.randint(0, len(valid) - 1)]),
        lambda: Case("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", '
                     b'"content": "\xff\xfe"}]}'),
        lambda: Case("POST", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"}"),
        lambda: Case("POST", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}'),
        lambda: Case("POST", "/v1/completions", b'{"prompt": "hi", "top_p": Infinity}'),
        lambda: Case("POST", "/v1/completions", valid,
                     {"Content-Type": "application/json; charset=bogus-xyz"}),
        lambda: Case("POST", "/v1/completions", valid, {"Content-Type": "text/plain"}),
        lambda: Case("POST", "/v1/completions", b"[1, 2]"),
        lambda: Case("POST", "/v1/completions", b"null"),
        lambda: Case("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "'
                     + b"x" * rng.randint(1, 100_000) + b'\\n[jaxserve] FORGED": 1}'),
        lambda: Case("GET", rng.choice(["/v1/models", "/health", "/version", "/metrics",
                                        "/nope", "/v1/completions", "/%0a%0d"])),
        lambda: Case("POST", rng.choice(["/v1/models", "/health", "/metrics"]), valid),
        lambda: Case("DELETE", "/v1/completions", valid),
    ]
    return [rng.choice(shapes)() for _ in range(n)]


def generate_cases(num_bodies: int, seed_value: int = 0, max_tokens: int = 4) -> list[Case]:
    """``num_bodies`` cases: about 80% drawn from the protocol schemas (half of those with one
    field replaced by a nasty value, a fifth streamed), the rest raw (``_raw_cases``)."""
    rng = random.Random(seed_value)
    num_raw = num_bodies // 5
    cases: list[Case] = []
    schemas = _schemas()
    per_endpoint = (num_bodies - num_raw + len(schemas) - 1) // len(schemas)
    for path, schema in schemas.items():
        drawn: list[dict] = []
        mutation = st.tuples(st.sampled_from(sorted(schema["properties"])), _NASTY)

        @seed(seed_value)
        @settings(max_examples=per_endpoint, database=None, deadline=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(from_schema(schema), st.booleans(), mutation, st.integers(0, 4))
        def draw(body, mutate, field_value, streamed):
            if mutate:
                body[field_value[0]] = field_value[1]
            if streamed == 0:
                body["stream"] = True
            drawn.append(body)

        draw()
        for body in drawn[:per_endpoint]:
            cases.append(Case("POST", path, _cap_generation(body, max_tokens, rng)))
    cases = cases[:num_bodies - num_raw] + _raw_cases(rng, num_raw)
    rng.shuffle(cases)
    return cases


# -- checking -----------------------------------------------------------------------------------


def check_response(case: Case, status: int, headers, data: bytes) -> str | None:
    """What is wrong with one response, or None."""
    if status >= 500:
        return f"status {status}: {data[:300]!r}"
    ctype = headers.get("Content-Type", "")
    if status >= 400:
        if case.path.startswith("/v1") or status != 405:
            try:
                err = json.loads(data)["error"]
            except (ValueError, KeyError, TypeError):
                return f"status {status} without an OpenAI error body: {data[:300]!r}"
            if set(err) != ERROR_KEYS:
                return f"error body keys {sorted(err)}"
        return None
    if not case.path.startswith("/v1/") or case.method != "POST":
        return None
    if ctype.startswith("text/event-stream"):
        events = data.decode("utf-8").split("\n\n")
        if events[-1] != "" or events[-2] != "data: [DONE]":
            return f"stream does not end with [DONE]: {data[-300:]!r}"
        for e in events[:-2]:
            if not e.startswith("data: "):
                return f"bad SSE event {e[:200]!r}"
            json.loads(e[len("data: "):])
        return None
    body = json.loads(data)
    if not body.get("choices"):
        return f"200 without choices: {data[:300]!r}"
    return None


@dataclasses.dataclass
class Report:
    bodies: int = 0
    by_status: dict = dataclasses.field(default_factory=dict)
    failures: list = dataclasses.field(default_factory=list)
    max_latency_s: float = 0.0
    slowest: str = ""  # the case that took max_latency_s


async def _send(session, url: str, case: Case, api_key: str | None, timeout: float, report: Report):
    headers = {"Content-Type": "application/json", **case.headers}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = case.body if isinstance(case.body, bytes) or case.body is None else (
        json.dumps(case.body).encode("utf-8", "surrogatepass"))
    t0 = time.monotonic()
    problem = None
    try:
        async with asyncio.timeout(timeout):
            async with session.request(case.method, url + case.path, data=data,
                                       headers=headers) as r:
                payload = await r.read()
                status = r.status
                problem = check_response(case, r.status, r.headers, payload)
    except TimeoutError:
        status, problem = "hang", f"no complete answer within {timeout} s"
    except (aiohttp.ClientError, ValueError, UnicodeDecodeError) as e:
        status, problem = "broken", f"{type(e).__name__}: {e}"
    if time.monotonic() - t0 > report.max_latency_s:
        report.max_latency_s, report.slowest = time.monotonic() - t0, case.describe()
    report.bodies += 1
    report.by_status[str(status)] = report.by_status.get(str(status), 0) + 1
    if problem:
        report.failures.append({"case": case.describe(), "problem": problem})


async def greedy_text(session, url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with session.post(url + "/v1/completions", json=GREEDY_BODY, headers=headers) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["text"]


async def canary_latency(session, url: str, api_key: str | None) -> float:
    """Seconds for one streamed CANARY_BODY, from sending to ``data: [DONE]``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.monotonic()
    async with session.post(url + "/v1/chat/completions", json=CANARY_BODY,
                            headers=headers) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.strip() == b"data: [DONE]":
                return time.monotonic() - t0
    raise AssertionError("the canary's stream ended without [DONE]")


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _canary_process(url: str, api_key: str | None, alone: int, stop, out) -> None:
    """The canary, in a process of its own (the fuzz's own work on this side would otherwise
    delay it): puts its ``alone`` latencies on ``out``, then those of the runs until ``stop``
    is set."""

    async def go():
        async with aiohttp.ClientSession() as s:
            out.put([await canary_latency(s, url, api_key) for _ in range(alone)])
            during = []
            while not stop.is_set():
                during.append(await canary_latency(s, url, api_key))
            out.put(during)

    asyncio.run(go())


def _canary_stats(alone: list[float], during: list[float]) -> dict:
    base, p99 = _quantile(alone, 0.5), _quantile(during, 0.99)
    return {"alone_p50_s": round(base, 3), "during_p50_s": round(_quantile(during, 0.5), 3),
            "during_p99_s": round(p99, 3), "ratio": round(p99 / base, 2), "count": len(during)}


async def run_cases(url: str, cases: list[Case], *, concurrency: int = 8,
                    api_key: str | None = None, timeout: float = 30.0,
                    canary: int = 0) -> tuple[Report, bool, dict | None]:
    """Sends every case (``concurrency`` at a time); returns the report, whether the greedy
    request gave the same text before and after, and the canary's latencies (``canary``
    runs alone, then back to back during the fuzz, from a process of its own), or None."""
    report = Report()
    sem = asyncio.Semaphore(concurrency)
    loop = asyncio.get_running_loop()

    async def one(case):
        async with sem:
            await _send(session, url, case, api_key, timeout, report)

    conn = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as session:
        before = await greedy_text(session, url, api_key)
        if canary:
            ctx = multiprocessing.get_context("spawn")
            stop, out = ctx.Event(), ctx.Queue()
            proc = ctx.Process(target=_canary_process, args=(url, api_key, canary, stop, out))
            proc.start()
            alone = await loop.run_in_executor(None, out.get)
        await asyncio.gather(*(one(c) for c in cases))
        stats = None
        if canary:
            stop.set()
            stats = _canary_stats(alone, await loop.run_in_executor(None, out.get))
            proc.join()
        after = await greedy_text(session, url, api_key)
    return report, before == after, stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--num-bodies", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=4, help="cap on valid max_tokens drawn")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds before a case is a hang")
    p.add_argument("--api-key", default=None)
    p.add_argument("--canary", type=int, default=0, metavar="N",
                   help="time a greedy streamed request N times alone, then during the fuzz")
    p.add_argument("--canary-max-ratio", type=float, default=3.0,
                   help="largest allowed canary p99 during the fuzz / its median alone")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    cases = generate_cases(args.num_bodies, args.seed, args.max_tokens)
    t_gen = time.monotonic() - t0
    report, same, canary = asyncio.run(run_cases(
        args.url, cases, concurrency=args.concurrency, api_key=args.api_key,
        timeout=args.timeout, canary=args.canary))
    summary = {**dataclasses.asdict(report), "failures": report.failures[:20],
               "num_failures": len(report.failures), "greedy_same": same,
               "generate_s": round(t_gen, 1), "duration_s": round(time.monotonic() - t0, 1),
               "max_latency_s": round(report.max_latency_s, 2), "canary": canary}
    print(json.dumps(summary))
    slowed = canary is not None and canary["ratio"] > args.canary_max_ratio
    return 0 if same and not report.failures and not slowed else 1


if __name__ == "__main__":
    sys.exit(main())
