"""Online serving benchmark against a running OpenAI-compatible server (jaxserve or another).

Sends streaming `/v1/completions` requests with token-id prompts of a fixed length, `max_tokens`
fixed and `ignore_eos` (vLLM's extension, honoured by jaxserve and vLLM), at most
`--max-concurrency` in flight, and reports output tokens/s and TTFT / TPOT / ITL percentiles, as
vLLM's `benchmarks/benchmark_serving.py` does (TPOT = (latency - TTFT) / (output tokens - 1);
ITL = gaps between streamed chunks).

    python -m jaxserve.serve --model llama-3.1-8b --load-format dummy --max-model-len 2048 &
    python scripts/bench_serving.py --num-prompts 256 --input-len 1000 --output-len 1000
"""

import argparse
import asyncio
import json
import time

import aiohttp
import numpy as np


async def one_request(session, url, model, prompt, output_len):
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps, tokens = [], 0
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if not stamps:
        raise RuntimeError(f"the stream ended without a token (last line: {line!r})")
    return {"ttft": stamps[0] - start, "latency": end - start, "tokens": tokens or len(stamps),
            "itl": np.diff(stamps).tolist()}


async def run(args):
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(10, args.vocab, args.input_len).tolist() for _ in range(args.num_prompts)]
    url = f"{args.base_url}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=None)
    # aiohttp's default connector allows 100 connections: requests above that would wait inside
    # the client and the wait would be counted as TTFT. --max-concurrency is the only cap.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async with session.get(f"{args.base_url}/v1/models") as r:
            model = args.model or (await r.json())["data"][0]["id"]
        limit = asyncio.Semaphore(args.max_concurrency)

        async def limited(p):
            async with limit:
                return await one_request(session, url, model, p, args.output_len)

        # Warm-up outside the timed window.
        await asyncio.gather(*(limited(p) for p in prompts[:4]))
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        elapsed = time.perf_counter() - start
    return model, results, elapsed


def pct(values, q):
    return float(np.percentile(values, q)) * 1000 if len(values) else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--max-concurrency", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=49152, help="prompt ids are drawn below this")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model, results, elapsed = asyncio.run(run(args))
    out_tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results]
    tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    itl = [x for r in results for x in r["itl"]]
    print(f"model {model}: {len(results)} requests x ({args.input_len} in, {args.output_len} out), "
          f"max concurrency {args.max_concurrency}, {elapsed:.1f} s")
    print("| output tok/s | total tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {out_tokens / elapsed:.0f} | {(out_tokens + len(results) * args.input_len) / elapsed:.0f} "
          f"| {pct(ttft, 50):.0f} / {pct(ttft, 99):.0f} | {pct(tpot, 50):.1f} / {pct(tpot, 99):.1f} "
          f"| {pct(itl, 50):.1f} / {pct(itl, 99):.1f} |")


if __name__ == "__main__":
    main()
