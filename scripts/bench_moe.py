"""The MoE block's expert GEMMs (jaxserve/models/moe.py) against a dense baseline, at real shapes.

    python scripts/bench_moe.py [--tokens 16,256,2048,8192] [--shape qwen3-30b-a3b,mixtral-8x7b]
        [--gmm-tuning block_m=64,block_n=128 ...]

For each shape (a dummy preset of ``jaxserve.model_loader.dummy``) and token count T, random
bfloat16 weights of one sparse layer and random routing, timed in one jitted loop of 20 calls
(median of 5 runs, after a warm-up):

- ``ragged_dot``: ``moe.sparse_mlp`` as the step runs it (route, sort by expert, two
  ``jax.lax.ragged_dot`` grouped GEMMs, weighted scatter-add);
- ``pallas``: the same path with the Pallas grouped matmul (``pallas_kernels.grouped_matmul``)
  as its two grouped GEMMs, at its default tiles and at each ``--gmm-tuning`` (``GmmTuning``
  fields) as a column of its own; these columns and ``ragged_dot`` decide
  ``Platform.moe_grouped_gemm``;
- ``dense``: every token through every expert (one einsum over the stacked weights), weighted by
  its routing probabilities (zero for experts it did not choose): X / k times the FLOPs, the
  baseline a grouped GEMM must beat.

TFLOP/s count the useful work only: T k experts x 3 matmuls of E x I (2 FLOPs each). Prints a
table; on the CPU the shapes are cut to a tenth of their width and the pallas columns are left
empty (interpret mode copies a program's whole blocks, every expert's weights, at each of its
hundreds of programs: minutes a call; tests/kernels/test_grouped_matmul.py checks its numbers
there).
"""

import argparse
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model_loader.dummy import PRESETS
from jaxserve.models import moe
from jaxserve.platforms import current_platform
from pallas_kernels.grouped_matmul import GmmTuning

LOOP = 20


def dense_mlp(x, p, top_k: int, norm_topk_prob: bool):
    """Every token through every expert, weighted by its routing (zero where not chosen)."""
    weights, experts = moe.route(x, p["router"], top_k, norm_topk_prob)
    num_experts = p["router"].shape[1]
    dense_w = jnp.zeros((x.shape[0], num_experts), jnp.float32).at[
        jnp.arange(x.shape[0])[:, None], experts].set(weights)
    h = jnp.einsum("te,xef->txf", x, p["experts_gate_up"])
    g, u = jnp.split(h, 2, axis=-1)
    y = jnp.einsum("txi,xie->txe", jax.nn.silu(g) * u, p["experts_down"])
    return jnp.einsum("txe,tx->te", y.astype(jnp.float32), dense_w).astype(x.dtype)


def timed(fn, x, p) -> float:
    """Median seconds of one call, from a jitted loop of LOOP calls."""
    def loop(x, p):
        return jax.lax.fori_loop(0, LOOP, lambda i, acc: acc + fn(x + acc * 1e-3, p), x)

    f = jax.jit(loop)
    f(x, p).block_until_ready()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        f(x, p).block_until_ready()
        runs.append((time.perf_counter() - t) / LOOP)
    return statistics.median(runs)


def parse_tuning(spec: str) -> GmmTuning:
    """"block_m=64,num_warps=8" -> GmmTuning(block_m=64, num_warps=8)."""
    fields = {f.name for f in dataclasses.fields(GmmTuning)}
    kv = dict(item.split("=") for item in spec.split(","))
    if not kv.keys() <= fields:
        raise SystemExit(f"--gmm-tuning {spec!r}: fields are {', '.join(sorted(fields))}")
    return GmmTuning(**{k: int(v) for k, v in kv.items()})


def cell(seconds: float | None, flops: int) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f} ({flops / seconds / 1e12:.0f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="16,256,2048,8192")
    ap.add_argument("--shape", default="qwen3-30b-a3b,mixtral-8x7b")
    ap.add_argument("--gmm-tuning", action="append", default=[], metavar="FIELD=N,...",
                    help="one more pallas column at these GmmTuning fields (repeatable)")
    args = ap.parse_args()
    platform = current_platform()
    cpu = platform.name == "cpu"
    cut = 10 if cpu else 1
    tokens = [int(t) for t in args.tokens.split(",")]
    tunings = [None] + [parse_tuning(s) for s in args.gmm_tuning]
    pallas = moe.get_grouped_gemm("pallas")
    names = ["pallas"] + [f"pallas {s}" for s in args.gmm_tuning]
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    if cpu:
        print("(CPU: the pallas columns are not timed; the kernel runs there in interpret mode "
              "only, minutes a call)")
    print("| shape | T | ragged_dot ms (TFLOP/s) | "
          + " | ".join(f"{n} ms (TFLOP/s)" for n in names)
          + " | dense ms (TFLOP/s) | ragged / best pallas | dense / ragged |")
    print("| --- | ---: |" + " ---: |" * (len(names) + 4))
    for name in args.shape.split(","):
        c = ModelConfig.from_hf_config(PRESETS[name])
        E, I, X, k = c.hidden_size // cut, c.moe_intermediate_size // cut, c.num_experts, \
            c.num_experts_per_tok
        keys = jax.random.split(jax.random.key(0), 4)
        p = {"router": jax.random.normal(keys[0], (E, X), jnp.bfloat16),
             "experts_gate_up": 0.02 * jax.random.normal(keys[1], (X, E, 2 * I), jnp.bfloat16),
             "experts_down": 0.02 * jax.random.normal(keys[2], (X, I, E), jnp.bfloat16)}
        sparse = lambda gemm: lambda x, p: moe.sparse_mlp(  # noqa: E731
            x, p, k, c.norm_topk_prob, 1, grouped_gemm=gemm)
        for t in tokens:
            x = jax.random.normal(keys[3], (t, E), jnp.bfloat16)
            flops = t * k * 3 * 2 * E * I
            ragged = timed(sparse(jax.lax.ragged_dot), x, p)
            kernels = [None if cpu else timed(sparse(functools.partial(pallas, tuning=tuning)),
                                              x, p) for tuning in tunings]
            dense = timed(lambda x, p: dense_mlp(x, p, k, c.norm_topk_prob), x, p)
            best = "-" if kernels[0] is None else f"{ragged / min(kernels):.2f}"
            print(f"| {name} | {t} | {cell(ragged, flops)} | "
                  + " | ".join(cell(s, flops) for s in kernels)
                  + f" | {cell(dense, flops)} | {best} | {dense / ragged:.2f} |", flush=True)


if __name__ == "__main__":
    main()
