"""Stress a running jaxserve over loopback: many concurrent streams, random disconnects, slow
readers; then check that nothing was lost and that the server is back to idle.

One round sends ``--num-streams`` streaming ``/v1/completions`` requests at once (ShareGPT
prompts, ``ignore_eos``, 1..``--max-tokens`` tokens each). A ``--disconnect-frac`` share of the
clients hang up after a random number of chunks (before the end), a ``--slow-frac`` share read
each chunk with a pause (``--slow-read-s``). Every other stream must end with ``[DONE]`` after
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
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time
import urllib.parse

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    p.add_argument("--server-pid", type=int, default=None)
    p.add_argument("--warmup-tokens", type=int, default=0)
    p.add_argument("--warmup-prompt-chars", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    args = p.parse_args(argv)
    host = urllib.parse.urlsplit(args.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        p.error(f"--url must be on loopback, got {host!r}")
    summary = asyncio.run(main_async(args))
    print(json.dumps(summary))
    return 0 if summary["num_lost"] == 0 and summary["settled"] else 1


if __name__ == "__main__":
    sys.exit(main())
