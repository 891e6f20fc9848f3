"""Online serving benchmark against a running OpenAI-compatible server (jaxserve, vLLM, ...).

Shaped like vLLM's `benchmarks/benchmark_serving.py`: sends streaming `/v1/completions` requests
with `max_tokens` set and `ignore_eos` (vLLM's extension, honoured by jaxserve and vLLM, so each
request generates exactly its output length), arriving all at once or as a Poisson process
(`--request-rate`), at most `--max-concurrency` in flight (no other cap: the HTTP client has no
connection limit). Uses only `/v1/completions`, `/v1/models` and, when the server has it,
`/metrics`.

Datasets (`--dataset-name`):
- `random`: `--input-len` random token ids (below `--vocab`), `--output-len` output tokens.
- `sharegpt`: the first human turn of each conversation of `--dataset-path` (default: the repo's
  sample, data/README.md) as a text prompt; the first answer's token count as output length
  (or `--sharegpt-output-len`); conversations are shuffled (`--seed`) and those whose prompt or
  answer has fewer than 4 tokens, whose prompt has more than 1,024, or whose prompt and answer
  together have more than 2,048 (or `--max-model-len`) are skipped, as vLLM's benchmark does
  (`--sharegpt-max-prompt-len`, `--sharegpt-max-total-len`); `--num-prompts 0` sends every
  conversation that passes.
- `shared-prefix`: one random `--prefix-len` prefix shared by all requests, then `--input-len`
  random ids of each request's own: a prefix-caching workload.

Metrics, as vLLM defines them: request throughput (requests/s), output and total (prompt +
output) tokens/s over the timed window, and mean / p50 / p90 / p99 in ms of TTFT (time to the
first streamed chunk with a choice), TPOT ((latency - TTFT) / (output tokens - 1), requests
with more than one output token), ITL (gaps between consecutive chunks with a choice, pooled over
requests) and E2EL (request latency). Output tokens come from the final `usage` chunk
(`stream_options.include_usage`). Failed requests (HTTP error, error event in the stream,
connection error, stream cut before `[DONE]`) are counted and left out of the metrics.

Cross-check: `/metrics` is read right before and after the timed window; the deltas of the
server's `generation_tokens` and `prompt_tokens` counters (any prefix: `jaxserve:`, `vllm:`)
are reported beside the client's counts (with the prefix cache's hit and query counters), and
the peak of `num_requests_running + num_requests_waiting`, sampled every `--metrics-interval` s
during the run, shows how many requests the server really had at once. The `--num-warmup`
warm-up requests (extra samples of the same dataset, so they do not warm the prefix cache for
the timed prompts, except the shared prefix of `shared-prefix`) run before the window and count
in neither side.

`--result-dir DIR` writes `DIR/<name>.json` and `DIR/<name>.png`. JSON keys: `date`, `command`,
`settings` (the flags, resolved: `model`, `vocab`, `max_model_len`), `duration_s`,
`num_prompts`, `completed`, `failed`, `first_error`, `total_input_tokens`,
`total_output_tokens`, `request_throughput`, `output_throughput`, `total_token_throughput`,
`{mean,p50,p90,p99}_{ttft,tpot,itl,e2el}_ms`, `server_generation_tokens`,
`server_prompt_tokens`, `server_prefix_cache_hits`, `server_prefix_cache_queries` (tokens),
`server_peak_running_waiting` (null without /metrics),
`server_load_samples` ({`t_s`, `running`, `waiting`}), and per timed request, in send order:
`start_times_s` (from the window's start), `input_lens`, `output_lens`, `ttfts_s`,
`latencies_s`, `itls_s` (a list per request), `errors` ("" for a success).

    python -m jaxserve.serve --model llama-3.1-8b --load-format dummy --max-model-len 2048 &
    python scripts/bench_serving.py --num-prompts 256 --input-len 1000 --output-len 1000
"""

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import math
import pathlib
import shlex
import sys
import time

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from sharegpt import SAMPLE, prompt_answer_pairs

DEFAULT_VOCAB = 49152  # the default model's (SmolLM2) vocabulary
DEFAULT_MAX_MODEL_LEN = 2048  # when the server does not say
MIN_SHAREGPT_TOKENS = 4  # vLLM's: shorter prompts or answers are skipped
MAX_SHAREGPT_PROMPT_TOKENS = 1024  # vLLM's: longer prompts are skipped
MAX_SHAREGPT_TOTAL_TOKENS = 2048  # vLLM's: longer prompt + answer pairs are skipped
PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclasses.dataclass
class Request:
    """One benchmark request: a text or token-id prompt, its length in tokens, and the number
    of tokens to generate."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclasses.dataclass
class Outcome:
    """What the client saw of one request. Times are `time.perf_counter()` seconds; `chunk_times`
    are the arrival times of the streamed chunks that carry a choice."""

    request: Request
    start: float
    end: float = 0.0
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


# -- datasets -------------------------------------------------------------------------------------


def random_requests(n, input_len, output_len, vocab, rng) -> list[Request]:
    """`n` prompts of `input_len` token ids drawn uniformly from [10, vocab) (ids below 10 are
    special tokens in common vocabularies)."""
    return [Request(rng.integers(10, vocab, input_len).tolist(), input_len, output_len)
            for _ in range(n)]


def shared_prefix_requests(n, prefix_len, input_len, output_len, vocab, rng) -> list[Request]:
    """`n` prompts: one random `prefix_len`-id prefix shared by all, then `input_len` random ids
    of each prompt's own."""
    prefix = rng.integers(10, vocab, prefix_len).tolist()
    return [Request(prefix + r.prompt, prefix_len + input_len, output_len)
            for r in random_requests(n, input_len, output_len, vocab, rng)]


def sharegpt_requests(n, path, tokenizer, max_model_len, fixed_output_len, rng,
                      max_prompt_len=MAX_SHAREGPT_PROMPT_TOKENS,
                      max_total_len=MAX_SHAREGPT_TOTAL_TOKENS) -> list[Request]:
    """`n` text prompts from a ShareGPT file (None: every one that passes), as vLLM samples
    them: conversations in a seeded random order; the output length is the answer's token
    count (or `fixed_output_len`); a conversation is skipped when its prompt or output length
    is below MIN_SHAREGPT_TOKENS, its prompt exceeds `max_prompt_len`, or prompt + output
    exceeds `max_total_len` or `max_model_len` tokens (vLLM's benchmark: 1,024 and 2,048).

    Raises:
      SystemExit: fewer than `n` conversations pass.
    """
    pairs = prompt_answer_pairs(path)
    total = min(max_total_len, max_model_len)
    out = []
    for i in rng.permutation(len(pairs)):
        prompt, answer = pairs[i]
        prompt_len = len(tokenizer.encode(prompt))
        # Without special tokens: the answer is generated after the prompt, with no BOS of its own.
        output_len = fixed_output_len or len(tokenizer.encode(answer, add_special_tokens=False))
        too_short = min(prompt_len, output_len) < MIN_SHAREGPT_TOKENS
        if too_short or prompt_len > max_prompt_len or prompt_len + output_len > total:
            continue
        out.append(Request(prompt, prompt_len, output_len))
        if len(out) == n:
            return out
    if n is None:
        return out
    raise SystemExit(f"{path}: only {len(out)} of {len(pairs)} conversations fit "
                     f"(>= {MIN_SHAREGPT_TOKENS} tokens each side, a prompt <= {max_prompt_len}, "
                     f"<= {total} in all); {n} needed")


def load_tokenizer(folder):
    """`transformers.AutoTokenizer` from `folder`, or the default jaxserve model's tokenizer
    when `folder` is None."""
    if folder is None:
        # jaxserve is only needed here: the benchmark itself talks to any server.
        from jaxserve.model_loader import default_tokenizer

        return default_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def sample_requests(args, n, tokenizer, vocab, max_model_len, rng) -> list[Request]:
    """`n` requests of the dataset `args.dataset_name`."""
    if args.dataset_name == "random":
        return random_requests(n, args.input_len, args.output_len, vocab, rng)
    if args.dataset_name == "shared-prefix":
        return shared_prefix_requests(n, args.prefix_len, args.input_len, args.output_len, vocab,
                                      rng)
    return sharegpt_requests(n, args.dataset_path, tokenizer, max_model_len,
                             args.sharegpt_output_len, rng, args.sharegpt_max_prompt_len,
                             args.sharegpt_max_total_len)


def arrival_offsets(n, rate, rng) -> np.ndarray:
    """Send times of `n` requests in s from the start: a Poisson process of `rate` requests/s
    (exponential gaps, the first request at 0); all 0 when `rate` is infinite."""
    if math.isinf(rate):
        return np.zeros(n)
    return np.concatenate([[0.0], np.cumsum(rng.exponential(1 / rate, n - 1))])


# -- the server -----------------------------------------------------------------------------------


async def server_model(session, base_url) -> dict:
    """The first model card of `GET /v1/models` (jaxserve and vLLM add `max_model_len`)."""
    async with session.get(f"{base_url}/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]


def parse_metrics(text) -> dict[str, float]:
    """Prometheus text as {sample name without its `prefix:`: value summed over label sets}
    (`jaxserve:generation_tokens_total` and `vllm:generation_tokens_total` both read
    `generation_tokens_total`).

    Raises:
      ValueError: not Prometheus text.
    """
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.rsplit(":", 1)[-1]
            out[name] = out.get(name, 0.0) + s.value
    return out


async def read_metrics(session, base_url) -> dict[str, float] | None:
    """`GET /metrics` through `parse_metrics`; None when the server has no /metrics or does not
    answer with Prometheus text."""
    try:
        async with session.get(f"{base_url}/metrics") as resp:
            if resp.status != 200:
                return None
            return parse_metrics(await resp.text())
    except (aiohttp.ClientError, ValueError):
        return None


def counter_delta(before, after, name) -> float | None:
    """How much counter `name` rose between two `read_metrics` readings; None when /metrics or
    the counter is missing at the end. A labelled counter has no sample before its first
    increment, so one missing at the start counts as 0."""
    if before is None or after is None or name not in after:
        return None
    return after[name] - before.get(name, 0.0)


async def sample_load(session, base_url, t0, period, samples) -> None:
    """Append (s since `t0`, num_requests_running, num_requests_waiting) to `samples` every
    `period` s from `/metrics`, until cancelled; a reading that fails is skipped."""
    while True:
        m = await read_metrics(session, base_url)
        if m is not None:
            samples.append((time.perf_counter() - t0, m.get("num_requests_running", 0.0),
                            m.get("num_requests_waiting", 0.0)))
        await asyncio.sleep(period)


async def one_request(session, url, model, req: Request) -> Outcome:
    """Send one streaming completion and time its chunks; never raises: a failure is recorded
    in `Outcome.error`."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    out = Outcome(req, start=time.perf_counter())
    done = False
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    out.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                    return out
                # A chunk with a choice carries one or more tokens, even when their text is
                # empty (bytes of an unfinished character): it counts for TTFT and ITL, as in vLLM.
                if chunk.get("choices"):
                    out.chunk_times.append(time.perf_counter())
                if chunk.get("usage"):
                    out.output_tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # whatever goes wrong, one request's failure must not end the run
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.end = time.perf_counter()
    if not done:
        out.error = "the stream ended before [DONE]"
    elif not out.chunk_times:
        out.error = "the stream carried no token"
    elif not out.output_tokens:
        # A server that ignores stream_options: one token per chunk is the best estimate.
        out.output_tokens = len(out.chunk_times)
    return out


async def send_all(session, url, model, requests, offsets, max_concurrency, t0,
                   desc) -> list[Outcome]:
    """Send `requests[i]` at `t0 + offsets[i]` (perf_counter s), at most `max_concurrency` in
    flight (None: no cap); a request's timing starts once it has a slot, as in vLLM. `model`
    names the model, or several separated by commas, taken in turn (LoRA adapters, spread
    evenly). Shows a progress bar labelled `desc` on stderr."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = tqdm(total=len(requests), desc=desc, unit="req")

    models = model.split(",")

    async def scheduled(i, req, offset):
        await asyncio.sleep(t0 + offset - time.perf_counter())
        async with limit:
            outcome = await one_request(session, url, models[i % len(models)], req)
        bar.update()
        return outcome

    try:
        return await asyncio.gather(*(scheduled(i, r, o)
                                      for i, (r, o) in enumerate(zip(requests, offsets))))
    finally:
        bar.close()


# -- metrics --------------------------------------------------------------------------------------


def tpot_s(ttft_s, latency_s, output_tokens) -> float:
    """Time per output token after the first, s (vLLM's TPOT); needs output_tokens > 1."""
    return (latency_s - ttft_s) / (output_tokens - 1)


def latency_stats(name, values_s) -> dict[str, float | None]:
    """{mean,p50,p90,p99}_<name>_ms of `values_s` (seconds); None each when there are none."""
    v = np.asarray(values_s, dtype=float) * 1000
    stats = {f"mean_{name}_ms": float(v.mean()) if v.size else None}
    for q in PERCENTILES:
        stats[f"p{q}_{name}_ms"] = float(np.percentile(v, q)) if v.size else None
    return stats


def client_metrics(outcomes: list[Outcome], t0, duration) -> dict:
    """vLLM's serving metrics of the outcomes of a timed window of `duration` s that began at
    perf_counter `t0`, plus the per-request arrays (module docstring)."""
    ok = [o for o in outcomes if not o.error]
    ttft = [o.chunk_times[0] - o.start for o in ok]
    e2el = [o.end - o.start for o in ok]
    tpot = [tpot_s(t, lat, o.output_tokens) for o, t, lat in zip(ok, ttft, e2el)
            if o.output_tokens > 1]
    itls = [np.diff(o.chunk_times).tolist() if not o.error else [] for o in outcomes]
    total_in = sum(o.request.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    failed = [o.error for o in outcomes if o.error]
    result = {
        "duration_s": duration,
        "num_prompts": len(outcomes),
        "completed": len(ok),
        "failed": len(failed),
        "first_error": failed[0] if failed else None,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    for name, values in zip(LATENCY_METRICS, (ttft, tpot, [x for i in itls for x in i], e2el)):
        result.update(latency_stats(name, values))
    result.update({
        "start_times_s": [o.start - t0 for o in outcomes],
        "input_lens": [o.request.prompt_len for o in outcomes],
        "output_lens": [o.output_tokens if not o.error else 0 for o in outcomes],
        "ttfts_s": [o.chunk_times[0] - o.start if not o.error else None for o in outcomes],
        "latencies_s": [o.end - o.start if not o.error else None for o in outcomes],
        "itls_s": itls,
        "errors": [o.error for o in outcomes],
    })
    return result


def server_metrics(before, after, samples) -> dict:
    """The server's own counts over the timed window: counter deltas and the load samples."""
    peak = max((r + w for _, r, w in samples), default=None)
    return {
        "server_generation_tokens": counter_delta(before, after, "generation_tokens_total"),
        "server_prompt_tokens": counter_delta(before, after, "prompt_tokens_total"),
        "server_prefix_cache_hits": counter_delta(before, after, "prefix_cache_hits_total"),
        "server_prefix_cache_queries": counter_delta(before, after, "prefix_cache_queries_total"),
        "server_peak_running_waiting": peak,
        "server_load_samples": {"t_s": [s[0] for s in samples], "running": [s[1] for s in samples],
                                "waiting": [s[2] for s in samples]},
    }


# -- the run --------------------------------------------------------------------------------------


async def benchmark(args) -> dict:
    """Resolve the settings against the server, warm up, run the timed window; the result
    (module docstring) without `date` and `command`."""
    timeout = aiohttp.ClientTimeout(total=None)
    # aiohttp's default connector allows 100 connections: requests above that would wait inside
    # the client and the wait would be counted as TTFT. --max-concurrency is the only cap.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        card = await server_model(session, args.base_url)
        model = args.model or card["id"]
        max_model_len = args.max_model_len or card.get("max_model_len") or DEFAULT_MAX_MODEL_LEN
        needs_tokenizer = args.dataset_name == "sharegpt" or (args.tokenizer and not args.vocab)
        tokenizer = load_tokenizer(args.tokenizer) if needs_tokenizer else None
        vocab = args.vocab or (len(tokenizer) if args.tokenizer else DEFAULT_VOCAB)
        seeds = np.random.SeedSequence(args.seed).spawn(2)
        data_rng, arrival_rng = map(np.random.default_rng, seeds)
        every = args.num_prompts == 0  # sharegpt: every conversation that passes
        requests = sample_requests(args, None if every else args.num_warmup + args.num_prompts,
                                   tokenizer, vocab, max_model_len, data_rng)
        warmup, timed = requests[:args.num_warmup], requests[args.num_warmup:]
        offsets = arrival_offsets(len(timed), args.request_rate, arrival_rng)
        url = f"{args.base_url}/v1/completions"

        if warmup:
            await send_all(session, url, model, warmup, np.zeros(len(warmup)),
                           args.max_concurrency, time.perf_counter(), "warm-up")
        before = await read_metrics(session, args.base_url)
        samples = []
        t0 = time.perf_counter()
        sampler = (asyncio.create_task(sample_load(session, args.base_url, t0,
                                                   args.metrics_interval, samples))
                   if before is not None else None)
        outcomes = await send_all(session, url, model, timed, offsets, args.max_concurrency, t0,
                                  "timed")
        duration = time.perf_counter() - t0
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        after = await read_metrics(session, args.base_url)

    settings = vars(args) | {"model": model, "vocab": vocab, "max_model_len": max_model_len,
                             # JSON has no infinity.
                             "request_rate": "inf" if math.isinf(args.request_rate)
                             else args.request_rate}
    return ({"settings": settings} | client_metrics(outcomes, t0, duration)
            | server_metrics(before, after, samples))


# -- output ---------------------------------------------------------------------------------------


def fmt(x, digits=0) -> str:
    """`x` with `digits` decimals, "n/a" for None."""
    return "n/a" if x is None else f"{x:.{digits}f}"


def report(r) -> str:
    """The markdown summary: the headline table (its first five columns as the earlier
    bench_serving printed them), the latency table and the client / server cross-check."""
    s = r["settings"]
    n = max(r["completed"], 1)
    n_req = r["num_prompts"]
    lines = [
        f"model {s['model']}, {s['dataset_name']}: {r['num_prompts']} requests x "
        f"({r['total_input_tokens'] / n:.0f} in, {r['total_output_tokens'] / n:.0f} out, mean), "
        f"request rate {s['request_rate']}/s, "
        f"max concurrency {s['max_concurrency'] or 'unlimited'}, {r['duration_s']:.1f} s",
        "",
        "| output tok/s | total tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms "
        "| req/s | E2EL p50 / p99 ms | completed | failed |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {r['output_throughput']:.0f} | {r['total_token_throughput']:.0f} "
        f"| {fmt(r['p50_ttft_ms'])} / {fmt(r['p99_ttft_ms'])} "
        f"| {fmt(r['p50_tpot_ms'], 1)} / {fmt(r['p99_tpot_ms'], 1)} "
        f"| {fmt(r['p50_itl_ms'], 1)} / {fmt(r['p99_itl_ms'], 1)} | {r['request_throughput']:.2f} "
        f"| {fmt(r['p50_e2el_ms'])} / {fmt(r['p99_e2el_ms'])} | {r['completed']} | {r['failed']} |",
        "",
        "| ms | mean | p50 | p90 | p99 |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in LATENCY_METRICS:
        lines.append(f"| {name.upper()} | " + " | ".join(
            fmt(r[f"{stat}_{name}_ms"], 1) for stat in ("mean", "p50", "p90", "p99")) + " |")
    lines += [
        "",
        "| timed window | client | server /metrics |",
        "|---|---:|---:|",
        f"| output tokens | {r['total_output_tokens']} | {fmt(r['server_generation_tokens'])} |",
        f"| prompt tokens | {r['total_input_tokens']} | {fmt(r['server_prompt_tokens'])} |",
        f"| prefix cache hits / queries (tokens) | | {fmt(r['server_prefix_cache_hits'])} / "
        f"{fmt(r['server_prefix_cache_queries'])} |",
        f"| peak running + waiting | {min(s['max_concurrency'] or n_req, n_req)} (cap) "
        f"| {fmt(r['server_peak_running_waiting'])} |",
    ]
    if r["failed"]:
        lines += ["", f"{r['failed']} requests failed; the first: {r['first_error']}"]
    return "\n".join(lines)


def output_rate(r, bin_s=1.0) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens/s over the timed window in `bin_s`-second bins: (bin edges s, rate per bin).
    A request's output tokens are spread evenly over its streamed chunks (a chunk can carry
    several tokens; only the total is reported, in `usage`)."""
    times, weights = [], []
    for start, ttft, itl, n in zip(r["start_times_s"], r["ttfts_s"], r["itls_s"], r["output_lens"]):
        if ttft is None:
            continue
        chunks = start + ttft + np.concatenate([[0.0], np.cumsum(itl)])
        times.append(chunks)
        weights.append(np.full(len(chunks), n / len(chunks)))
    edges = np.arange(0.0, r["duration_s"] + bin_s, bin_s)
    counts, _ = np.histogram(np.concatenate(times or [[]]), edges,
                             weights=np.concatenate(weights or [[]]))
    return edges, counts / bin_s


def plot_cdf(ax, values_s, title) -> None:
    """The empirical CDF of `values_s` (s) in ms on `ax`."""
    values = [v * 1000 for v in values_s if v is not None]
    if values:
        ax.ecdf(values)
    ax.set(title=title, xlabel="ms", ylabel="fraction of samples")
    ax.grid(alpha=0.3)


def plot_result(r, path) -> None:
    """A PNG at `path`: CDFs of TTFT, TPOT, ITL and E2EL, output tokens/s over time, and the
    server's running / waiting requests over time."""
    # Imported here: only --result-dir needs matplotlib, and Agg must be chosen before pyplot.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [(t, lat, n) for t, lat, n in zip(r["ttfts_s"], r["latencies_s"], r["output_lens"])
          if t is not None]
    tpot = [tpot_s(t, lat, n) for t, lat, n in ok if n > 1]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    plot_cdf(axes[0, 0], r["ttfts_s"], "TTFT")
    plot_cdf(axes[0, 1], tpot, "TPOT")
    plot_cdf(axes[0, 2], [x for itl in r["itls_s"] for x in itl], "ITL")
    plot_cdf(axes[1, 0], r["latencies_s"], "E2E latency")
    edges, rate = output_rate(r)
    axes[1, 1].stairs(rate, edges)
    axes[1, 1].set(title="output throughput (1 s bins)", xlabel="s", ylabel="tokens/s")
    load = r["server_load_samples"]
    # Stacked, so that the top edge is running + waiting.
    axes[1, 2].stackplot(load["t_s"], load["running"], load["waiting"],
                         labels=("running", "waiting"))
    axes[1, 2].set(title="server requests (/metrics samples)", xlabel="s", ylabel="requests")
    axes[1, 2].legend(loc="upper right")
    s = r["settings"]
    fig.suptitle(f"{s['model']}, {s['dataset_name']}, {r['num_prompts']} requests, rate "
                 f"{s['request_rate']}/s, max concurrency {s['max_concurrency'] or 'unlimited'}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def save_result(r, result_dir, name) -> None:
    """`result_dir/name.json` and `result_dir/name.png`."""
    folder = pathlib.Path(result_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(r))
    plot_result(r, folder / f"{name}.png")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="default: %(default)s")
    ap.add_argument("--model", default=None, help=(
        "default: the server's first model; several names separated by commas are taken in "
        "turn (requests spread evenly over LoRA adapters)"))
    ap.add_argument("--dataset-name", choices=("random", "sharegpt", "shared-prefix"),
                    default="random", help="default: %(default)s")
    ap.add_argument("--dataset-path", default=str(SAMPLE),
                    help="sharegpt: a ShareGPT-format file (default: the repo's sample)")
    ap.add_argument("--num-prompts", type=int, default=256,
                    help="timed requests; 0 with sharegpt: every conversation that passes the "
                         "filter, the warm-ups among them (default: %(default)s)")
    ap.add_argument("--input-len", type=int, default=1000,
                    help="random, shared-prefix: prompt tokens after the prefix "
                         "(default: %(default)s)")
    ap.add_argument("--output-len", type=int, default=1000,
                    help="random, shared-prefix: output tokens (default: %(default)s)")
    ap.add_argument("--prefix-len", type=int, default=1000,
                    help="shared-prefix: tokens of the shared prefix (default: %(default)s)")
    ap.add_argument("--sharegpt-output-len", type=int, default=None,
                    help="sharegpt: this output length for every request instead of the answer's")
    ap.add_argument("--sharegpt-max-prompt-len", type=int, default=MAX_SHAREGPT_PROMPT_TOKENS,
                    help="sharegpt: longer prompts are skipped (default: %(default)s, vLLM's)")
    ap.add_argument("--sharegpt-max-total-len", type=int, default=MAX_SHAREGPT_TOTAL_TOKENS,
                    help="sharegpt: longer prompt + answer pairs are skipped (default: "
                         "%(default)s, vLLM's; also at most --max-model-len)")
    ap.add_argument("--vocab", type=int, default=None,
                    help=f"random ids are drawn below this (default: the size of --tokenizer "
                         f"if given, else {DEFAULT_VOCAB})")
    ap.add_argument("--tokenizer", default=None,
                    help="a tokenizer folder (transformers) to count sharegpt tokens "
                         "(default: jaxserve's default model's)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="sharegpt: longer conversations are skipped (default: the server's "
                         f"/v1/models max_model_len, else {DEFAULT_MAX_MODEL_LEN})")
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="requests/s, Poisson arrivals; inf: all at once (default: %(default)s)")
    ap.add_argument("--max-concurrency", type=int, default=None,
                    help="requests in flight at most (default: no cap)")
    ap.add_argument("--num-warmup", type=int, default=4,
                    help="untimed requests before the timed ones, 0 for none "
                         "(default: %(default)s)")
    ap.add_argument("--metrics-interval", type=float, default=0.5,
                    help="seconds between /metrics load samples during the run "
                         "(default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seeds the prompts and the arrival times (default: %(default)s)")
    ap.add_argument("--result-dir", default=None, help="write <name>.json and <name>.png here")
    ap.add_argument("--result-name", default=None,
                    help="default: <dataset>-<local time YYYYmmdd-HHMMSS>")
    args = ap.parse_args(argv)
    if args.num_prompts < 0 or (args.num_prompts == 0 and args.dataset_name != "sharegpt"):
        ap.error("--num-prompts must be at least 1 (0 only with --dataset-name sharegpt)")
    return args


def main():
    args = parse_args()
    date = datetime.datetime.now().astimezone()
    result = {"date": date.isoformat(timespec="seconds"), "command": shlex.join(sys.argv)}
    result |= asyncio.run(benchmark(args))
    print(report(result))
    if args.result_dir:
        name = args.result_name or f"{args.dataset_name}-{date:%Y%m%d-%H%M%S}"
        save_result(result, args.result_dir, name)


if __name__ == "__main__":
    main()
