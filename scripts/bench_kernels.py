"""Benchmark the Pallas attention kernels against JAX's bundled kernel, XLA and cuDNN.

Workloads (docs/architecture.md, "Measuring"), Llama-3-8B heads (32 q / 8 kv, d=128), page 16,
bfloat16:
  decode-b{1,64,256}-c2k, decode-b64-c{512,8192}: paged decode attention; effective bandwidth
    counts the K and V bytes of the context once (2 * KV * B * ctx * D * 2 B).
  prefill-b8-s2k: causal attention over paged KV, FLOPs = 2 * B * H * S^2 * D.
Each row gives our time and the ratio of each baseline's time to ours (>1: ours is faster),
all measured in the same run:
  bundled = jax.experimental.pallas.ops.gpu.paged_attention (decode) / .attention.mha (prefill,
            dense KV with K/V repeated to all heads),
  xla     = gather-then-attend (pallas_kernels.reference, decode) / jax.nn.dot_product_attention
            implementation="xla" (prefill, dense KV),
  cudnn   = jax.nn.dot_product_attention(implementation="cudnn") on contiguous (dense) KV.
Also: a tile sweep (--sweep), the KV write (XLA's scatter against the Pallas kernel) and, with
--model-step, a Llama-3.1-8B-shaped model step (a few layers) with Pallas vs reference attention.

Timing: each measurement runs ``--iters`` calls dispatched back to back (asynchronous) and
blocks once; the median over ``--reps`` such runs, divided by iters, is reported. A call whose
device time is under the host's dispatch time per call (~50-70 us measured here for decode-b1)
measures dispatch, not the kernel. (Calls are not chained inside one
executable: XLA merges the repeated baseline calls, even across optimization barriers.)

Usage: python scripts/bench_kernels.py [--sweep] [--model-step] [--json PATH]
       python scripts/bench_kernels.py --smoke   # tiny shapes, interpret mode, on CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import traceback
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_quant, kv_write, reference
from pallas_kernels.flash_attention import PrefillTuning, attention
from pallas_kernels.paged_attention import DecodeTuning, paged_attention, resolve_decode_tuning
from pallas_kernels.testing import rel_err

# Device-to-device copy measured on the H200 (docs/architecture.md, "Measuring").
COPY_PEAK_TBS = 4.23


def timeit(fn, *args, iters=20, reps=5):
    """Median seconds per call of fn(*args), after one warm-up call (which compiles)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


class Bench:
    def __init__(self, args):
        self.args = args
        self.smoke = args.smoke
        self.results = []

    def t(self, fn, *a):
        if self.smoke:
            return timeit(fn, *a, iters=1, reps=1)
        return timeit(fn, *a, iters=self.args.iters, reps=self.args.reps)

    def safe(self, label, fn, *a):
        """Time fn; returns seconds or None (printing why) if it fails to compile or run."""
        try:
            return self.t(fn, *a)
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported as n/a
            msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            print(f"  [{label}] n/a: {type(e).__name__}: {msg}", flush=True)
            if self.args.verbose:
                traceback.print_exc()
            return None


def decode_inputs(key, batch, ctx, *, heads, kv_heads, head_dim, page_size, dtype):
    """Pool of exactly the pages needed (+ null page 0), pages handed out in random order."""
    pages_per_seq = ctx // page_size
    num_pages = 1 + batch * pages_per_seq
    kq, kk, kv, kp = jax.random.split(key, 4)
    q = jax.random.normal(kq, (batch, heads, head_dim), dtype)
    k_pages = jax.random.normal(kk, (kv_heads, num_pages, page_size, head_dim), dtype)
    v_pages = jax.random.normal(kv, (kv_heads, num_pages, page_size, head_dim), dtype)
    perm = 1 + jax.random.permutation(kp, num_pages - 1).astype(jnp.int32)
    block_tables = perm.reshape(batch, pages_per_seq)
    seq_lens = jnp.full((batch,), ctx, jnp.int32)
    return q, k_pages, v_pages, block_tables, seq_lens


def dense_kv(pages, block_tables):
    """[KV, num_pages, ps, D] gathered at [B, P] -> contiguous [B, P * ps, KV, D]."""
    kv_heads, _, page_size, head_dim = pages.shape
    b, p = block_tables.shape
    g = pages[:, block_tables]  # [KV, B, P, ps, D]
    return g.reshape(kv_heads, b, p * page_size, head_dim).transpose(1, 2, 0, 3)


def run_decode(bench: Bench, name, batch, ctx, cfg, tunings=None):
    q, kp, vp, bt, sl = decode_inputs(jax.random.PRNGKey(batch * 7 + ctx), batch, ctx, **cfg)
    nbytes = 2 * cfg["kv_heads"] * batch * ctx * cfg["head_dim"] * jnp.dtype(cfg["dtype"]).itemsize
    interp = bench.smoke
    row = {"workload": name, "bytes": nbytes}
    ref_out = jax.jit(reference.paged_attention)(q, kp, vp, bt, sl)

    ours = jax.jit(lambda *x: paged_attention(*x, interpret=interp))
    out = ours(q, kp, vp, bt, sl)
    row["rel_err_vs_xla"] = rel_err(out, ref_out)
    row["ours_s"] = bench.safe("ours", ours, q, kp, vp, bt, sl)
    row["tuning"] = str(resolve_decode_tuning(batch, cfg["kv_heads"], bt.shape[1],
                                              cfg["page_size"], cfg["head_dim"]))
    # The model's entry point on a pure-decode batch (T = S = batch), both dispatch choices.
    qsl = jnp.arange(batch + 1, dtype=jnp.int32)
    for split, key in ((True, "entry_s"), (False, "ragged_only_s")):
        fn = jax.jit(lambda q, k, v, qsl, sl, bt, split=split: attention(
            q, k, v, qsl, sl, bt, split_decode=split, interpret=interp))
        if not split:
            row["rel_err_ragged_only"] = rel_err(fn(q, kp, vp, qsl, sl, bt), ref_out)
        row[key] = bench.safe(key, fn, q, kp, vp, qsl, sl, bt)
    row["xla_s"] = bench.safe("xla", jax.jit(reference.paged_attention), q, kp, vp, bt, sl)
    if not bench.smoke:
        from jax.experimental.pallas.ops.gpu import paged_attention as bundled

        fn = jax.jit(lambda *x: bundled.paged_attention(*x))
        row["bundled_s"] = bench.safe("bundled", fn, q, kp, vp, bt, sl)
        kd, vd = dense_kv(kp, bt), dense_kv(vp, bt)
        fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q[:, None], k, v, implementation="cudnn")[:, 0])
        row["cudnn_s"] = bench.safe("cudnn", fn, q, kd, vd)
        del kd, vd
    return finish(bench, row, "TB/s", nbytes / 1e12, tunings, (q, kp, vp, bt, sl),
                  lambda t: jax.jit(lambda *x: paged_attention(*x, tuning=t, interpret=interp)))


def run_decode_fp8(bench: Bench, name, batch, ctx, cfg):
    """The decode kernel on an FP8 pool (kv_quant) against the same kernel on the bfloat16 pool
    it was quantized from, same run; bandwidth counts the bytes each reads (FP8: D + 4 bytes
    per token and KV head for K and for V)."""
    q, kp, vp, bt, sl = decode_inputs(jax.random.PRNGKey(batch * 7 + ctx), batch, ctx, **cfg)
    kq, vq = (kv_quant.quantize_pages(p) for p in (kp, vp))
    rows = 2 * cfg["kv_heads"] * batch * ctx
    interp = bench.smoke
    ours = jax.jit(lambda *x: paged_attention(*x, interpret=interp))
    row = {"workload": f"{name}-fp8", "bytes": rows * (cfg["head_dim"] + 4)}
    row["rel_err_vs_xla"] = rel_err(ours(q, kq, vq, bt, sl),
                                    jax.jit(reference.paged_attention)(q, kq, vq, bt, sl))
    row["rel_err_vs_bf16_pool"] = rel_err(ours(q, kq, vq, bt, sl), ours(q, kp, vp, bt, sl))
    row["ours_s"] = bench.safe("fp8", ours, q, kq, vq, bt, sl)
    row["bf16_pool_s"] = bench.safe("bf16", ours, q, kp, vp, bt, sl)
    if row["ours_s"] and row["bf16_pool_s"]:
        print(f"{row['workload']:<22} fp8 {row['ours_s'] * 1e3:8.4f} ms "
              f"{row['bytes'] / row['ours_s'] / 1e12:5.2f} TB/s, bf16 pool "
              f"{row['bf16_pool_s'] * 1e3:8.4f} ms: {row['bf16_pool_s'] / row['ours_s']:.2f}x; "
              f"err vs reference {row['rel_err_vs_xla']:.1e}, vs bf16 pool "
              f"{row['rel_err_vs_bf16_pool']:.1e}", flush=True)
    bench.results.append(row)


def prefill_inputs(key, batch, seq, *, heads, kv_heads, head_dim, page_size, dtype):
    pages_per_seq = seq // page_size
    num_pages = 1 + batch * pages_per_seq
    kq, kk, kv, kp = jax.random.split(key, 4)
    q = jax.random.normal(kq, (batch * seq, heads, head_dim), dtype)
    k_pages = jax.random.normal(kk, (kv_heads, num_pages, page_size, head_dim), dtype)
    v_pages = jax.random.normal(kv, (kv_heads, num_pages, page_size, head_dim), dtype)
    perm = 1 + jax.random.permutation(kp, num_pages - 1).astype(jnp.int32)
    block_tables = perm.reshape(batch, pages_per_seq)
    seq_lens = jnp.full((batch,), seq, jnp.int32)
    qsl = jnp.arange(batch + 1, dtype=jnp.int32) * seq
    return q, k_pages, v_pages, qsl, seq_lens, block_tables


def run_prefill(bench: Bench, name, batch, seq, cfg, tunings=None):
    q, kp, vp, qsl, sl, bt = prefill_inputs(jax.random.PRNGKey(seq + batch), batch, seq, **cfg)
    h, d = cfg["heads"], cfg["head_dim"]
    flops = 2 * batch * h * seq * seq * d
    interp = bench.smoke
    row = {"workload": name, "flops": flops}
    ours = jax.jit(lambda *x: attention(*x, interpret=interp))
    out = ours(q, kp, vp, qsl, sl, bt)
    # Dense copies for the dense-KV baselines and the check.
    qd = q.reshape(batch, seq, h, d)
    kd, vd = dense_kv(kp, bt), dense_kv(vp, bt)
    xla = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="xla"))
    ref_out = xla(qd, kd, vd).reshape(q.shape)
    row["rel_err_vs_xla"] = rel_err(out, ref_out)
    row["ours_s"] = bench.safe("ours", ours, q, kp, vp, qsl, sl, bt)
    row["xla_s"] = bench.safe("xla", xla, qd, kd, vd)
    if not bench.smoke:
        fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"))
        row["cudnn_s"] = bench.safe("cudnn", fn, qd, kd, vd)
        from jax.experimental.pallas.ops.gpu import attention as bundled

        group = h // cfg["kv_heads"]
        kr, vr = jnp.repeat(kd, group, axis=2), jnp.repeat(vd, group, axis=2)
        fn = jax.jit(lambda q, k, v: bundled.mha(q, k, v, None, sm_scale=d**-0.5, causal=True))
        row["bundled_s"] = bench.safe("bundled mha", fn, qd, kr, vr)
        del kr, vr
    del kd, vd
    return finish(bench, row, "TFLOP/s", flops / 1e12, tunings, (q, kp, vp, qsl, sl, bt),
                  lambda t: jax.jit(lambda *x: attention(*x, prefill_tuning=t, interpret=interp)))


def run_mixed(bench: Bench, name, num_decodes, ctx, chunk, cfg):
    """A serving-like step: num_decodes decodes at ctx plus one prefill chunk ending at ctx."""
    batch = num_decodes + 1
    q, kp, vp, bt, sl = decode_inputs(jax.random.PRNGKey(5), batch, ctx, **cfg)
    tokens = num_decodes + chunk
    q = jax.random.normal(jax.random.PRNGKey(6), (tokens, cfg["heads"], cfg["head_dim"]),
                          cfg["dtype"])
    qsl = jnp.concatenate([jnp.arange(batch, dtype=jnp.int32),
                           jnp.array([tokens], jnp.int32)])
    interp = bench.smoke
    row = {"workload": name}
    ref_out = jax.jit(reference.attention)(q, kp, vp, qsl, sl, bt)
    for split, key in ((True, "ours_s"), (False, "ragged_only_s")):
        fn = jax.jit(lambda *x, split=split: attention(*x, split_decode=split, interpret=interp))
        row["rel_err_vs_xla" if split else "rel_err_ragged_only"] = rel_err(
            fn(q, kp, vp, qsl, sl, bt), ref_out)
        row[key] = bench.safe(key, fn, q, kp, vp, qsl, sl, bt)
    row["xla_s"] = bench.safe("xla", jax.jit(reference.attention), q, kp, vp, qsl, sl, bt)
    # Bytes: each sequence's K/V once.
    row["bytes"] = 2 * cfg["kv_heads"] * batch * ctx * cfg["head_dim"] * jnp.dtype(
        cfg["dtype"]).itemsize
    report(row, "TB/s", row["bytes"] / 1e12)
    bench.results.append(row)


def run_kv_write(bench: Bench, cfg, batch=64, ctx=2048, loops=50):
    """The KV write of T new tokens into a pool of batch x ctx tokens, bfloat16 and FP8: XLA's
    scatter (``llama.write_kv``, the reference's) against the Pallas kernel
    (``pallas_kernels.kv_write``). Each time is one of ``loops`` writes chained in one program
    (the pools its loop's carry, written in place), so small writes time the kernels, not the
    host's dispatch."""
    from jaxserve.models.llama import write_kv

    _, kp, _, _, _ = decode_inputs(jax.random.PRNGKey(0), batch, ctx, **cfg)
    rows = kp.shape[1] * kp.shape[2]
    loops = 2 if bench.smoke else loops

    def chained(write):
        def run(pools, k, v, slots):
            return jax.lax.fori_loop(0, loops, lambda _, p: write(*p, k, v, slots), pools)
        return jax.jit(run, donate_argnums=0)

    writers = {"xla_s": chained(write_kv),
               "ours_s": chained(partial(kv_write.write_kv, interpret=bench.smoke))}
    for fp8 in (False, True):
        pool = kv_quant.quantize_pages(kp) if fp8 else kp
        for tokens in (1, 256, 1024, 4096, 16384):
            tokens = min(tokens, rows)
            shape = (tokens, kp.shape[0], kp.shape[3])
            k = jax.random.normal(jax.random.PRNGKey(1), shape, cfg["dtype"])
            slots = jax.random.permutation(jax.random.PRNGKey(2), rows)[:tokens].astype(jnp.int32)
            row = {"workload": f"kv-write-t{tokens}" + ("-fp8" if fp8 else "")}
            for key, write in writers.items():
                pools = tuple(jax.tree.map(jnp.copy, pool) for _ in range(2))
                pools = jax.block_until_ready(write(pools, k, k, slots))  # compile
                t0 = time.perf_counter()
                pools = jax.block_until_ready(write(pools, k, k, slots))
                row[key] = (time.perf_counter() - t0) / loops
            written = 2 * k.size * (1 if fp8 else k.dtype.itemsize)
            print(f"{row['workload']:<18} xla {row['xla_s'] * 1e6:8.1f} us  pallas "
                  f"{row['ours_s'] * 1e6:8.1f} us  ({row['xla_s'] / row['ours_s']:.2f}x; "
                  f"{written / row['ours_s'] / 1e12:.2f} TB/s of rows written)", flush=True)
            bench.results.append(row)


def run_model_step(bench: Bench, num_layers=4, batch=64, ctx=2048):
    """Llama-3.1-8B-shaped decode step (num_layers of 32 layers), Pallas vs reference attention."""
    from jaxserve.config import ModelConfig
    from jaxserve.models import llama

    c = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=num_layers, num_heads=32, num_kv_heads=8,
        head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
        tie_word_embeddings=False, attention_bias=False, qk_norm=False,
        max_position_embeddings=8192, eos_token_ids=(1,))
    if bench.smoke:
        c = ModelConfig(**{**c.__dict__, "vocab_size": 256, "hidden_size": 256,
                           "intermediate_size": 512, "num_heads": 4, "num_kv_heads": 2,
                           "head_dim": 64})
    dtype = jnp.bfloat16
    key = iter(jax.random.split(jax.random.PRNGKey(3), 8 * num_layers + 8))
    L, E, D, I = c.num_layers, c.hidden_size, c.head_dim, c.intermediate_size
    qkv = (c.num_heads + 2 * c.num_kv_heads) * D
    w = lambda *s: 0.02 * jax.random.normal(next(key), s, dtype)  # noqa: E731
    # Per-layer weights and KV arrays: the model's GPU layout (an unrolled Python layer loop).
    params = {
        "embed_tokens": w(c.vocab_size, E), "lm_head": w(c.vocab_size, E),
        "norm": jnp.ones(E, dtype),
        "layers": [
            {"input_layernorm": jnp.ones(E, dtype), "post_attention_layernorm": jnp.ones(E, dtype),
             "qkv_proj": w(E, qkv), "o_proj": w(c.num_heads * D, E), "gate_up_proj": w(E, 2 * I),
             "down_proj": w(I, E)}
            for _ in range(L)
        ],
    }
    page_size = 16
    pages_per_seq = ctx // page_size
    num_pages = 1 + batch * pages_per_seq
    shape = (c.num_kv_heads, num_pages, page_size, D)
    perm = 1 + np.random.default_rng(0).permutation(num_pages - 1).astype(np.int32)
    bt = perm.reshape(batch, pages_per_seq)
    positions = np.full(batch, ctx - 1, np.int32)
    md = llama.AttentionMetadata(
        positions=jnp.asarray(positions),
        slot_mapping=jnp.asarray(bt[:, -1] * page_size + page_size - 1),
        query_start_loc=jnp.arange(batch + 1, dtype=jnp.int32),
        seq_lens=jnp.full((batch,), ctx, jnp.int32), block_tables=jnp.asarray(bt))
    tokens = jnp.arange(batch, dtype=jnp.int32)
    logits_indices = jnp.arange(batch, dtype=jnp.int32)
    interp = bench.smoke
    fns = {
        "pallas": lambda *x, **kw: attention(*x, interpret=interp, **kw),
        "reference": reference.attention,
    }
    times = {}
    for label, attn in fns.items():
        kc = [jax.random.normal(jax.random.PRNGKey(i), shape, dtype) for i in range(L)]
        vc = [jax.random.normal(jax.random.PRNGKey(L + i), shape, dtype) for i in range(L)]
        step = jax.jit(
            lambda p, t, m, kc, vc, li, attn=attn: llama.forward(
                c, p, t, m, kc, vc, li, attention_fn=attn),
            donate_argnums=(3, 4))
        logits, kc, vc = step(params, tokens, md, kc, vc, logits_indices)  # compile
        jax.block_until_ready(logits)
        n = 1 if bench.smoke else 20
        ts = []
        for _ in range(1 if bench.smoke else 3):
            t0 = time.perf_counter()
            for _ in range(n):
                logits, kc, vc = step(params, tokens, md, kc, vc, logits_indices)
            jax.block_until_ready(logits)
            ts.append((time.perf_counter() - t0) / n)
        times[label] = statistics.median(ts)
        del kc, vc
    row = {"workload": f"model-step-{L}L-b{batch}-c{ctx}", "ours_s": times["pallas"],
           "reference_s": times["reference"]}
    print(f"model step (Llama-3.1-8B shape, {L} layers, b{batch} c{ctx}, bf16): pallas "
          f"{times['pallas'] * 1e3:.3f} ms, reference {times['reference'] * 1e3:.3f} ms, "
          f"reference/pallas = {times['reference'] / times['pallas']:.2f}x", flush=True)
    bench.results.append(row)


def finish(bench: Bench, row, unit, amount, tunings, args, jitted_with):
    """Times jitted_with(t)(*args) for each tuning t into row["sweep"], prints the row, records it.

    amount / seconds is the rate printed in unit (TB/s for decode bytes, TFLOP/s for prefill flops).
    """
    for t in tunings or ():
        s = bench.safe(str(t), jitted_with(t), *args)
        row.setdefault("sweep", []).append((str(t), s))
        if s is not None:
            print(f"  sweep {t}: {s * 1e3:.4f} ms {amount / s:.2f} {unit}", flush=True)
    report(row, unit, amount)
    bench.results.append(row)
    return row


def report(row, unit, amount):
    ours = row.get("ours_s")
    if ours is None:
        print(f"{row['workload']}: ours failed", flush=True)
        return
    parts = [f"{row['workload']:<18} ours {ours * 1e3:8.4f} ms {amount / ours:7.2f} {unit}"]
    for k in ("entry_s", "ragged_only_s", "bundled_s", "xla_s", "cudnn_s"):
        if k in row:
            v = row[k]
            parts.append(f"{k[:-2]} {'n/a' if v is None else f'{v / ours:.2f}x'}")
    parts.append(f"err {row['rel_err_vs_xla']:.1e}")
    print("  ".join(parts), flush=True)


def table(bench: Bench):
    """Markdown table of the main rows (time, rate, ratios baseline/ours)."""
    lines = ["| workload | ours ms | rate | entry() | ragged-only | bundled | xla | cudnn |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in bench.results:
        if "rel_err_vs_xla" not in r or r.get("ours_s") is None:
            continue
        ours = r["ours_s"]
        rate = (f"{r['bytes'] / ours / 1e12:.2f} TB/s" if "bytes" in r
                else f"{r['flops'] / ours / 1e12:.0f} TFLOP/s")

        def ratio(k):
            if k not in r:
                return "-"
            return "n/a" if r[k] is None else f"{r[k] / ours:.2f}x"

        lines.append(f"| {r['workload']} | {ours * 1e3:.4f} | {rate} | {ratio('entry_s')} | "
                     f"{ratio('ragged_only_s')} | {ratio('bundled_s')} | {ratio('xla_s')} | "
                     f"{ratio('cudnn_s')} |")
    print("\n".join(lines), flush=True)


DECODE_SWEEP = [
    DecodeTuning(block_k=bk, num_splits=ns, num_warps=w, num_stages=st)
    for bk in (32, 64)
    for ns in (1, 2)
    for (w, st) in ((4, 3), (4, 4), (2, 3), (2, 4), (8, 3))
] + [DecodeTuning(block_k=128, num_splits=ns, num_warps=4, num_stages=3) for ns in (1, 2)]

# Split count and tile for the other decode shapes.
DECODE_SPLIT_SWEEP = [
    DecodeTuning(block_k=bk, num_splits=ns) for bk in (64, 128) for ns in (1, 2, 4, 8, 16)
]

PREFILL_SWEEP = [
    PrefillTuning(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
    for (bq, bk, w, st) in (
        (128, 128, 8, 2), (128, 128, 8, 3), (128, 128, 4, 2), (128, 64, 8, 3), (128, 64, 4, 3),
        (64, 64, 4, 4), (64, 128, 4, 3), (64, 32, 4, 3), (256, 64, 8, 2))
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sweep", action="store_true", help="tile sweeps on b64-c2k and b8-s2k")
    p.add_argument("--model-step", action="store_true", help="model step pallas vs reference")
    p.add_argument("--model-layers", type=int, default=4)
    p.add_argument("--kv-write", action="store_true",
                   help="time the KV write: XLA scatter vs the Pallas kernel")
    p.add_argument("--fp8", action="store_true",
                   help="also run each decode workload on an FP8 pool (vs its bf16 pool)")
    p.add_argument("--only", default="", help="comma-separated workload names to run")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None, help="write all results here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    bench = Bench(args)
    dev = jax.devices()[0]
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"jax {jax.__version__}, {dev.platform} {getattr(dev, 'device_kind', '')}", flush=True)
    cfg = dict(heads=32, kv_heads=8, head_dim=128, page_size=16, dtype=jnp.bfloat16)
    decode = [("decode-b64-c2k", 64, 2048), ("decode-b1-c2k", 1, 2048),
              ("decode-b256-c2k", 256, 2048), ("decode-b64-c512", 64, 512),
              ("decode-b64-c8k", 64, 8192)]
    prefill = [("prefill-b8-s2k", 8, 2048)]
    if args.smoke:
        cfg = dict(heads=6, kv_heads=2, head_dim=64, page_size=16, dtype=jnp.float32)
        decode = [("decode-b4-c64", 4, 64)]
        prefill = [("prefill-b2-s64", 2, 64)]
    only = set(filter(None, args.only.split(",")))
    for name, b, ctx in decode:
        if only and name not in only:
            continue
        sweep = DECODE_SWEEP if args.sweep and name == "decode-b64-c2k" else None
        if args.sweep and name != "decode-b64-c2k":
            sweep = DECODE_SPLIT_SWEEP
        if args.smoke and args.sweep:
            sweep = DECODE_SWEEP[:2]
        run_decode(bench, name, b, ctx, cfg, sweep)
        if args.fp8:
            run_decode_fp8(bench, name, b, ctx, cfg)
    for name, b, s in prefill:
        if only and name not in only:
            continue
        sweep = PREFILL_SWEEP if args.sweep else None
        if args.smoke and args.sweep:
            sweep = PREFILL_SWEEP[:2]
        run_prefill(bench, name, b, s, cfg, sweep)
    if not only or "mixed-b64-c2k" in only:
        if args.smoke:
            run_mixed(bench, "mixed-b4-c64", 3, 64, 20, cfg)
        else:
            run_mixed(bench, "mixed-b64-c2k", 63, 2048, 449, cfg)
    if args.kv_write:
        run_kv_write(bench, cfg, *((4, 64) if args.smoke else (64, 2048)))
    if args.model_step:
        try:
            run_model_step(bench, args.model_layers, *((4, 64) if args.smoke else (64, 2048)))
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    print(f"\n(ratios are baseline time / ours; >1 means ours is faster; bandwidth floors use "
          f"the {COPY_PEAK_TBS} TB/s copy peak)")
    table(bench)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(bench.results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
