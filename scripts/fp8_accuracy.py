"""Accuracy of FP8 weights (``--quantization fp8``) and of the FP8 KV cache, as the teacher-forced
negative log-likelihood of real answers, against float32 and bfloat16 in the same run.

    python scripts/fp8_accuracy.py [--model M] [--num-conversations 100] [--max-len 512] \
        [--variants float32,bfloat16,fp8-weights,fp8-kv] [--json F]
    python scripts/fp8_accuracy.py --url http://127.0.0.1:8000 [...]   # one running server

Data: the first ``--num-conversations`` conversations of the repository's ShareGPT sample
(``--dataset`` for another file) that open with a human turn and a gpt answer; each is the chat
template over [user, assistant], cut to ``--max-len`` tokens. Its score is the NLL (nats per
token) of the answer's tokens, each given everything before it, from one forward over the whole
sequence.

Offline (no ``--url``), every variant runs the model code itself (``llama.forward``, the
platform's attention, a pool of the variant's dtype) in this process:

- ``float32``: float32 weights and KV (the reference);
- ``bfloat16``: bfloat16 weights and KV;
- ``fp8-weights``: the decoder layers' linear projections in FP8 (``jaxserve.models.linear``),
  float32 otherwise;
- ``fp8-kv``: the FP8 KV pool (``pallas_kernels.kv_quant``), float32 otherwise;
- ``fp8-both-bf16``: FP8 weights and KV over bfloat16 (how a GPU serves with both flags).

The rule a format meets: its extra NLL over float32 at most max(0.05 nats, 3 x bfloat16's);
the exit code is 1 when an FP8 variant misses it. With ``--url`` the same conversations are
scored through the server's completions endpoint (``echo`` with ``logprobs`` 0: the prompt's
own log-probabilities) and one row is printed, for whatever flags that server runs with.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request

import numpy as np

from sharegpt import SAMPLE, prompt_answer_pairs

PAGE_SIZE = 16
# name -> (dtype, --quantization, --kv-cache-dtype)
VARIANTS = {
    "float32": ("float32", None, "float32"),
    "bfloat16": ("bfloat16", None, "bfloat16"),
    "fp8-weights": ("float32", "fp8", "float32"),
    "fp8-kv": ("float32", None, "fp8"),
    "fp8-both-bf16": ("bfloat16", "fp8", "fp8"),
}
RULE_FLOOR = 0.05  # nats
RULE_FACTOR = 3.0


def conversations(tokenizer, path, num: int, max_len: int) -> list[tuple[list[int], int]]:
    """(token ids, index of the answer's first token) of the first ``num`` conversations that
    keep at least one answer token within ``max_len``."""
    out = []
    for user, answer in prompt_answer_pairs(path):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": user}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
        full = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
            tokenize=True, return_dict=False)
        if full[: len(prompt)] != prompt or len(prompt) >= max_len:
            continue
        out.append((full[:max_len], len(prompt)))
        if len(out) == num:
            break
    return out


def nll_of_logprobs(logprobs: np.ndarray) -> tuple[float, int]:
    return float(-logprobs.sum()), len(logprobs)


def offline_scores(args, variant: str, ckpt, seqs) -> list[tuple[float, int]]:
    """(NLL sum, tokens) of each sequence under ``variant``, at the model level."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models import llama
    from jaxserve.models.registry import build_params, resolve_kv_cache_dtype
    from jaxserve.platforms import current_platform
    from pallas_kernels import get_attention_fn, kv_quant

    dtype, quantization, kv = VARIANTS[variant]
    platform = current_platform()
    config, params = build_params(ckpt.hf_config, ckpt.weights, jnp.dtype(dtype),
                                  quantization=quantization)
    kv_dtype = resolve_kv_cache_dtype(kv)
    attention_fn = get_attention_fn(platform.attention_backend, platform.interpret_pallas)
    t = args.max_len
    pages = -(-t // PAGE_SIZE)

    @jax.jit
    def score(params, ids, md, rows, targets, k, v):
        logits, _, _ = llama.forward(config, params, ids, md, k, v, rows,
                                     attention_fn=attention_fn)
        lp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]

    shape = (config.num_kv_heads, pages + 1, PAGE_SIZE, config.head_dim)
    out = []
    for ids, start in seqs:
        n = len(ids)
        pos = np.zeros(t, np.int32)
        pos[:n] = np.arange(n)
        slots = np.zeros(t, np.int32)  # padding writes into the null page 0
        slots[:n] = (1 + pos[:n] // PAGE_SIZE) * PAGE_SIZE + pos[:n] % PAGE_SIZE
        md = llama.AttentionMetadata(
            positions=pos, slot_mapping=slots, query_start_loc=np.array([0, n], np.int32),
            seq_lens=np.array([n], np.int32),
            block_tables=np.arange(1, pages + 1, dtype=np.int32)[None, :])
        tokens = np.zeros(t, np.int32)
        tokens[:n] = ids
        rows = np.zeros(t, np.int32)  # position i predicts token i + 1
        targets = np.zeros(t, np.int32)
        m = n - start
        rows[:m] = np.arange(start - 1, n - 1)
        targets[:m] = ids[start:]
        k = [kv_quant.pool_zeros(shape, kv_dtype) for _ in range(config.num_layers)]
        v = [kv_quant.pool_zeros(shape, kv_dtype) for _ in range(config.num_layers)]
        lp = np.asarray(score(params, tokens, md, rows, targets, k, v))[:m]
        out.append(nll_of_logprobs(lp))
    return out


def server_scores(url: str, seqs) -> list[tuple[float, int]]:
    """(NLL sum, tokens) of each sequence from the server's echoed prompt log-probabilities."""
    with urllib.request.urlopen(f"{url}/v1/models") as r:
        model = json.load(r)["data"][0]["id"]
    out = []
    for ids, start in seqs:
        body = {"model": model, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0,
                "temperature": 0}
        req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req) as r:
            lps = json.load(r)["choices"][0]["logprobs"]["token_logprobs"]
        out.append(nll_of_logprobs(np.array(lps[start:len(ids)], np.float64)))
    return out


def summarize(scores: list[tuple[float, int]]) -> dict:
    total, tokens = map(sum, zip(*scores))
    return {"nll": total / tokens, "tokens": tokens, "conversations": len(scores)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="as the engine's --model (default: the "
                    "default model)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--url", default=None, help="score through this running server instead")
    ap.add_argument("--dataset", default=str(SAMPLE))
    ap.add_argument("--num-conversations", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=512, help="tokens of each conversation")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        ap.error(f"--variants: unknown {', '.join(unknown)} (choose from {', '.join(VARIANTS)})")

    from jaxserve.model_loader import load_checkpoint

    ckpt = load_checkpoint(args.model, args.load_format, with_tokenizer=True)
    seqs = conversations(ckpt.tokenizer, args.dataset, args.num_conversations, args.max_len)
    if args.url:
        rows = {"server": summarize(server_scores(args.url, seqs))}
    else:
        rows = {v: summarize(offline_scores(args, v, ckpt, seqs)) for v in variants}
    ok = True
    ref = rows.get("float32", {}).get("nll")
    bf16_extra = rows["bfloat16"]["nll"] - ref if ref is not None and "bfloat16" in rows else None
    for name, row in rows.items():
        line = f"{name:14s} NLL {row['nll']:.4f} nats/token over {row['tokens']} answer tokens"
        if ref is not None and name != "float32":
            row["extra_nll"] = row["nll"] - ref
            line += f", {row['extra_nll']:+.4f} over float32"
            if name.startswith("fp8") and bf16_extra is not None:
                row["bound"] = max(RULE_FLOOR, RULE_FACTOR * bf16_extra)
                row["within_bound"] = row["extra_nll"] <= row["bound"]
                ok &= row["within_bound"]
                line += f" (bound {row['bound']:.4f}: {'ok' if row['within_bound'] else 'MISSED'})"
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model or "default", "max_len": args.max_len,
                       "variants": rows}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
