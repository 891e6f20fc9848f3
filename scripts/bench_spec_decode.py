"""Batch-1 decode speed with n-gram speculative decoding against the plain engine, in one run.

The requests of data/spec_decode_prompts.json (repeat, correct or summarise a given paragraph:
their outputs copy their input) run one at a time, greedy, --max-tokens each, through the
offline ``LLM`` (chat template applied), on three engines of the same limits: plain (async
scheduling, the default), plain with --no-async-scheduling (what running synchronously costs by
itself: the engine runs the steps that may carry drafts synchronously, docs/spec_decode.md),
and n-gram speculation. All three are built first and each runs one warm-up request; then each
request runs on the three in turn, --repeats times, so that load from other jobs on a shared
machine falls on all three alike. Reported per engine: output tokens / wall time of its
requests (tok/s) and the speedup over plain, and for n-gram the mean acceptance length (1 +
accepted drafts / sequence-steps that verified drafts, vLLM's definition) and how many outputs
equal the plain engine's token for token.

  python scripts/bench_spec_decode.py                       # k = 4, lookup 2..4, 64 tokens
  python scripts/bench_spec_decode.py --num-speculative-tokens 8 --max-tokens 128
"""

import argparse
import json
import pathlib
import time

from jaxserve import LLM, SamplingParams

REQUESTS = pathlib.Path(__file__).resolve().parents[1] / "data" / "spec_decode_prompts.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    args = ap.parse_args()
    prompts = [r["prompt"] for r in json.loads(REQUESTS.read_text())]
    limits = dict(max_num_seqs=1, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.max_model_len, kv_cache_gib=0.25, log=lambda s: None)
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min}
    engines = {name: LLM(args.model, **limits, **extra) for name, extra in (
        ("plain", {}), ("plain, synchronous", {"async_scheduling": False}),
        ("ngram", {"speculative_config": spec}))}
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for llm in engines.values():
        llm.chat([{"role": "user", "content": "Say hello."}], greedy, use_tqdm=False)
    ngram = engines["ngram"].engine
    before = ngram.get_stats().spec_decoding
    seconds = dict.fromkeys(engines, 0.0)
    outputs = {name: [] for name in engines}
    for _ in range(args.repeats):
        for p in prompts:
            for name, llm in engines.items():
                start = time.perf_counter()
                out = llm.chat([{"role": "user", "content": p}], greedy, use_tqdm=False)
                seconds[name] += time.perf_counter() - start
                outputs[name].append(out[0].outputs[0].token_ids)
    s = ngram.get_stats().spec_decoding
    drafts = s.num_drafts - before.num_drafts
    accepted = s.num_accepted_tokens - before.num_accepted_tokens
    drafted = s.num_draft_tokens - before.num_draft_tokens
    per_pos = [a - b for a, b in zip(s.num_accepted_tokens_per_pos,
                                     before.num_accepted_tokens_per_pos)]
    plain_rate = sum(map(len, outputs["plain"])) / seconds["plain"]
    for name in engines:
        n_tok = sum(map(len, outputs[name]))
        rate = n_tok / seconds[name]
        print(f"{name:>20}: {n_tok} tokens in {seconds[name]:.1f} s, {rate:.1f} tok/s "
              f"({rate / plain_rate:.2f}x plain)", flush=True)
    same = sum(a == b for a, b in zip(outputs["ngram"], outputs["plain"]))
    print(f"ngram: acceptance length {1 + accepted / max(drafts, 1):.2f} ({accepted} of "
          f"{drafted} draft tokens accepted in {drafts} verifications; per position {per_pos}); "
          f"outputs equal to plain: {same}/{len(outputs['plain'])}")


if __name__ == "__main__":
    main()
