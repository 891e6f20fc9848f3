"""Batch-1 decode speed with n-gram, draft-model and EAGLE speculative decoding against the plain
engine.

The requests of data/spec_decode_prompts.json (repeat, correct or summarise a given paragraph:
their outputs copy their input) run one at a time, greedy, --max-tokens each, through the
offline ``LLM`` (chat template applied), on engines of the same limits: plain (async
scheduling, the default), plain with --no-async-scheduling (what running synchronously costs by
itself: with a draft model or an EAGLE head the engine runs the steps that may carry drafts
synchronously; n-gram steps make their drafts on the device and keep async scheduling,
docs/spec_decode.md), n-gram speculation (an engine for each k of --num-speculative-tokens 4,8)
and, with --draft-model, the draft_model method (greedy drafts of that model, e.g. the default
model's first layers: ``checkpoints_tools.convert --num-layers``), with --eagle / --eagle3
those methods with that head (``scripts/make_eagle_head.py`` writes a random one for the
model's shapes). All are built first and each runs one warm-up request; then each
request runs on each in turn, --repeats times, so that load from other jobs on a shared
machine falls on all alike. Reported per engine: output tokens / wall time of its
requests (tok/s), the speedup over plain, its ``EngineCore.step`` calls (prefill chunks
included; with async scheduling one more a request, its last call only collecting) and the
wall time a call (what running synchronously and verifying drafts cost a step, beside how many
steps speculation saves), of which the model runner's ``execute`` (building the step's inputs
and dispatching it) and its ``get_output`` (waiting for the device, then the host's share; the
rest of a call schedules and applies the tokens), and for each method the mean acceptance
length (1 + accepted drafts / sequence-steps that verified drafts, vLLM's definition) and how
many outputs equal the plain engine's token for token.

  python scripts/bench_spec_decode.py                       # k = 4, lookup 2..4, 64 tokens
  python scripts/bench_spec_decode.py --num-speculative-tokens 4,8     # n-gram at k = 4 and 8
  python scripts/bench_spec_decode.py --draft-model /tmp/smollm2-4-layers  # adds draft_model
  python scripts/bench_spec_decode.py --eagle3 smollm2-eagle3-head         # adds eagle3
"""

import argparse
import json
import os
import pathlib
import time

from jaxserve import LLM, SamplingParams
from jaxserve.engine import kv_sizing

REQUESTS = pathlib.Path(__file__).resolve().parents[1] / "data" / "spec_decode_prompts.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-speculative-tokens", default="4",
                    type=lambda v: [int(k) for k in v.split(",")],
                    help="k, or several (4,8): an n-gram engine for each (the other methods "
                         "take the first)")
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--draft-model", default=None, help="adds the draft_model method with it")
    ap.add_argument("--eagle", default=None, help="adds the eagle method with this head")
    ap.add_argument("--eagle3", default=None, help="adds the eagle3 method with this head")
    args = ap.parse_args()
    prompts = [r["prompt"] for r in json.loads(REQUESTS.read_text())]
    limits = dict(max_num_seqs=1, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.max_model_len, kv_cache_gib=0.25, log=lambda s: None)
    ks = args.num_speculative_tokens
    configs = [("plain", {}), ("plain, synchronous", {"async_scheduling": False})] + [
        ("ngram" if len(ks) == 1 else f"ngram k={k}", {"speculative_config": {
            "method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min}}) for k in ks]
    for method, model in (("draft_model", args.draft_model), ("eagle", args.eagle),
                          ("eagle3", args.eagle3)):
        if model:
            configs.append((method, {"speculative_config": {
                "method": method, "model": model,
                "num_speculative_tokens": ks[0]}}))
    # On a GPU, engine i takes up to 0.9 (i + 1) / n of its memory: in one process each
    # engine's --gpu-memory-utilization counts what the earlier ones hold, and the allocator's
    # cap, fixed when the first starts, is set here for the sum.
    kv_sizing.configure_allocator(0.9, os.environ)
    engines = {name: LLM(args.model, **limits, **extra,
                         gpu_memory_utilization=0.9 * (i + 1) / len(configs))
               for i, (name, extra) in enumerate(configs)}
    methods = [name for name, extra in configs if extra.get("speculative_config")]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for llm in engines.values():
        llm.chat([{"role": "user", "content": "Say hello."}], greedy, use_tqdm=False)
    before = {m: engines[m].engine.get_stats().spec_decoding for m in methods}
    steps = dict.fromkeys(engines, 0)  # engine steps of the timed requests, prefill included
    spent = {name: {"execute": 0.0, "get_output": 0.0} for name in engines}  # seconds
    for name, llm in engines.items():
        llm.engine.step = _counted(llm.engine.step, steps, name)
        for part in spent[name]:
            setattr(llm.engine.runner, part,
                    _timed(getattr(llm.engine.runner, part), spent[name], part))
    seconds = dict.fromkeys(engines, 0.0)
    outputs = {name: [] for name in engines}
    for _ in range(args.repeats):
        for p in prompts:
            for name, llm in engines.items():
                start = time.perf_counter()
                out = llm.chat([{"role": "user", "content": p}], greedy, use_tqdm=False)
                seconds[name] += time.perf_counter() - start
                outputs[name].append(out[0].outputs[0].token_ids)
    plain_rate = sum(map(len, outputs["plain"])) / seconds["plain"]
    for name in engines:
        n_tok = sum(map(len, outputs[name]))
        rate = n_tok / seconds[name]
        print(f"{name:>20}: {n_tok} tokens in {seconds[name]:.1f} s, {rate:.1f} tok/s "
              f"({rate / plain_rate:.2f}x plain); {steps[name]} steps, "
              f"{1e3 * seconds[name] / steps[name]:.2f} ms a step call (execute "
              f"{1e3 * spent[name]['execute'] / steps[name]:.2f}, get_output "
              f"{1e3 * spent[name]['get_output'] / steps[name]:.2f})", flush=True)
    for m in methods:
        s, b = engines[m].engine.get_stats().spec_decoding, before[m]
        drafts = s.num_drafts - b.num_drafts
        accepted = s.num_accepted_tokens - b.num_accepted_tokens
        drafted = s.num_draft_tokens - b.num_draft_tokens
        per_pos = [x - y for x, y in zip(s.num_accepted_tokens_per_pos,
                                         b.num_accepted_tokens_per_pos)]
        same = sum(x == y for x, y in zip(outputs[m], outputs["plain"]))
        print(f"{m}: acceptance length {1 + accepted / max(drafts, 1):.2f} ({accepted} of "
              f"{drafted} draft tokens accepted in {drafts} verifications; per position "
              f"{per_pos}); outputs equal to plain: {same}/{len(outputs['plain'])}")


def _timed(fn, seconds: dict, key: str):
    """``fn`` that adds its wall time to ``seconds[key]`` each call."""
    def timed(*args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            seconds[key] += time.perf_counter() - start
    return timed


def _counted(step, counts: dict, name: str):
    """``step`` that adds one to ``counts[name]`` each call."""
    def counted():
        counts[name] += 1
        return step()
    return counted


if __name__ == "__main__":
    main()
