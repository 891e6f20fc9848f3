"""The n-gram lookup's cost by prompt_lookup_max: compile time, time a call and memory of
``propose_on_device`` (docs/spec_decode.md, "Drafting: the n-gram method, on the device").

    python scripts/bench_ngram_lookup.py --rows 16 --width 1024 --prompt-lookup-max 5,64,1000

For each prompt_lookup_max, in a process of its own (stopped after --timeout seconds): the lookup
jitted alone for --rows sequences of --width tokens (the step's shapes: rows
``min(disable_by_batch_size, max_num_seqs)``, width ``max_model_len``), random tokens of a
4-token alphabet (matches everywhere) and lengths between width / 2 and width; prompt_lookup_min
2 and k 4. Reported: the compile time (s), the best mean of 5 runs of 20 calls (ms), XLA's
temporary bytes of the program (MiB) and the process's peak resident memory (MiB).
"""

import argparse
import json
import resource
import subprocess
import sys
import time


def measure(rows: int, width: int, max_n: int) -> dict:
    """One prompt_lookup_max's row of the table (module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.spec_decode.ngram_proposer import propose_on_device

    rng = np.random.default_rng(0)
    history = jnp.asarray(rng.integers(0, 4, (rows, width)), jnp.int32)
    lengths = jnp.asarray(rng.integers(width // 2, width, rows), jnp.int32)
    t = time.perf_counter()
    compiled = jax.jit(propose_on_device, static_argnums=(2, 3, 4)).lower(
        history, lengths, 4, min(2, max_n), max_n).compile()
    compile_s = time.perf_counter() - t
    jax.block_until_ready(compiled(history, lengths))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(20):
            out = compiled(history, lengths)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / 20)
    return {"prompt_lookup_max": max_n, "compile_s": round(compile_s, 2),
            "ms_per_call": round(best * 1e3, 3),
            "temp_mib": round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--prompt-lookup-max", default="5,64,1000",
                    type=lambda v: [int(n) for n in v.split(",")])
    ap.add_argument("--timeout", type=float, default=300, help="seconds for each value")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child's value
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.rows, args.width, args.one)))
        return
    for max_n in args.prompt_lookup_max:
        cmd = [sys.executable, __file__, "--rows", str(args.rows), "--width", str(args.width),
               "--one", str(max_n)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(json.dumps({"prompt_lookup_max": max_n, "stopped_after_s": args.timeout}),
                  flush=True)
            continue
        if p.returncode:
            sys.exit(f"prompt_lookup_max {max_n}: {p.stderr.strip().splitlines()[-1]}")
        print(p.stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
