"""Batch-1 decode speed with n-gram speculative decoding against the plain engine, in one run.

The requests of data/spec_decode_prompts.json (repeat, correct or summarise a given paragraph:
their outputs copy their input) run one at a time, greedy, --max-tokens each, through the
offline ``LLM`` (chat template applied), on three engines of the same limits built one after
another: plain (async scheduling, the default), plain with --no-async-scheduling (what running
synchronously costs by itself: the engine runs the steps that may carry drafts synchronously,
docs/spec_decode.md), and n-gram speculation. Each engine first runs one warm-up request.
Reported per engine: output tokens / wall time of the requests (tok/s), and for n-gram the mean
acceptance length (1 + accepted drafts / sequence-steps that verified drafts, vLLM's definition)
and how many outputs equal the plain engine's token for token.

  python scripts/bench_spec_decode.py                       # k = 4, lookup 2..4, 64 tokens
  python scripts/bench_spec_decode.py --num-speculative-tokens 8 --max-tokens 128
"""

import argparse
import json
import pathlib
import time

from jaxserve import LLM, SamplingParams

REQUESTS = pathlib.Path(__file__).resolve().parents[1] / "data" / "spec_decode_prompts.json"


def run(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    """(seconds, token ids of each output) of the prompts run one at a time, greedy."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs, start = [], time.perf_counter()
    for p in prompts:
        out = llm.chat([{"role": "user", "content": p}], sp, use_tqdm=False)
        outputs.append(out[0].outputs[0].token_ids)
    return time.perf_counter() - start, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--max-tokens", type=int, default=64)
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
    results = {}
    for name, extra in (("plain", {}), ("plain, synchronous", {"async_scheduling": False}),
                        ("ngram", {"speculative_config": spec})):
        llm = LLM(args.model, **limits, **extra)
        llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=8),
                 use_tqdm=False)  # warm-up
        before = llm.engine.get_stats().spec_decoding
        seconds, outputs = run(llm, prompts, args.max_tokens)
        n_tok = sum(map(len, outputs))
        results[name] = outputs
        line = f"{name:>20}: {n_tok} tokens in {seconds:.1f} s, {n_tok / seconds:.1f} tok/s"
        if "speculative_config" in extra:
            s, b = llm.engine.get_stats().spec_decoding, before
            s = type(s)(s.num_drafts - b.num_drafts, s.num_draft_tokens - b.num_draft_tokens,
                        s.num_accepted_tokens - b.num_accepted_tokens,
                        [x - y for x, y in zip(s.num_accepted_tokens_per_pos,
                                               b.num_accepted_tokens_per_pos)])
            same = sum(a == b for a, b in zip(outputs, results["plain"]))
            line += (f"; acceptance length {1 + s.num_accepted_tokens / max(s.num_drafts, 1):.2f}"
                     f" ({s.num_accepted_tokens} of {s.num_draft_tokens} drafts accepted in "
                     f"{s.num_drafts} verifications; per position "
                     f"{s.num_accepted_tokens_per_pos}); outputs equal to plain: "
                     f"{same}/{len(outputs)}")
        print(line, flush=True)
        del llm


if __name__ == "__main__":
    main()
