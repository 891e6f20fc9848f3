"""Structured outputs' costs (docs/performance.md).

``mask``: the host's per-step work for N constrained sequences (default 64), as the engine
does it: ``StructuredOutputManager.grammar_bitmask`` (llguidance fills the N bitmask rows on
its threads) and the matchers' advance by one token each (``consume_token``, as
``Scheduler.update``). The sequences use the 10 bounded schemas of
tests/data/structured_schemas.json in turn; each walks its grammar by drawing an allowed token
at random (seeded) every step and starts over when its grammar is complete, so the steps cover
keys, strings, numbers, enums and arrays. It runs twice: with the schemas as they are (every
string has a maxLength, which llguidance compiles into a counted regex that its precomputed
token sets ("slices") do not cover) and with the maxLength bounds removed (strings as most
schemas, pydantic's among them, write them). No model is loaded (the default model's tokenizer
only).

``mixed``: wall time of 16 constrained + 16 unconstrained greedy chats against 32 unconstrained
ones, in the offline engine with the default model (one batch of 32), after a warm-up (the best
of ``--repeats``); then both again with async scheduling off (what running synchronously while
a constrained sequence is present would cost; docs/structured_outputs.md).

    python scripts/bench_structured.py mask --num-seqs 64 --steps 300
    python scripts/bench_structured.py mixed --max-tokens 64
"""

import argparse
import json
import pathlib
import statistics
import time

import msgspec
import numpy as np

from jaxserve.sampling_params import StructuredOutputsParams

SCHEMAS = json.loads((pathlib.Path(__file__).parents[1] / "tests" / "data"
                      / "structured_schemas.json").read_text())


def _without_max_length(schema):
    if isinstance(schema, dict):
        return {k: _without_max_length(v) for k, v in schema.items() if k != "maxLength"}
    if isinstance(schema, list):
        return [_without_max_length(v) for v in schema]
    return schema


def bench_mask(num_seqs: int, steps: int, seed: int) -> None:
    from jaxserve.model_loader.loader import load_tokenizer_of
    from jaxserve.structured_output.manager import StructuredOutputManager
    from jaxserve.tokenizer_io import TokenizerVocab

    tok = load_tokenizer_of(None)
    vocab = 49152
    manager = StructuredOutputManager(TokenizerVocab.of(tok), vocab, [tok.eos_token_id])
    for label, transform in (("strings with maxLength", lambda s: s),
                             ("strings without maxLength", _without_max_length)):
        print(f"{label}:")
        schemas = [transform(s["schema"]) for s in SCHEMAS]
        _walk(manager, [manager.grammar_init(StructuredOutputsParams(json=schemas[i % len(schemas)]))
                        for i in range(num_seqs)], vocab, steps, seed)


def _walk(manager, matchers, vocab: int, steps: int, seed: int) -> None:
    num_seqs = len(matchers)
    rng = np.random.default_rng(seed)
    fill_ms, consume_ms = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        mask = manager.grammar_bitmask(matchers)
        t1 = time.perf_counter()
        bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        picks = [int(rng.choice(np.flatnonzero(row))) for row in bits]
        t2 = time.perf_counter()
        for m, t in zip(matchers, picks):
            if m.is_stopped():
                m.reset()
            else:
                m.consume_token(t)
        t3 = time.perf_counter()
        fill_ms.append((t1 - t0) * 1e3)
        consume_ms.append((t3 - t2) * 1e3)
    for name, xs in (("grammar_bitmask", fill_ms), ("consume_token x N", consume_ms)):
        xs = sorted(xs[10:])  # the first steps warm llguidance's caches
        print(f"  {name:18s} {num_seqs} sequences: p50 {statistics.median(xs):.3f} ms, "
              f"p90 {xs[int(0.9 * len(xs))]:.3f} ms, max {xs[-1]:.3f} ms over {len(xs)} steps")


def bench_mixed(max_tokens: int, repeats: int) -> None:
    from jaxserve import LLM, SamplingParams
    from scripts.sharegpt import first_turns

    prompts = [[{"role": "user", "content": t[:300]}] for t in first_turns()[500:532]]
    plain = SamplingParams(max_tokens=max_tokens, temperature=0)
    constrained = [SamplingParams(max_tokens=max_tokens, temperature=0,
                                  structured_outputs=StructuredOutputsParams(json=s["schema"]))
                   for s in SCHEMAS]
    mixed = [plain] * 16 + [constrained[i % len(constrained)] for i in range(16)]
    llm = LLM(log=lambda s: None, max_model_len=1024, max_num_seqs=32,
              max_num_batched_tokens=256)

    def timed(sps):
        times, tokens = [], 0
        for _ in range(repeats):
            t = time.perf_counter()
            outs = llm.chat(prompts, sps, use_tqdm=False)
            times.append(time.perf_counter() - t)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return min(times), tokens

    timed(mixed)  # warm-up: compiles nothing new, fills llguidance's and XLA's caches
    base, base_tokens = timed([plain] * 32)
    both, both_tokens = timed(mixed)
    llm.engine.config = msgspec.structs.replace(llm.engine.config, async_scheduling=False)
    sync, _ = timed([plain] * 32)
    both_sync, _ = timed(mixed)
    print(f"32 unconstrained (async):  {base:.2f} s, {base_tokens} tokens")
    print(f"16 constrained + 16 plain: {both:.2f} s, {both_tokens} tokens "
          f"({both / base:.2f}x the unconstrained batch)")
    print(f"32 unconstrained (sync):   {sync:.2f} s ({sync / base:.2f}x)")
    print(f"16 constrained + 16 plain (sync): {both_sync:.2f} s ({both_sync / base:.2f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("mask")
    m.add_argument("--num-seqs", type=int, default=64)
    m.add_argument("--steps", type=int, default=300)
    m.add_argument("--seed", type=int, default=0)
    x = sub.add_parser("mixed")
    x.add_argument("--max-tokens", type=int, default=64)
    x.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.what == "mask":
        bench_mask(args.num_seqs, args.steps, args.seed)
    else:
        bench_mixed(args.max_tokens, args.repeats)


if __name__ == "__main__":
    main()
