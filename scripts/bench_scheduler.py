"""Scheduler CPU time per step with the model step replaced by a stub (goal <= 1 ms at
256 running requests).

Fills the engine with --num-requests requests (prompt --prompt-len tokens, ignore_eos, enough
max_tokens to outlive the run), runs their prefills, then times --steps decode steps of
``schedule()`` + ``update()``; the stub "model" samples token 7 for every request and costs
nothing.
Prefix caching is on (the default), so full pages are hashed and registered as decodes fill them.

  python scripts/bench_scheduler.py --num-requests 256 --steps 2000
"""

import argparse
import statistics
import time

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import ModelRunnerOutput
from jaxserve.engine import EngineCoreRequest
from jaxserve.sampling_params import SamplingParams


def stub(out) -> ModelRunnerOutput:
    return ModelRunnerOutput({rid: 7 for rid, samples in out.samples.items() if samples}, {}, {})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--no-enable-prefix-caching", action="store_true")
    args = ap.parse_args()

    n, ps = args.num_requests, args.page_size
    max_len = args.prompt_len + args.steps + 256
    num_pages = n * (-(-max_len // ps)) + 1
    sched = Scheduler(
        KVCacheManager(num_pages, ps, enable_caching=not args.no_enable_prefix_caching),
        max_num_seqs=n, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_len, eos_token_ids=(2,),
    )
    sp = SamplingParams(temperature=0, max_tokens=args.steps + 200, ignore_eos=True)
    for i in range(n):
        prompt = [(i * 7919 + j) % 40000 + 10 for j in range(args.prompt_len)]
        sched.add_request(Request(EngineCoreRequest(str(i), prompt, sp), seed=0))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        out = sched.schedule()
        sched.update(out, stub(out))
    assert len(sched.running) == n
    wall, cpu = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        out = sched.schedule()
        sched.update(out, stub(out))
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
        assert len(out.num_scheduled_tokens) == n
    print(f"{n} running requests, page {ps}, prefix caching "
          f"{'off' if args.no_enable_prefix_caching else 'on'}, {args.steps} decode steps "
          f"(schedule + update), per step:")
    for name, ts in (("CPU time (process_time)", cpu), ("wall time (perf_counter)", wall)):
        ms = sorted(t * 1e3 for t in ts)
        print(f"  {name}: mean {statistics.mean(ms):.3f} ms, p50 {ms[len(ms) // 2]:.3f} ms, "
              f"p99 {ms[int(len(ms) * 0.99)]:.3f} ms")


if __name__ == "__main__":
    main()
