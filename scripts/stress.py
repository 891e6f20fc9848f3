"""Stress a running jaxserve over loopback (docs/reliability.md): many concurrent streams, random
disconnects, slow readers, then a check that nothing was lost and that the server is back to
idle; and hostile scenarios (``--scenario``): poison requests, a big prompt, overload, engine kills.

``--scenario streams`` (the default): one round sends ``--num-streams`` streaming
``/v1/completions`` requests at once (ShareGPT prompts, ``ignore_eos``, 1..``--max-tokens``
tokens each). A ``--disconnect-frac`` share of the clients hang up after a random number of
chunks (before the end), a ``--slow-frac`` share read each chunk with a pause
(``--slow-read-s``). Every other stream must end with ``[DONE]`` after
exactly its ``max_tokens`` tokens (its usage chunk says so): a missing token, an error event or a
cut stream is a lost answer. After the round, ``/metrics`` must come back to no running and no
waiting request and a KV usage of 0 (no leaked pages) within ``--settle-s`` seconds.

``--soak-s S`` repeats rounds for S seconds and samples the resident memory (RSS, from /proc) of
``--server-pid`` and its child processes (the engine) after every round; a warm-up of
``--warmup-tokens`` prompt tokens first (e.g. the KV pool's size from the server's start-up line,
so that first touch of the pool is not counted as growth). Loopback only: ``--url`` must be on
127.0.0.1 / localhost.

    python scripts/stress.py --url http://127.0.0.1:8000 --num-streams 500 --disconnect-frac 0.2
    python scripts/stress.py --soak-s 600 --server-pid PID --warmup-tokens 46000 --num-streams 64

Prints one JSON line: ``rounds``, ``streams``, ``completed``, ``disconnected``, ``lost`` (the first
10 with why), ``settled`` (metrics back to idle), ``metrics_after``, ``rss_mb`` (per round:
{pid: MiB}), ``rss_growth_frac`` (per pid: last round vs first round after warm-up),
``duration_s``. Exit code 1 when an answer was lost or the server did not settle.

The other scenarios print one JSON line with their measurements and ``ok``:
- ``poison``: a body that would overflow int32 in the engine step (``top_k`` 2**31) is sent
  while 8 streams run: it must get a 400 and all 8 streams must complete.
- ``big-prompt``: a ``--big-prompt-mb`` MB prompt: rejected within 1 s, ``/health`` (probed every
  10 ms from a process of its own) answering within 100 ms meanwhile, the server's RSS growing by less
  than 200 MB (sampled every 10 ms).
- ``overload``: ``--num-streams`` requests at once against a server whose
  ``--max-waiting-requests`` they exceed: the refused ones get 503 with ``Retry-After`` (or, past
  ``--max-connections``, a closed connection), the admitted ones complete, RSS stays bounded,
  and a request after the burst is served.
- ``engine-kill``: SIGKILL the engine process (the child of ``--server-pid``) while
  ``--num-streams`` streams run: every stream must end with an error within 5 s; then the server
  must come back (``/health`` 200, ``jaxserve:engine_restarts_total`` one more, a request served)
  or, with ``--expect-exit``, the server process must exit with code 3.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sharegpt import first_turns  # noqa: E402

IDLE_GAUGES = ("jaxserve:num_requests_running", "jaxserve:num_requests_waiting",
               "jaxserve:kv_cache_usage_perc")


@dataclasses.dataclass
class Tally:
    streams: int = 0
    completed: int = 0
    disconnected: int = 0
    lost: list = dataclasses.field(default_factory=list)


async def _stream(session, url, prompt: str, max_tokens: int, hangup_after: int | None,
                  slow_s: float, tally: Tally, headers: dict, timeout: float) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    tally.streams += 1
    events = 0
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
                if r.status != 200:
                    tally.lost.append(f"status {r.status}: {(await r.text())[:200]}")
                    return
                usage, done = None, False
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    events += 1
                    if hangup_after is not None and events >= hangup_after:
                        tally.disconnected += 1
                        return  # leaving the block closes the connection mid-stream
                    data = line[len(b"data: "):].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        tally.lost.append(f"error event: {event['error']['message'][:200]}")
                        return
                    usage = event.get("usage") or usage
                    if slow_s:
                        await asyncio.sleep(slow_s)
    except (aiohttp.ClientError, TimeoutError) as e:
        tally.lost.append(f"{type(e).__name__}: {e}")
        return
    if not done:
        tally.lost.append("stream ended without [DONE]")
    elif usage is None or usage["completion_tokens"] != max_tokens:
        tally.lost.append(f"got {usage and usage['completion_tokens']} of {max_tokens} tokens")
    else:
        tally.completed += 1


async def metrics(session, url: str) -> dict[str, float]:
    """``/metrics`` as {sample name: value} (labels dropped)."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


async def settle(session, url: str, timeout: float) -> tuple[bool, dict]:
    """Waits until no request runs or waits and no KV page is held; (settled, last metrics)."""
    deadline = time.monotonic() + timeout
    while True:
        m = await metrics(session, url)
        if all(m.get(g, 0) == 0 for g in IDLE_GAUGES):
            return True, m
        if time.monotonic() > deadline:
            return False, m
        await asyncio.sleep(0.2)


async def run_round(session, url: str, prompts: list[str], args, rng: random.Random,
                    tally: Tally) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    jobs = []
    for _ in range(args.num_streams):
        max_tokens = rng.randint(1, args.max_tokens)
        # Hang up after 1..max_tokens events: always before [DONE] (chunks + usage + [DONE]).
        hangup = rng.randint(1, max_tokens) if rng.random() < args.disconnect_frac else None
        slow = args.slow_read_s if rng.random() < args.slow_frac else 0.0
        jobs.append(_stream(session, url, rng.choice(prompts), max_tokens, hangup, slow, tally,
                            headers, args.timeout))
    await asyncio.gather(*jobs)


def rss_mb(pid: int) -> dict[int, float]:
    """Resident memory, MiB, of ``pid`` and its child processes (from /proc)."""
    pids, out = [pid], {}
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids += [int(c) for c in f.read().split()]
    except OSError:
        pass
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            out[p] = round(kb / 1024, 1)
        except (OSError, StopIteration):
            pass
    return out


async def warm_up(session, url: str, prompts: list[str], tokens: int, args) -> None:
    """Distinct prompts totalling about ``tokens`` prompt tokens (4 characters a token), 32 at
    a time, so every KV page gets used once."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sent, i = 0, 0

    async def one(prompt):
        body = {"prompt": prompt, "max_tokens": 1}
        async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
            await r.read()

    while sent < tokens:
        batch = [f"{i + k} {prompts[(i + k) % len(prompts)]}"[:args.warmup_prompt_chars]
                 for k in range(32)]
        i += 32
        sent += sum(len(p) for p in batch) // 4
        await asyncio.gather(*(one(p) for p in batch))


async def main_async(args) -> dict:
    rng = random.Random(args.seed)
    prompts = [p[:args.prompt_chars] for p in first_turns() if p.strip()]
    tally = Tally()
    rss: list[dict] = []
    t0 = time.monotonic()
    conn = aiohttp.TCPConnector(limit=0)  # no client-side cap: every stream at once
    async with aiohttp.ClientSession(connector=conn) as session:
        if args.warmup_tokens:
            await warm_up(session, args.url, prompts, args.warmup_tokens, args)
            await settle(session, args.url, args.settle_s)
        rounds = 0
        while True:
            await run_round(session, args.url, prompts, args, rng, tally)
            rounds += 1
            settled, after = await settle(session, args.url, args.settle_s)
            if args.server_pid:
                rss.append(rss_mb(args.server_pid))
            if not settled or time.monotonic() - t0 >= args.soak_s:
                break
    growth = {}
    if len(rss) >= 2:
        growth = {p: round(rss[-1][p] / rss[0][p] - 1, 4) for p in rss[0] if p in rss[-1]}
    return {"rounds": rounds, "streams": tally.streams, "completed": tally.completed,
            "disconnected": tally.disconnected, "num_lost": len(tally.lost),
            "lost": tally.lost[:10], "settled": settled,
            "metrics_after": {g: after.get(g) for g in IDLE_GAUGES},
            "rss_mb": rss, "rss_growth_frac": growth,
            "duration_s": round(time.monotonic() - t0, 1)}


def _post_json(session, url: str, body: dict, headers: dict):
    return session.post(url + "/v1/completions", json=body, headers=headers)


def _headers(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def _plain_stream(session, url: str, headers: dict, i: int, max_tokens: int) -> str:
    """One streamed request; '' when it ended with [DONE] after max_tokens tokens, else why
    not (an error event's message included)."""
    body = {"prompt": f"Story {i}: once upon a time", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    try:
        async with _post_json(session, url, body, headers) as r:
            text = await r.text()
    except aiohttp.ClientError as e:
        return f"{type(e).__name__}: {e}"
    events = [e[len("data: "):] for e in text.split("\n\n") if e]
    errors = [e for e in events if '"error"' in e]
    if errors:
        return f"error event: {errors[0][:200]}"
    if r.status != 200 or not events or events[-1] != "[DONE]":
        return f"status {r.status}, no [DONE]: {text[-200:]!r}"
    got = json.loads(events[-2])["usage"]["completion_tokens"]
    return "" if got == max_tokens else f"{got} of {max_tokens} tokens"


async def scenario_poison(session, args) -> dict:
    headers = _headers(args)
    streams = [asyncio.create_task(_plain_stream(session, args.url, headers, i, 32))
               for i in range(8)]
    await asyncio.sleep(1.0)  # the streams are running
    async with _post_json(session, args.url, {"prompt": "hi", "max_tokens": 2,
                                              "top_k": 2**31}, headers) as r:
        poison = [r.status, (await r.json())["error"]["param"]]
    results = await asyncio.gather(*streams)
    return {"poison_status_param": poison, "streams_completed": results.count(""),
            "streams": len(results), "stream_errors": [e for e in results if e][:3],
            "ok": poison == [400, "top_k"] and results.count("") == len(results)}


class _Sampler(threading.Thread):
    """Calls ``fn`` every ``period_s`` s on its own thread (so a busy event loop in this process
    does not delay it) and keeps the results."""

    def __init__(self, fn, period_s: float = 0.01):
        super().__init__(daemon=True)
        self.fn, self.period_s, self.values = fn, period_s, []
        self._done = threading.Event()

    def run(self):
        while not self._done.is_set():
            self.values.append(self.fn())
            time.sleep(self.period_s)

    def stop(self) -> list:
        self._done.set()
        self.join()
        return self.values


def _health_ms(url: str):
    def probe():
        t = time.monotonic()
        try:
            with urllib.request.urlopen(url + "/health", timeout=10) as r:
                r.read()
        except (urllib.error.URLError, OSError):
            return float("inf")
        return (time.monotonic() - t) * 1000
    return probe


def _probe_health(url: str, period_s: float, done, conn) -> None:
    """A _HealthSampler's process: probe until ``done`` is set, then send the latencies."""
    probe, values = _health_ms(url), []
    values.append(probe())
    conn.send(None)  # started
    while not done.is_set():
        time.sleep(period_s)
        values.append(probe())
    conn.send(values)


class _HealthSampler:
    """``/health`` latencies in ms, probed every ``period_s`` s from a process of its own: a
    thread of this process would time this process's GIL too, which sending a 50 MB body holds
    for tens of ms at a time while the server answers in a few."""

    def __init__(self, url: str, period_s: float = 0.01):
        ctx = multiprocessing.get_context("spawn")
        self._done = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_probe_health, args=(url, period_s, self._done, send),
                                 daemon=True)

    def start(self) -> None:
        """Returns once the first probe has been answered."""
        self._proc.start()
        self._recv.recv()

    def stop(self) -> list:
        self._done.set()
        values = self._recv.recv()
        self._proc.join()
        return values


def _server_rss(args):
    return lambda: rss_mb(args.server_pid).get(args.server_pid, 0.0)


async def scenario_big_prompt(session, args) -> dict:
    body = json.dumps({"prompt": "a" * int(args.big_prompt_mb * 1e6), "max_tokens": 2}).encode()
    rss0 = _server_rss(args)()
    health, rss = _HealthSampler(args.url), _Sampler(_server_rss(args))
    health.start(), rss.start()
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    async with session.post(args.url + "/v1/completions", data=body, headers={
            "Content-Type": "application/json", **_headers(args)}) as r:
        status = r.status
        await r.read()
    reject_s = time.monotonic() - t0
    await asyncio.sleep(0.5)
    health_ms, rss_samples = health.stop(), rss.stop()
    growth = max(rss_samples) - rss0
    return {"status": status, "reject_s": round(reject_s, 3),
            "health_max_ms": round(max(health_ms), 1), "health_probes": len(health_ms),
            "rss_before_mb": rss0, "rss_peak_growth_mb": round(growth, 1),
            "ok": status in (400, 413) and reject_s < 1 and max(health_ms) < 100 and growth < 200}


async def scenario_overload(session, args) -> dict:
    headers = _headers(args)
    rss = _Sampler(_server_rss(args), 0.05)
    rss0 = _server_rss(args)()
    rss.start()

    async def one(i):
        body = {"prompt": f"Question {i}: why is the sky blue?", "max_tokens": args.max_tokens,
                "ignore_eos": True}
        try:
            async with _post_json(session, args.url, body, headers) as r:
                await r.read()
                return r.status, r.headers.get("Retry-After")
        except aiohttp.ClientError:  # a connection closed or reset without an answer
            return "closed", None

    t0 = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in range(args.num_streams)))
    duration = time.monotonic() - t0
    async with _post_json(session, args.url, {"prompt": "hi", "max_tokens": 2}, headers) as r:
        after = r.status
    peak = max(rss.stop())
    refused = [r for r in results if r[0] == 503]
    served = [r for r in results if r[0] == 200]
    closed = [r for r in results if r[0] == "closed"]
    return {"requests": len(results), "served": len(served), "refused_503": len(refused),
            "refused_with_retry_after": sum(1 for r in refused if r[1]),
            "connection_closed": len(closed),
            "other": len(results) - len(served) - len(refused) - len(closed),
            "duration_s": round(duration, 1), "rss_before_mb": rss0, "rss_peak_mb": peak,
            "status_after": after,
            # every request answered: 200, or 503 with Retry-After; none closed unanswered
            "ok": all(r[1] for r in refused) and after == 200 and not closed
            and len(served) + len(refused) == len(results)}


def _engine_pid(server_pid: int) -> int:
    children = [p for p in rss_mb(server_pid) if p != server_pid]
    for p in children:
        with open(f"/proc/{p}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return p
    raise RuntimeError(f"no engine process under {server_pid}")


async def scenario_engine_kill(session, args) -> dict:
    headers = _headers(args)
    before = await metrics(session, args.url)
    ended: list[float] = []

    async def one(i):
        err = await _plain_stream(session, args.url, headers, i, args.max_tokens)
        ended.append(time.monotonic())
        return err

    streams = [asyncio.create_task(one(i)) for i in range(args.num_streams)]
    await asyncio.sleep(args.kill_after_s)
    killed = time.monotonic()
    engine = _engine_pid(args.server_pid)
    os.kill(engine, signal.SIGKILL)
    results = await asyncio.gather(*streams)
    in_flight = [e for e in results if e]
    worst = max(ended) - killed
    metrics_down = None
    try:
        metrics_down = (await metrics(session, args.url)).get("jaxserve:engine_alive")
    except aiohttp.ClientError:
        pass
    out = {"streams": len(results), "failed_with_error": len(in_flight),
           "completed_before_kill": results.count(""), "last_error_after_kill_s": round(worst, 2),
           "engine_alive_right_after": metrics_down}
    if args.expect_exit:
        t0 = time.monotonic()
        while not _gone(args.server_pid) and time.monotonic() - t0 < args.settle_s:
            await asyncio.sleep(0.1)
        exited = _gone(args.server_pid)
        out.update(server_exited=exited, exit_after_s=round(time.monotonic() - t0, 1),
                   ok=exited and worst < 5)
        return out
    # Back means restarted and healthy: /health alone can still say 200 in the moment before
    # the API process notices the kill (every stream may have ended before it).
    t0 = time.monotonic()
    while True:
        after = await metrics(session, args.url)
        restarts = (after.get("jaxserve:engine_restarts_total", 0)
                    - before.get("jaxserve:engine_restarts_total", 0))
        if restarts and urllib_status(args.url + "/health") == 200:
            break
        if time.monotonic() - t0 > args.settle_s:
            break
        await asyncio.sleep(0.5)
    back_s = time.monotonic() - t0
    async with _post_json(session, args.url, {"prompt": "hi", "max_tokens": 2}, headers) as r:
        served = r.status
    out.update(back_after_s=round(back_s, 1), restarts=restarts, served_after=served,
               engine_alive=after.get("jaxserve:engine_alive"),
               running_after=after.get("jaxserve:num_requests_running"),
               ok=worst < 5 and restarts == 1 and served == 200)
    return out


def _gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def urllib_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


SCENARIOS = {"poison": scenario_poison, "big-prompt": scenario_big_prompt,
             "overload": scenario_overload, "engine-kill": scenario_engine_kill}


async def run_scenario(args) -> dict:
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        return await SCENARIOS[args.scenario](session, args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=["streams", *SCENARIOS], default="streams")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--num-streams", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--disconnect-frac", type=float, default=0.2)
    p.add_argument("--slow-frac", type=float, default=0.1)
    p.add_argument("--slow-read-s", type=float, default=0.05)
    p.add_argument("--prompt-chars", type=int, default=400)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a stream may take")
    p.add_argument("--settle-s", type=float, default=60.0)
    p.add_argument("--soak-s", type=float, default=0.0, help="repeat rounds for this long")
    p.add_argument("--server-pid", type=int, default=None,
                   help="the server's pid (RSS; engine-kill, big-prompt and overload need it)")
    p.add_argument("--warmup-tokens", type=int, default=0)
    p.add_argument("--warmup-prompt-chars", type=int, default=2000)
    p.add_argument("--big-prompt-mb", type=float, default=50.0)
    p.add_argument("--kill-after-s", type=float, default=3.0)
    p.add_argument("--expect-exit", action="store_true",
                   help="engine-kill: the server runs with --max-engine-restarts 0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    host = urllib.parse.urlsplit(args.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        p.error(f"--url must be on loopback, got {host!r}")
    if args.scenario != "streams" and args.scenario != "poison" and not args.server_pid:
        p.error(f"--scenario {args.scenario} needs --server-pid")
    if args.scenario == "streams":
        summary = asyncio.run(main_async(args))
        summary["ok"] = summary["num_lost"] == 0 and summary["settled"]
    else:
        summary = asyncio.run(run_scenario(args))
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
