"""The decoder's linear projections in FP8 (``jaxserve.models.linear``) against bfloat16 and
``torch._scaled_mm``, at Llama-3.1-8B's projection shapes, on the GPU, in one run.

    python scripts/bench_fp8_gemm.py [--m 1,64,256,2048,8192] [--iters 50] [--json F]

For each M (tokens of a step) and projection (qkv 4096 -> 6144, o 4096 -> 4096, gate_up
4096 -> 28672, down 14336 -> 4096):

- ``bf16``: ``x @ w``, bfloat16 [in, out] weight;
- ``jaxserve fp8``: ``linear.linear`` over an ``Fp8Weight``: the per-token quantization of x,
  the FP8 GEMM and the scales, as the step runs it;
- ``torch fp8``: ``torch._scaled_mm`` with row-wise scales (float8_e4m3fn x float8_e4m3fn ->
  bfloat16; x already quantized), when torch sees a CUDA device.

JAX times ``--iters`` projections inside one jitted loop (each iteration's input differs, so
nothing is hoisted; the loop adds one [M, in] add and one [M, out] sum); torch times them with
CUDA events. TFLOP/s count 2 M in out per projection. Also prints whether the compiled JAX
program's GEMM is an FP8 cuBLASLt call (``__cublas$lt$matmul$f8``) rather than an upcast.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.linear import linear, quantize_weight

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}


def jax_time(fn, x, w, iters: int) -> float:
    """Seconds per projection: ``iters`` of ``fn(x + i eps, w)`` in one jitted loop."""

    @jax.jit
    def loop(x, w):
        def body(i, acc):
            y = fn(x + (i * 1e-3).astype(x.dtype), w)
            return acc + jnp.sum(y.astype(jnp.float32))
        return jax.lax.fori_loop(0, iters, body, jnp.float32(0))

    loop(x, w).block_until_ready()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        loop(x, w).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best / iters


def gemm_calls(fn, x, w) -> list[str]:
    """The custom-call targets of the compiled ``fn(x, w)`` (cuBLAS GEMMs among them)."""
    text = jax.jit(fn).lower(x, w).compile().as_text()
    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))


def torch_time(m: int, k: int, n: int, iters: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()  # column-major [k, n]
    sa = torch.rand(m, 1, device="cuda", dtype=torch.float32)
    sb = torch.rand(1, n, device="cuda", dtype=torch.float32)

    def run():
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    run()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            run()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best / iters


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="1,64,256,2048,8192")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    rows = []
    key = jax.random.key(0)
    for name, (k, n) in SHAPES.items():
        w = (0.02 * jax.random.normal(key, (k, n), jnp.float32)).astype(jnp.bfloat16)
        w8 = jax.jit(quantize_weight)(w)
        for m in map(int, args.m.split(",")):
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            flop = 2 * m * k * n
            t16 = jax_time(lambda x, w: x @ w, x, w, args.iters)
            t8 = jax_time(linear, x, w8, args.iters)
            tt = torch_time(m, k, n, args.iters)
            row = {"proj": name, "m": m, "k": k, "n": n,
                   "bf16_tflops": flop / t16 / 1e12, "fp8_tflops": flop / t8 / 1e12,
                   "torch_fp8_tflops": None if tt is None else flop / tt / 1e12,
                   "bf16_us": t16 * 1e6, "fp8_us": t8 * 1e6,
                   "torch_fp8_us": None if tt is None else tt * 1e6,
                   "fp8_custom_calls": gemm_calls(linear, x, w8)}
            rows.append(row)
            torch_s = "-" if tt is None else f"{row['torch_fp8_tflops']:7.1f} ({tt * 1e6:8.1f} us)"
            print(f"{name:8s} M={m:5d}  bf16 {row['bf16_tflops']:7.1f} ({t16 * 1e6:8.1f} us)  "
                  f"jaxserve fp8 {row['fp8_tflops']:7.1f} ({t8 * 1e6:8.1f} us)  "
                  f"torch fp8 {torch_s}  TFLOP/s; fp8 program's calls {row['fp8_custom_calls']}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
