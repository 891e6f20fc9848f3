#!/usr/bin/env python
"""Offline generation throughput: jaxserve vs HF transformers ``generate`` on the same model.

    python scripts/bench_throughput.py [--batch-sizes 1,16] [--prompt-len 128] [--output-len 64]
        [--num-prompts 16] [--model HF_FOLDER] [--dataset sharegpt.json] [--threads N|auto]
        [--kv-cache-gib G] [--max-num-batched-tokens N] [--skip-hf | --skip-jax]

Both engines run in this one process, on the CPU, in float32, with the same weights (by default
the SmolLM2-135M-Instruct GGUF converted once to an HF folder under $JAXSERVE_CACHE/hf, which both
load), the same prompts (first human turns of ShareGPT conversations with at least
``--prompt-len`` tokens, cut to exactly ``--prompt-len`` tokens), greedy decoding and exactly
``--output-len`` new tokens per prompt (jaxserve: ``ignore_eos``; HF: no end-of-sequence token,
so that it neither stops at one nor masks it, as ``ignore_eos`` does not).

For each batch size B the prompts go in consecutive groups of B: jaxserve gets each group as one
``LLM.generate`` call (continuous batching, max_num_seqs = the largest B), HF as one batched
``generate`` (left padding; all prompts have the same length, so there is none). Throughput is
output tokens / wall time over all groups, prefill included. Both are warmed up with one group
before timing; jaxserve's start-up (loading and compiling every bucket ahead of time) is not
timed and is reported separately. jaxserve runs with prefix caching off, since the same prompts
come back in the warm-up and at every batch size. The last column compares the greedy tokens of
the two.

Prints a markdown table (and the environment) to stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import sys
import time

from sharegpt import SAMPLE, first_turns

def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _int_list(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return out


def _threads(s: str) -> str:
    if s != "auto" and not (s.isdigit() and int(s) >= 1):
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {s!r}")
    return s


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_throughput.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 16], help="comma-separated (default 1,16)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per prompt (default 64)")
    p.add_argument("--num-prompts", type=int, default=16,
                   help="prompts per batch size, rounded up to a multiple of it (default 16)")
    p.add_argument("--model", default=None,
                   help="HF folder loaded by both (default: the SmolLM2 GGUF converted to an HF folder)")
    p.add_argument("--dataset", default=str(SAMPLE),
                   help="ShareGPT JSON file (default: the repo's sample, data/)")
    p.add_argument("--threads", type=_threads, default="auto",
                   help="torch intra-op threads: a number, or 'auto' (default): for each batch size, "
                        "the faster of 1..cores on a short warm-up run (on a shared, busy machine "
                        "torch's OpenMP threads can run several times slower than one thread)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="jaxserve KV pool size (default: the engine's, 2 GiB on CPU)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="jaxserve token budget per step (default 512)")
    p.add_argument("--skip-hf", action="store_true", help="time jaxserve only")
    p.add_argument("--skip-jax", action="store_true", help="time HF only")
    return p


def default_hf_folder() -> pathlib.Path:
    """The default GGUF converted once to an HF folder (float32 safetensors, Q/K un-permuted)."""
    cache = pathlib.Path(os.environ.get("JAXSERVE_CACHE", os.path.expanduser("~/.cache/jaxserve")))
    out = cache / "hf" / "SmolLM2-135M-Instruct"
    if not (out / "config.json").exists():
        from jaxserve.model_loader import load_checkpoint, save_hf_folder

        log(f"converting the default GGUF to an HF folder at {out}")
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        save_hf_folder(tmp, load_checkpoint(None))
        tmp.rename(out)
    return out


def load_prompts(path: str, tokenizer, n: int, prompt_len: int) -> list[list[int]]:
    out = []
    for text in first_turns(path):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= prompt_len:
            out.append(ids[:prompt_len])
            if len(out) == n:
                return out
    raise SystemExit(f"--dataset: only {len(out)} prompts with >= {prompt_len} tokens in {path}")


def groups(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class HFRunner:
    def __init__(self, folder: pathlib.Path, output_len: int):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.output_len = output_len
        self.pad_id = self.model.config.eos_token_id
        if isinstance(self.pad_id, list):
            self.pad_id = self.pad_id[0]

    def run(self, batch: list[list[int]], output_len: int | None = None) -> list[list[int]]:
        torch = self.torch
        n = output_len or self.output_len
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                eos_token_id=None, pad_token_id=self.pad_id, temperature=None, top_p=None,
                top_k=None,
            )
        return [row[width:].tolist() for row in out]


class JaxRunner:
    def __init__(self, folder: pathlib.Path, output_len: int, max_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, kv_cache_gib: float | None):
        from jaxserve import LLM, SamplingParams

        t0 = time.perf_counter()
        extra = {} if kv_cache_gib is None else {"kv_cache_gib": kv_cache_gib}
        # Prefix caching off: the warm-up and every batch size reuse the same prompts, and HF has
        # no cache across generate calls, so hits would skip prefills HF has to do.
        self.llm = LLM(str(folder), log=log, max_model_len=max_len, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs),
                       enable_prefix_caching=False, **extra)
        self.startup_s = time.perf_counter() - t0
        self.SamplingParams = SamplingParams
        self.output_len = output_len

    def run(self, batch: list[list[int]], output_len: int | None = None) -> list[list[int]]:
        sp = self.SamplingParams(temperature=0, max_tokens=output_len or self.output_len, ignore_eos=True)
        outs = self.llm.generate(batch, sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def pick_torch_threads(runner: "HFRunner", batch: list[list[int]]) -> int:
    """The fastest torch thread count (1..cores) on a short run of this batch shape."""
    torch = runner.torch
    best = None
    for n in range(1, (os.cpu_count() or 1) + 1):
        torch.set_num_threads(n)
        runner.run(batch, output_len=2)
        t0 = time.perf_counter()
        runner.run(batch, output_len=8)
        dt = time.perf_counter() - t0
        log(f"torch threads {n}: warm-up {dt:.2f}s")
        if best is None or dt < best[1]:
            best = (n, dt)
    torch.set_num_threads(best[0])
    return best[0]


def time_runner(runner, prompts: list[list[int]], bs: int, output_len: int) -> tuple[float, list]:
    runner.run(prompts[:bs], output_len=min(output_len, 8))  # warm-up: this batch shape
    results = []
    t0 = time.perf_counter()
    for g in groups(prompts, bs):
        results.extend(runner.run(g))
    dt = time.perf_counter() - t0
    return dt, results


def versions() -> str:
    import importlib.metadata as md

    parts = [f"Python {platform.python_version()}"]
    for pkg in ("jax", "jaxlib", "flax", "torch", "transformers"):
        try:
            parts.append(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(parts)


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    load0 = os.getloadavg()[0]
    if args.threads != "auto":
        import torch

        torch.set_num_threads(int(args.threads))
    folder = pathlib.Path(args.model) if args.model else default_hf_folder()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    max_bs = max(args.batch_sizes)
    n_prompts = {bs: -(-max(args.num_prompts, bs) // bs) * bs for bs in args.batch_sizes}
    prompts = load_prompts(args.dataset, tokenizer, max(n_prompts.values()), args.prompt_len)
    log(f"{len(prompts)} prompts of {args.prompt_len} tokens, {args.output_len} output tokens each")

    page = 16
    max_len = -(-(args.prompt_len + args.output_len) // page) * page
    jax_runner = hf_runner = None
    if not args.skip_jax:
        jax_runner = JaxRunner(folder, args.output_len, max_len, max_bs, args.max_num_batched_tokens,
                               args.kv_cache_gib)
        log(f"jaxserve start-up (load + compile, not timed below): {jax_runner.startup_s:.1f}s")
    if not args.skip_hf:
        hf_runner = HFRunner(folder, args.output_len)
    import torch

    rows = []
    for bs in args.batch_sizes:
        ps = prompts[: n_prompts[bs]]
        n_tok = len(ps) * args.output_len
        row = {"bs": bs, "n": len(ps)}
        for name, runner in (("jax", jax_runner), ("hf", hf_runner)):
            if runner is None:
                continue
            if name == "hf":
                if args.threads == "auto":
                    pick_torch_threads(runner, ps[:bs])
                row["threads"] = torch.get_num_threads()
            log(f"batch {bs}: timing {name} on {len(ps)} prompts")
            dt, toks = time_runner(runner, ps, bs, args.output_len)
            assert all(len(t) == args.output_len for t in toks), f"{name} produced other lengths"
            row[name] = n_tok / dt
            row[name + "_toks"] = toks
            log(f"batch {bs}: {name} {n_tok} tokens in {dt:.1f}s = {n_tok / dt:.1f} tok/s")
        rows.append(row)

    print(f"\n- date: {datetime.date.today().isoformat()}")
    print(f"- device: {cpu_model()}, {os.cpu_count()} cores, load average at start {load0:.2f}, "
          f"at end {os.getloadavg()[0]:.2f}")
    print(f"- versions: {versions()}")
    print(f"- model: {folder.name} (float32), prompts {args.prompt_len} tokens, "
          f"{args.output_len} output tokens, greedy")
    if jax_runner:
        kv = jax_runner.llm.engine.config.kv_cache_gib
        print(f"- jaxserve: max_num_seqs {max_bs}, max_num_batched_tokens "
              f"{max(args.max_num_batched_tokens, max_bs)}, max_model_len {max_len}, kv_cache_gib {kv}; "
              f"start-up (load + compile all buckets, not timed): {jax_runner.startup_s:.1f}s")
    print()
    print("| batch | prompts | jaxserve out tok/s | HF transformers out tok/s (torch threads) | ratio | "
          "greedy tokens identical |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        j, h = r.get("jax"), r.get("hf")
        ratio = f"{j / h:.2f}x" if j and h else "-"
        same = "-"
        if j and h:
            same_seqs = sum(a == b for a, b in zip(r["jax_toks"], r["hf_toks"]))
            same = f"{same_seqs}/{r['n']} sequences"
        fmt = lambda v: f"{v:.1f}" if v else "-"  # noqa: E731
        th = f" ({r['threads']})" if h else ""
        print(f"| {r['bs']} | {r['n']} | {fmt(j)} | {fmt(h)}{th} | {ratio} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
