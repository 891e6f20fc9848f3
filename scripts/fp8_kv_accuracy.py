"""Accuracy of the FP8 KV cache against the unquantized pool, in the same run.

    python scripts/fp8_kv_accuracy.py [--model M] [--num-prompts 20] [--max-tokens 32] \
        [--kv-cache-dtype fp8|bfloat16]

For each of ``--num-prompts`` real prompts (the first human turns of the repository's ShareGPT
sample, ``--dataset`` for another file, each cut to ``--max-prompt-tokens``):
  1. greedy-decodes ``--max-tokens`` tokens twice at the model level (``llama.forward``, the
     engine's attention ops), once with the pool in the model's dtype and once in
     ``--kv-cache-dtype`` (FP8: ``pallas_kernels.kv_quant``; bfloat16 for scale), and compares
     the two token lists with docs/architecture.md's "Testing numerics" near-tie rule (equal up
     to the unquantized run's first near-tie: its two best logits within 1e-3);
  2. feeds the prompt plus the unquantized run's tokens once through each pool and compares the
     logits at those positions: max and mean absolute difference.
Prints one line per prompt and a summary; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model_loader import load_checkpoint
from jaxserve.models import llama
from jaxserve.models.registry import build_params, resolve_kv_cache_dtype
from jaxserve.platforms import current_platform
from pallas_kernels import get_attention_fn, kv_quant
from sharegpt import SAMPLE, first_turns

NEAR_TIE = 1e-3
PAGE_SIZE = 16


class Sequence:
    """One sequence's model-level steps over its own pool of ``max_len`` tokens (pages 1..)."""

    def __init__(self, config, params, max_len: int, kv_dtype, step):
        self.params, self.step = params, step
        self.bucket = max_len
        pages = -(-max_len // PAGE_SIZE)
        shape = (config.num_kv_heads, pages + 1, PAGE_SIZE, config.head_dim)
        self.k = [kv_quant.pool_zeros(shape, kv_dtype) for _ in range(config.num_layers)]
        self.v = [kv_quant.pool_zeros(shape, kv_dtype) for _ in range(config.num_layers)]
        self.block_table = np.arange(1, pages + 1, dtype=np.int32)[None, :]

    def run(self, tokens: list[int], start: int, logits_rows: list[int]) -> np.ndarray:
        """Feed ``tokens`` at positions start.. (the pool holds the ones before); returns the
        logits [len(logits_rows), V] of those rows of ``tokens``."""
        n = len(tokens)
        t = self.bucket if n > 1 else 1  # two shapes: whole prompts padded, and decode steps
        pos = np.zeros(t, np.int32)
        pos[:n] = start + np.arange(n)
        slots = np.zeros(t, np.int32)  # padding writes into the null page
        slots[:n] = self.block_table[0, pos[:n] // PAGE_SIZE] * PAGE_SIZE + pos[:n] % PAGE_SIZE
        ids = np.zeros(t, np.int32)
        ids[:n] = tokens
        md = llama.AttentionMetadata(
            positions=pos, slot_mapping=slots, query_start_loc=np.array([0, n], np.int32),
            seq_lens=np.array([start + n], np.int32), block_tables=self.block_table)
        rows = np.zeros(self.bucket if n > 1 else 1, np.int32)
        rows[: len(logits_rows)] = logits_rows
        logits, self.k, self.v = self.step(self.params, ids, md, self.k, self.v, rows)
        return np.asarray(logits)[: len(logits_rows)]


def greedy(make, prompt: list[int], max_tokens: int) -> tuple[list[int], np.ndarray]:
    """(tokens, top-2 margins at each) of greedy decoding from ``prompt``."""
    seq = make()
    logits = seq.run(prompt, 0, [len(prompt) - 1])[0]
    out, margins = [], []
    for i in range(max_tokens):
        top2 = np.sort(logits)[-2:]
        margins.append(top2[1] - top2[0])
        out.append(int(np.argmax(logits)))
        if i + 1 < max_tokens:
            logits = seq.run([out[-1]], len(prompt) + i, [0])[0]
    return out, np.array(margins)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto", help="model dtype (and the unquantized pool's)")
    ap.add_argument("--dataset", default=str(SAMPLE))
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-prompt-tokens", type=int, default=480)
    ap.add_argument("--kv-cache-dtype", default="fp8", choices=("fp8", "bfloat16"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    ckpt = load_checkpoint(args.model, args.load_format)
    platform = current_platform()
    dtype = jnp.dtype(platform.dtype if args.dtype == "auto" else args.dtype)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype)
    config, params = build_params(ckpt.hf_config, ckpt.weights, dtype)
    tok = ckpt.tokenizer
    attention_fn = get_attention_fn(platform.attention_backend, platform.interpret_pallas)
    step = jax.jit(lambda p, t, md, k, v, li: llama.forward(
        config, p, t, md, k, v, li, attention_fn=attention_fn), donate_argnums=(3, 4))
    prompts = [p for p in first_turns(args.dataset) if p.strip()][: args.num_prompts]
    bucket = 1 << (args.max_prompt_tokens + args.max_tokens - 1).bit_length()
    rows, agree_prompts, agree_tokens = [], 0, 0
    for i, text in enumerate(prompts):
        ids = tok(text)["input_ids"][: args.max_prompt_tokens]
        make = {quantized: (lambda d=d: Sequence(config, params, bucket, d, step))
                for quantized, d in ((False, dtype), (True, kv_dtype))}
        ref, margins = greedy(make[False], ids, args.max_tokens)
        out, _ = greedy(make[True], ids, args.max_tokens)
        # Compared up to the unquantized run's first near-tie; identical if no token differs
        # before it.
        compared = next((j for j in range(args.max_tokens) if margins[j] < NEAR_TIE),
                        args.max_tokens)
        same = next((j for j in range(args.max_tokens) if out[j] != ref[j]), args.max_tokens)
        identical = same >= compared
        # Teacher-forced: the prompt plus the unquantized run's tokens through each pool.
        full = ids + ref[:-1]
        at = list(range(len(ids) - 1, len(full)))
        l16 = make[False]().run(full, 0, at)
        l8 = make[True]().run(full, 0, at)
        diff = np.abs(l8 - l16)
        row = {"prompt_tokens": len(ids), "identical": identical, "compared": compared,
               "first_divergence": None if identical else same,
               "max_abs_logit_diff": float(diff.max()), "mean_abs_logit_diff": float(diff.mean())}
        rows.append(row)
        agree_prompts += identical
        agree_tokens += same
        print(f"prompt {i:2d} ({len(ids)} tokens): greedy {'same' if identical else 'DIFFERS'}"
              f" (compared {compared}{'' if identical else f', first difference at {same}'}); "
              f"logits |{args.kv_cache_dtype} - {jnp.dtype(dtype).name}| max {diff.max():.4f} "
              f"mean {diff.mean():.5f}", flush=True)
    summary = {
        "model": args.model or "default", "dtype": jnp.dtype(dtype).name,
        "kv_cache_dtype": args.kv_cache_dtype,
        "backend": jax.default_backend(), "prompts": len(rows),
        "greedy_identical_prompts": agree_prompts,
        "tokens_before_first_difference_mean": agree_tokens / max(1, len(rows)),
        "tokens_compared_mean": float(np.mean([r["compared"] for r in rows])),
        "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
        "mean_abs_logit_diff": float(np.mean([r["mean_abs_logit_diff"] for r in rows])),
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "prompts": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
