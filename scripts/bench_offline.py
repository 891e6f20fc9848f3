"""Offline engine throughput on random token prompts (e.g. a Llama-3.1-8B-shaped dummy model on
a GPU): start-up time, output tokens/s for a batch of requests with fixed prompt and output
lengths (greedy, ignore_eos), optionally against HF transformers ``generate`` in the same run,
decode at batch 1 against the weight-streaming floor, and the device's idle share in steady
decode.

    python scripts/bench_offline.py --model llama-3.1-8b --load-format dummy \
        --num-prompts 64 --prompt-len 512 --output-len 128 [--hf-reference] [--batch1] \
        [--idle-batch 256]

Engine flags left out take the engine's defaults (on a GPU: 256 sequences, 8,192-token budget,
the model's max_model_len).

``--hf-reference``: before the engine starts (JAX then takes most of the GPU's memory), a child
process builds the same shapes in HF transformers (random bf16 weights on the GPU) and times
``generate`` with a static KV cache (``cache_implementation="static"``) on the same prompt ids,
after one untimed warm-up run of the same shapes; the ratio is jaxserve / HF output tokens/s.

``--batch1``: one request of 16 prompt tokens and 512 output tokens; the floor is the
parameters' bytes read once per token at ``--peak-tbs`` (H200: 4.23 TB/s copy peak).

``--idle-batch N``: N requests decoding together (``--idle-prompt-len`` in, enough out to stay
in decode): the serving loop's wall time per step over ``--idle-steps`` steady decode steps,
against the device time of one of those steps' compiled call replayed back to back with the
same inputs (dispatched ``--idle-steps`` times, blocked once). Idle share = 1 - device / loop.
"""

import argparse
import multiprocessing as mp
import time

import jax
import numpy as np
from profile_engine import (
    add_engine_args,
    add_requests,
    engine_flags,
    finish,
    run_until_decoding,
)

from jaxserve import LLM, SamplingParams


def hf_generate(hf_config: dict, prompts: list[list[int]], output_len: int, out: mp.Queue):
    """Child process: HF transformers ``generate`` with a static KV cache on random bf16
    weights of ``hf_config``'s shapes, on the GPU. Puts (output tok/s, warm-up s, versions)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(hf_config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.tensor(prompts, device="cuda")
    kw = {"attention_mask": torch.ones_like(ids), "do_sample": False, "max_new_tokens": output_len,
              "min_new_tokens": output_len, "cache_implementation": "static", "pad_token_id": 0}
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, **kw)  # warm-up: same shapes (a static cache compiles for them)
        warm = time.perf_counter() - t0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen = model.generate(ids, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    n_out = (gen.shape[1] - ids.shape[1]) * ids.shape[0]
    out.put((n_out / dt, warm, f"torch {torch.__version__}, transformers {transformers.__version__}"))


def run_hf_reference(hf_config, prompts, output_len):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=hf_generate, args=(hf_config, prompts, output_len, q))
    p.start()
    result = q.get()
    p.join()
    return result


def time_generate(llm, prompts, sp) -> tuple[float, int]:
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def measure_idle(llm: LLM, rng, batch: int, prompt_len: int, steps: int):
    """(loop ms per step, device ms per step) in steady decode at ``batch`` sequences."""
    runner = llm.engine.runner
    ids = add_requests(llm, rng, batch, prompt_len, 4 * steps + 64, "idle")
    recorded = {}

    def recording(step):
        def call(*args):
            recorded["args"] = args
            return step(*args)
        return call

    decode_bucket = min(b for b in runner.token_buckets if b >= batch)
    # the decode-only step where the platform builds one (ModelRunner.decode_buckets)
    table = runner.compiled.decode_step
    if decode_bucket not in table:
        table = runner.compiled.step
    original = table[decode_bucket]
    run_until_decoding(llm, batch)
    table[decode_bucket] = recording(original)
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    loop = (time.perf_counter() - t0) / steps
    table[decode_bucket] = original

    # The last step's inputs again, before any other program runs: the KV pools (3, 4) and
    # the block table (5) it donated are the runner's now, and each call takes the one
    # before's.
    args = list(recorded["args"])
    args[3], args[4], args[5] = runner.k_cache, runner.v_cache, runner.block_table
    for i in range(steps + 1):  # the first call is a warm-up
        if i == 1:
            jax.block_until_ready(args[3])
            t0 = time.perf_counter()
        sampled, _, _, args[3], args[4], args[5] = original(*args)
    jax.block_until_ready(sampled)
    device = (time.perf_counter() - t0) / steps
    runner.k_cache, runner.v_cache, runner.block_table = args[3], args[4], args[5]
    finish(llm, ids)
    return loop * 1e3, device * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(ap)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-reference", action="store_true",
                    help="time HF transformers generate (static cache) on the same prompts first")
    ap.add_argument("--batch1", action="store_true", help="also time decode at batch 1")
    ap.add_argument("--peak-tbs", type=float, default=4.23,
                    help="memory bandwidth for the batch-1 floor, TB/s (default: H200 copy peak)")
    ap.add_argument("--idle-batch", type=int, default=0, help="measure idle share at this batch")
    ap.add_argument("--idle-prompt-len", type=int, default=1000)
    ap.add_argument("--idle-steps", type=int, default=100)
    args = ap.parse_args()
    log = lambda s: print(f"[engine] {s}", flush=True)

    rng = np.random.default_rng(args.seed)
    hf = None
    if args.hf_reference:
        from jaxserve.model_loader import load_checkpoint

        ckpt = load_checkpoint(args.model, args.load_format)
        vocab = min(ckpt.hf_config["vocab_size"], len(ckpt.tokenizer))
        prompts = [rng.integers(10, vocab, args.prompt_len).tolist() for _ in range(args.num_prompts)]
        hf = run_hf_reference(ckpt.hf_config, prompts, args.output_len)
        print(f"HF transformers generate (static cache, {hf[2]}): {hf[0]:.0f} output tok/s "
              f"(warm-up run {hf[1]:.1f}s)", flush=True)

    t0 = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, attention_backend=args.attention_backend,
              log=log, **engine_flags(args))
    startup = time.perf_counter() - t0
    vocab = min(llm.engine.model_config.vocab_size, len(llm.tokenizer))
    if hf is None:
        prompts = [rng.integers(10, vocab, args.prompt_len).tolist() for _ in range(args.num_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up: same workload
    elapsed, out_tokens = time_generate(llm, prompts, sp)
    tok_s = out_tokens / elapsed
    print(f"start-up {startup:.1f}s; {args.num_prompts} requests x ({args.prompt_len} in, "
          f"{args.output_len} out) in {elapsed:.2f}s: {tok_s:.0f} output tok/s, "
          f"{(out_tokens + args.num_prompts * args.prompt_len) / elapsed:.0f} total tok/s", flush=True)
    if hf is not None:
        print(f"jaxserve / HF static cache: {tok_s / hf[0]:.2f}x", flush=True)

    if args.batch1:
        one = [rng.integers(10, vocab, 16).tolist()]
        sp1 = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
        llm.generate(one, sp1, use_tqdm=False)
        dt, n = time_generate(llm, one, sp1)
        weights = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.params))
        floor = args.peak_tbs * 1e12 / weights
        print(f"decode batch 1 (16 in, 512 out): {n / dt:.1f} tok/s = {n / dt / floor:.0%} of the "
              f"floor ({weights / 1e9:.2f} GB of parameters at {args.peak_tbs} TB/s = "
              f"{floor:.0f} tok/s)", flush=True)

    if args.idle_batch:
        loop, device = measure_idle(llm, rng, args.idle_batch, args.idle_prompt_len,
                                    args.idle_steps)
        print(f"steady decode at batch {args.idle_batch}: serving loop {loop:.2f} ms/step, the "
              f"same compiled step back to back {device:.2f} ms/step: device idle "
              f"{max(0.0, 1 - device / loop):.1%}", flush=True)


if __name__ == "__main__":
    main()
