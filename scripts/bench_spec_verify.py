"""The verify step's cost against a plain decode step: ms per engine step at batch B with k
drafts per sequence, through an in-process engine.

    python scripts/bench_spec_verify.py --model llama-3.1-8b --load-format dummy \
        --k 0,2,4,8 --batch 1,16,64,256 --prompt-len 1000 --steps 30

For each k (0: the plain engine, no `speculative_config`), one engine in a process of its own
(each allocates the device's KV pool); for each batch size B, B requests of `--prompt-len`
random tokens, greedy with `ignore_eos`, stepped until every one decodes, then `--steps` engine
steps timed from the host (what a user waits, async scheduling included). With k > 0 the engine
speculates by n-gram (`disable_by_batch_size` at the largest B, so no batch turns it off):
every decoding sequence gets k draft slots, which the step fills by its lookup or leaves as
fillers (docs/spec_decode.md), so a step's cost is that of k drafts whether or not they are
accepted. The printed
ratio is the step's time over the plain engine's at the same B: the mean number of tokens a
sequence must emit per verify step (the acceptance length) for speculation to break even.
"""

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from profile_engine import add_engine_args, add_requests, engine_flags, finish, run_until_decoding


def measure(args, k: int) -> list[dict]:
    """Rows {k, batch, ms_per_step, drafts_per_step} of one engine."""
    from jaxserve import LLM

    batches = [int(b) for b in args.batch.split(",")]
    spec = None
    if k:
        spec = {"method": "ngram", "num_speculative_tokens": k,
                "disable_by_batch_size": max(batches)}
    llm = LLM(args.model, load_format=args.load_format, speculative_config=spec,
              log=lambda s: print(f"[engine k={k}] {s}", file=sys.stderr, flush=True),
              **engine_flags(args))
    scheduler = llm.engine.scheduler
    slots = [0]  # draft slots scheduled

    def schedule(schedule=scheduler.schedule):
        out = schedule()
        slots[0] += sum(map(len, out.scheduled_spec_decode_tokens.values()))
        return out

    scheduler.schedule = schedule
    rng = np.random.default_rng(args.seed)
    rows = []
    for b in batches:
        # enough output tokens that no sequence ends (nor caps its drafts) inside the window
        max_tokens = 8 + (args.steps + 8) * (k + 1) + 16
        ids = add_requests(llm, rng, b, args.prompt_len, max_tokens, f"b{b}")
        run_until_decoding(llm, b)
        for _ in range(3):  # the shapes of the timed steps, once
            llm.engine.step()
        drafts0 = slots[0]
        t0 = time.perf_counter()
        for _ in range(args.steps):
            llm.engine.step()
        seconds = time.perf_counter() - t0
        rows.append({"k": k, "batch": b, "ms_per_step": 1e3 * seconds / args.steps,
                     "drafts_per_step": (slots[0] - drafts0) / args.steps})
        finish(llm, ids)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(ap)
    ap.add_argument("--k", default="0,2,4,8", help="drafts per sequence; 0: the plain engine")
    ap.add_argument("--batch", default="1,16,64,256")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--one-k", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_k is not None:
        print(json.dumps(measure(args, args.one_k)))
        return
    # Each k's rows as soon as its engine is done (k = 0 first gives the ratios), so that a run
    # cut short still reports what it measured.
    print(f"{'k':>3} {'batch':>6} {'ms/step':>9} {'drafts/step':>12} {'vs plain':>9}", flush=True)
    plain = {}
    for k in (int(k) for k in args.k.split(",")):
        child = subprocess.run([sys.executable, *sys.argv, "--one-k", str(k)],
                               stdout=subprocess.PIPE, text=True, check=True)
        for r in json.loads(child.stdout.strip().splitlines()[-1]):
            if r["k"] == 0:
                plain[r["batch"]] = r["ms_per_step"]
            ratio = r["ms_per_step"] / plain[r["batch"]] if r["batch"] in plain else float("nan")
            print(f"{r['k']:>3} {r['batch']:>6} {r['ms_per_step']:>9.2f} "
                  f"{r['drafts_per_step']:>12.1f} {ratio:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
