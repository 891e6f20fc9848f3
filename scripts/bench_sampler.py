"""Time the sampler (``sample`` below: a step's draw without logits processors) against the
full-sort sampler, in the same run.

For each batch size and case, both samplers are jitted, warmed up, then timed call by call
(``block_until_ready``); the table gives medians in milliseconds and reference / new. Logits are
random normal times 5 (the cost of neither sampler depends on their values).

    python scripts/bench_sampler.py --iters 50
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from jaxserve.worker.sampler import filtered_rows, sample_filtered, sample_unfiltered
from jaxserve.worker.sampling_fields import FilterMetadata, SamplingMetadata, neutral

# name: (temperature, top_k, top_p, every): top_k and top_p apply to every `every`-th row, the
# other rows sample at the temperature alone.
CASES = {
    "greedy": (0.0, 0, 1.0, 1),
    "temperature 1": (1.0, 0, 1.0, 1),
    "temperature 1, top_k 50": (1.0, 50, 1.0, 1),
    "top_p 0.9": (1.0, 0, 0.9, 1),
    "top_p 0.9 on 1 row in 8": (1.0, 0, 0.9, 8),
}


def _reference_sample_rows(logits: jax.Array, sm: SamplingMetadata) -> jax.Array:
    """The earlier sampler: a full-vocabulary sort whenever any row samples."""
    vocab = logits.shape[-1]
    temp = jnp.where(sm.temperature > 0, sm.temperature, 1.0)
    scaled = logits / temp[:, None]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    k = jnp.where(sm.top_k > 0, jnp.minimum(sm.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(jnp.where(sorted_logits >= kth, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < sm.top_p[:, None]
    num_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_logits, (num_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(threshold, kth)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(sm.seeds, sm.steps)
    sampled = jax.vmap(jax.random.categorical)(keys, masked)
    return jnp.where(sm.temperature > 0, sampled, jnp.argmax(logits, axis=-1))


def sample(logits: jax.Array, sm: SamplingMetadata) -> jax.Array:
    """[S, V] float32 logits -> [S] int32 tokens: the step's greedy and plain rows, then the
    filtered sampler for the top-k / top-p rows."""
    tokens = sample_unfiltered(logits, sm, branch_free=False)
    fm = neutral(FilterMetadata, len(tokens), rows=filtered_rows(sm, logits.shape[-1]))
    return sample_filtered(logits, tokens, sm, fm)[0]


def reference_sample(logits: jax.Array, sm: SamplingMetadata) -> jax.Array:
    """The reference: [S, V] float32 logits -> [S] int32 tokens, as ``sample``."""
    return jax.lax.cond(
        jnp.all(sm.temperature == 0),
        lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32),
        lambda: _reference_sample_rows(logits, sm).astype(jnp.int32),
    )


def median_ms(fn, args, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--iters", type=int, default=50, help="timed calls per cell")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per cell (1st compiles)")
    ap.add_argument("--batches", default="1,64,256", help="comma-separated batch sizes")
    ap.add_argument("--vocab", type=int, default=128_256, help="vocabulary size (Llama 3's)")
    args = ap.parse_args()

    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, vocab {args.vocab}, "
          f"median of {args.iters} calls after {args.warmup} warm-up calls")
    print()
    print("| batch | case | reference ms | new ms | reference / new |")
    print("| ---: | --- | ---: | ---: | ---: |")
    ref_fn, new_fn = jax.jit(reference_sample), jax.jit(sample)
    for s in (int(b) for b in args.batches.split(",")):
        logits = jax.random.normal(jax.random.key(0), (s, args.vocab), jnp.float32) * 5
        for name, (temperature, top_k, top_p, every) in CASES.items():
            chosen = jnp.arange(s) % every == 0
            sm = SamplingMetadata(
                temperature=jnp.full(s, temperature, jnp.float32),
                top_k=jnp.where(chosen, top_k, 0).astype(jnp.int32),
                top_p=jnp.where(chosen, top_p, 1.0).astype(jnp.float32),
                seeds=jnp.arange(s, dtype=jnp.uint32), steps=jnp.full(s, 7, jnp.int32),
            )
            fn_args = (logits, sm)
            ref = median_ms(ref_fn, fn_args, args.warmup, args.iters)
            new = median_ms(new_fn, fn_args, args.warmup, args.iters)
            print(f"| {s} | {name} | {ref:.3f} | {new:.3f} | {ref / new:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
