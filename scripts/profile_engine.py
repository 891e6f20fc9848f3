"""Profile the engine's steps on the device with ``jax.profiler`` and summarise the trace.

    python scripts/profile_engine.py --model llama-3.1-8b --load-format dummy \
        --batch 256 --prompt-len 1000 --steps 50 --out /tmp/prof

Runs ``--batch`` requests of ``--prompt-len`` random tokens through an in-process EngineCore
(engine defaults unless flags are given). With ``--phase decode`` (default) it first runs until
every request is decoding, then traces ``--steps`` engine steps; with ``--phase prefill`` it
traces from the first step (the prompts' prefill, then decode). The trace (Perfetto JSON, written
by ``jax.profiler.trace(create_perfetto_trace=True)`` under ``--out``) is then summarised: the
device's tracks (streams) and their event counts, the share of the traced window in which any
kernel or copy ran, and the kernels that took most of the time. (The profiler's Python tracing
slows the host several-fold, so the busy share understates a normal run; kernel times hold.) On the CPU backend the trace holds no
device tracks and only the host's time is printed.
"""

import argparse
import collections
import glob
import gzip
import json
import os
import time

import jax
import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.engine import EngineCoreRequest


def add_requests(llm: LLM, rng, batch: int, prompt_len: int, max_tokens: int, tag: str) -> list[str]:
    vocab = min(llm.engine.model_config.vocab_size, len(llm.tokenizer))
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for rid in ids:
        llm.engine.add_request(EngineCoreRequest(rid, rng.integers(10, vocab, prompt_len).tolist(), sp))
    return ids


def run_until_decoding(llm: LLM, batch: int, min_outputs: int = 8) -> None:
    """Step until ``batch`` requests run and each has at least ``min_outputs`` output tokens."""
    sched = llm.engine.scheduler
    while len(sched.running) < batch or min(r.num_output_tokens for r in sched.running) < min_outputs:
        llm.engine.step()


def finish(llm: LLM, ids: list[str]) -> None:
    llm.engine.abort_requests(ids)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def _intervals_union(iv: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for s, e in sorted(iv):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def summarize(trace_dir: str, top: int = 15) -> str:
    """Text summary of the newest Perfetto trace under trace_dir (times in ms)."""
    path = max(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
               key=os.path.getmtime)
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device = {pid for pid, name in procs.items() if name.startswith("/device:")}
    lines = [f"trace: {path}"]
    if not device:
        return "\n".join(lines + ["no device tracks (CPU backend): nothing to summarise"])
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e["pid"] in device:
            by_thread[threads.get((e["pid"], e["tid"]), str(e["tid"]))].append(e)
    for name, evs in sorted(by_thread.items()):
        lines.append(f"device thread {name!r}: {len(evs)} events")
    kernels = [e for evs in by_thread.values() for e in evs]
    if kernels:
        start = min(e["ts"] for e in kernels)
        end = max(e["ts"] + e["dur"] for e in kernels)
        busy = _intervals_union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
        lines.append(f"kernels: {len(kernels)} over {(end - start) / 1e3:.1f} ms, any kernel "
                     f"running {busy / (end - start):.1%} of it")
        per = collections.Counter()
        count = collections.Counter()
        for e in kernels:
            per[e["name"][:90]] += e["dur"]
            count[e["name"][:90]] += 1
        total = sum(per.values())
        for name, d in per.most_common(top):
            lines.append(f"  {d / 1e3:9.2f} ms {d / total:6.1%} x{count[name]:<6} {name}")
    return "\n".join(lines)


ENGINE_FLAGS = {"max_model_len": int, "max_num_seqs": int, "max_num_batched_tokens": int,
                "quantization": str, "kv_cache_dtype": str}


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """--model, --load-format, the scheduler limits and the number formats (unset: the
    engine's defaults)."""
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    for name, kind in ENGINE_FLAGS.items():
        ap.add_argument("--" + name.replace("_", "-"), type=kind, default=None)


def engine_flags(args: argparse.Namespace) -> dict:
    """The engine flags given on the command line, as LLM keyword arguments."""
    return {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(ap)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--out", default="/tmp/jaxserve_profile")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=15, help="how many kernels the summary lists")
    ap.add_argument("--speculative-config", type=json.loads, default=None,
                    help="as the server's flag (random prompts: n-gram drafts are mostly fillers)")
    args = ap.parse_args()
    llm = LLM(args.model, load_format=args.load_format, speculative_config=args.speculative_config,
              log=lambda s: print(f"[engine] {s}", flush=True), **engine_flags(args))
    rng = np.random.default_rng(args.seed)
    add_requests(llm, rng, args.batch, args.prompt_len, 16, "warm")
    while llm.engine.has_unfinished_requests():  # warm-up: the same shapes once
        llm.engine.step()
    ids = add_requests(llm, rng, args.batch, args.prompt_len, args.steps + 64, "prof")
    if args.phase == "decode":
        run_until_decoding(llm, args.batch)
    jax.block_until_ready(llm.engine.runner.k_cache)
    t0 = time.perf_counter()
    with jax.profiler.trace(args.out, create_perfetto_trace=True):
        for _ in range(args.steps):
            llm.engine.step()
        jax.block_until_ready(llm.engine.runner.k_cache)
    wall = (time.perf_counter() - t0) * 1e3
    finish(llm, ids)
    print(f"{args.steps} steps ({args.phase}, batch {args.batch}, prompt {args.prompt_len}): "
          f"{wall:.1f} ms wall under the profiler, {wall / args.steps:.2f} ms per step")
    print(summarize(args.out, args.top))


if __name__ == "__main__":
    main()
