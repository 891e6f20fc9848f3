"""A model shape's throughput bound on a GPU for a batch workload such as e2e-1k1k.

    python scripts/roofline.py --model llama-3.1-8b --model qwen3-30b-a3b --model gemma-3-27b

The workload: `--num-prompts` requests of `--input-len` tokens in and `--output-len` out, run
in waves of S sequences, each wave's prompts prefilled, then decoded together. S is
`--max-num-seqs` (the server's default 256 on a GPU) or as many sequences of input + output
tokens as the KV pool holds, if fewer: the pool is `--gpu-memory-utilization` of
`--gpu-memory-gib` less the weights, and a token takes K/V in every layer (the engine's pool
keeps a sliding-window layer's pages too). The bound adds up, per wave:

- prefill: every prompt token's GEMM FLOPs (2 x the active parameters: attention and MLP
  projections, the chosen experts, routers, shared experts; the LM head for one row a prompt)
  and the prompts' attention FLOPs (4 x heads x head_dim per query-key pair, causal, each
  layer's sliding window honoured), at `--peak-tflops`;
- each decode step at batch B and context c: the longer of the GEMMs (FLOPs at the peak) and
  reading the weights a step touches (every dense weight; for MoE layers the experts that B
  tokens choose, expected E (1 - (1 - k / E)^B) of E), plus reading every sequence's K/V
  (each layer's min(c, window) tokens), at `--bandwidth-tbs`.

Output tok/s bound = the workload's output tokens / that time. Defaults: one H200 (989 TFLOP/s
of dense bf16, 4.8 TB/s of HBM3e, NVIDIA's datasheet); the same method for every shape, so a
measured run's fraction of its bound compares shapes. Weights and K/V in bfloat16 unless
`--quantization fp8` (the linear projections in 1 byte, at twice the peak) or
`--kv-cache-dtype fp8`.
"""

import argparse
import sys

from jaxserve.config import ModelConfig
from jaxserve.model_loader.dummy import load_dummy


def layer_params(c: ModelConfig, layer: int, batch: int) -> tuple[float, float]:
    """(parameters a token multiplies by, parameters a step of ``batch`` tokens reads) of one
    decoder layer's projections."""
    h, d = c.hidden_size, c.head_dim
    attn = h * d * (2 * c.num_heads + 2 * c.num_kv_heads)
    sparse = c.num_experts and (not c.sparse_layers or c.sparse_layers[layer])
    if not sparse:
        mlp = 3 * h * c.intermediate_size
        return attn + mlp, attn + mlp
    expert = 3 * h * c.moe_intermediate_size
    shared = 3 * h * c.shared_expert_intermediate_size + (h if c.shared_expert_intermediate_size else 0)
    e, k = c.num_experts, c.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)
    fixed = attn + h * e + shared
    return fixed + k * expert, fixed + touched * expert


def bound(c: ModelConfig, args) -> dict:
    """Seconds of each part of the workload and the output tok/s bound."""
    peak = args.peak_tflops * 1e12
    gemm_peak = peak * (2 if args.quantization == "fp8" else 1)
    bw = args.bandwidth_tbs * 1e12
    wbytes = 1 if args.quantization == "fp8" else 2
    kvbytes = 1 if args.kv_cache_dtype == "fp8" else 2
    head = c.hidden_size * c.vocab_size
    windows = c.layer_windows or (None,) * c.num_layers
    kv_token = 2 * c.num_kv_heads * c.head_dim * kvbytes  # one layer's K and V of one token
    n, s_in, s_out = args.num_prompts, args.input_len, args.output_len
    weights = (sum(layer_params(c, i, 10**9)[1] for i in range(c.num_layers))
               * wbytes + head * 2 * (1 if c.tie_word_embeddings else 2))
    pool = args.gpu_memory_utilization * args.gpu_memory_gib * 2**30 - weights
    fit = int(pool // (kv_token * c.num_layers * (s_in + s_out)))
    seqs = min(args.max_num_seqs, n, fit)
    waves = n / seqs
    active = sum(layer_params(c, i, 1)[0] for i in range(c.num_layers))
    prefill_gemm = seqs * (s_in * 2 * active + 2 * head) / gemm_peak
    pairs = sum(sum(min(t, w or t) for t in range(1, s_in + 1)) for w in windows)
    prefill_attn = seqs * 4 * c.num_heads * c.head_dim * pairs / peak
    step_read = (sum(layer_params(c, i, seqs)[1] for i in range(c.num_layers)) + head) * wbytes
    step_gemm = max(seqs * 2 * (active + head) / gemm_peak, step_read / bw)
    kv = sum(seqs * kv_token * sum(min(s_in + j, w or s_in + j) for w in windows) / bw
             for j in range(s_out))
    decode_gemm = s_out * step_gemm
    total = waves * (prefill_gemm + prefill_attn + decode_gemm + kv)
    return {"sequences": seqs, "prefill GEMM s": waves * prefill_gemm, "prefill attention s": waves * prefill_attn,
            "decode GEMM/weights s": waves * decode_gemm, "decode K/V s": waves * kv,
            "total s": total, "output tok/s bound": n * s_out / total,
            "active params (B)": (active + head) / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True,
                    help="a dummy preset or config.json path; repeatable")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--quantization", choices=("fp8",), default=None)
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    ap.add_argument("--gpu-memory-gib", type=float, default=139.8, help="the device's memory")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s")
    ap.add_argument("--bandwidth-tbs", type=float, default=4.8, help="memory TB/s")
    ap.add_argument("--measured", type=float, action="append", default=[],
                    help="a measured output tok/s per --model, in order: prints the fraction")
    args = ap.parse_args()
    if args.measured and len(args.measured) != len(args.model):
        ap.error("give one --measured per --model")
    for i, m in enumerate(args.model):
        c = ModelConfig.from_hf_config(load_dummy(m, with_tokenizer=False).hf_config)
        b = bound(c, args)
        line = f"{m:<16} " + "  ".join(
            f"{k} {v:,.1f}" if "tok/s" in k or "params" in k
            else f"{k} {v}" if k == "sequences" else f"{k} {v:.1f}"
            for k, v in b.items())
        if args.measured:
            line += f"  measured {args.measured[i]:,.0f} = {args.measured[i] / b['output tok/s bound']:.2f} of the bound"
        print(line, file=sys.stdout)


if __name__ == "__main__":
    main()
