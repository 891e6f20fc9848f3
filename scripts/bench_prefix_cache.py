"""Time to first token on a shared-prefix workload, prefix caching on vs off.

--num-requests requests (default 32) share one --prefix-len-token system prompt (default 1,000
tokens of ShareGPT text, --dataset) followed by a distinct ShareGPT question each (--tail-len tokens); all
arrive at once. The offline EngineCore runs them in process (no HTTP), greedy, --max-tokens
each; TTFT is measured from submission to the step that returns a request's first token. Each
setting gets a fresh engine built with its own enable_prefix_caching flag and one warm-up request
that shares nothing with the workload.

  python scripts/bench_prefix_cache.py            # CPU defaults: budget 512, 32 seqs
  python scripts/bench_prefix_cache.py --max-num-batched-tokens 2048 --max-model-len 2048
"""

import argparse
import statistics
import time

from sharegpt import SAMPLE, first_turns

from jaxserve.config import EngineConfig
from jaxserve.engine import EngineCoreRequest
from jaxserve.engine.core import EngineCore
from jaxserve.sampling_params import SamplingParams

def build_workload(dataset, tokenizer, n, prefix_len, tail_len):
    it = (t.strip() for t in first_turns(dataset) if t.strip())
    prefix: list[int] = []
    while len(prefix) < prefix_len:
        prefix += tokenizer.encode(next(it) + "\n\n", add_special_tokens=False)
    prefix = prefix[:prefix_len]
    tails = []
    while len(tails) < n + 1:
        ids = tokenizer.encode("\n\nQuestion: " + next(it), add_special_tokens=False)[:tail_len]
        if len(ids) == tail_len:
            tails.append(ids)
    return [prefix + t for t in tails[:n]], tails[n]


def measure(args, caching: bool):
    engine = EngineCore(EngineConfig(
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, kv_cache_gib=args.kv_cache_gib,
        enable_prefix_caching=caching), log=lambda s: None)
    prompts, warm = build_workload(args.dataset, engine.tokenizer, args.num_requests, args.prefix_len, args.tail_len)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    engine.add_request(EngineCoreRequest("warm", warm, sp))
    while engine.has_unfinished_requests():
        engine.step()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(EngineCoreRequest(str(i), p, sp))
    ttft, cached, outputs = {}, {}, {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            ttft.setdefault(o.request_id, now - t0)
            cached[o.request_id] = o.num_cached_tokens
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    total = time.perf_counter() - t0
    t = sorted(ttft.values())
    return {"mean": statistics.mean(t), "p50": t[len(t) // 2],
            "p99": t[min(len(t) - 1, int(len(t) * 0.99))], "total": total,
            "cached": sum(cached.values()), "stats": engine.get_stats(), "outputs": outputs}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--tail-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--dataset", default=str(SAMPLE),
                    help="ShareGPT JSON file (default: the repo's sample, data/)")
    args = ap.parse_args()
    res = {}
    for caching in (True, False):
        r = res[caching] = measure(args, caching)
        print(f"prefix caching {'on ' if caching else 'off'}: TTFT mean {r['mean']:.2f} s, "
              f"p50 {r['p50']:.2f} s, p99 {r['p99']:.2f} s; all done in {r['total']:.2f} s; "
              f"cached prompt tokens {r['cached']} (hits {r['stats'].prefix_cache_hits} / "
              f"queries {r['stats'].prefix_cache_queries})", flush=True)
    on, off = res[True], res[False]
    same = sum(on["outputs"][k] == off["outputs"][k] for k in on["outputs"])
    print(f"TTFT ratio off/on: mean {off['mean'] / on['mean']:.2f}x, p50 {off['p50'] / on['p50']:.2f}x; "
          f"{same}/{len(on['outputs'])} greedy outputs token-identical between the two")


if __name__ == "__main__":
    main()
