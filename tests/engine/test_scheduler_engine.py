"""On the real SmolLM2 engine, chunked prefill, automatic prefix caching
and preemption give the same greedy outputs (docs/architecture.md, "Testing numerics", margins from
HF transformers' own model over the same tokens), and the scheduler does what it claims along the
way.

The engine has SMALL_ENGINE's limits (those of the engine tests' shared one: a 128-token
budget, 1,024-token sequences, a pool of 362 usable pages of 16 tokens). The scheduler's token
budget and the prefix-caching switch are runtime settings, so the 64-vs-128 and on-vs-off
comparisons run on the same compiled buckets, and each test puts them back; the preemption test
shrinks the pool to 64 free pages by holding the rest.
"""

import collections
import contextlib

import pytest

from jaxserve.engine import EngineCoreRequest
from jaxserve.sampling_params import SamplingParams
from tests.conftest import SMALL_ENGINE, sharegpt_prompts
from tests.greedy import compare_greedy, hf_greedy_margins, hf_greedy_tokens

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def engine():
    """An engine of its own (the tests step its scheduler by hand, from a fresh state), with the
    shared engine's limits, so its programs come from the executable cache."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.core import EngineCore

    return EngineCore(EngineConfig(**SMALL_ENGINE), log=lambda s: None)


def long_token_prompt(tokenizer, n_tokens: int, skip: int) -> list[int]:
    ids: list[int] = []
    for text in sharegpt_prompts(200, max_chars=4000, skip=skip):
        ids += tokenizer.encode(text + "\n\n", add_special_tokens=False)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise AssertionError("not enough ShareGPT text")


@contextlib.contextmanager
def scheduler_settings(engine, *, budget=None, caching=None):
    s = engine.scheduler
    saved = s.max_num_batched_tokens, s.kv.enable_caching
    if budget is not None:
        s.max_num_batched_tokens = budget
    if caching is not None:
        s.kv.enable_caching = caching
    try:
        yield
    finally:
        s.max_num_batched_tokens, s.kv.enable_caching = saved


class Run:
    """Adds requests to the engine and steps it until nothing is left, recording each step
    (outputs of requests added by others are recorded too)."""

    _next = 0

    def __init__(self, engine, prompts, max_tokens=MAX_TOKENS, ignore_eos=False, share_with=None):
        self.engine = engine
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        self.ids = []
        for p in prompts:
            rid = f"scheduler-{Run._next}"
            Run._next += 1
            engine.add_request(EngineCoreRequest(rid, p, sp))
            self.ids.append(rid)
        if share_with is not None:  # one record for requests of both runs
            self.tokens, self.cached, self.computed = share_with.tokens, share_with.cached, share_with.computed
        else:
            self.tokens = collections.defaultdict(list)
            self.cached = {}
            self.computed = collections.defaultdict(int)  # tokens the model ran for each request

    def step(self):
        engine = self.engine
        sched = engine.scheduler.schedule()
        assert sched.total_num_scheduled_tokens, "no progress"
        for rid, n in sched.num_scheduled_tokens.items():
            self.computed[rid] += n
        sampled = engine.runner.get_output(engine.runner.execute(sched))
        for o in engine.scheduler.update(sched, sampled):
            self.tokens[o.request_id] += o.new_token_ids
            self.cached[o.request_id] = o.num_cached_tokens
        return sched

    def finish(self, max_steps=2000, on_step=None):
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                self.outputs = [self.tokens[rid] for rid in self.ids]
                return self
            sched = self.step()
            if on_step is not None:
                on_step(sched)
        raise AssertionError(f"not finished after {max_steps} steps: the engine hangs")


def run(engine, prompts, max_tokens=MAX_TOKENS, on_step=None) -> Run:
    return Run(engine, prompts, max_tokens).finish(on_step=on_step)


def assert_identical(hf_model, prompts, ours, ref, what):
    stopped_early = 0
    for p, a, b in zip(prompts, ours, ref):
        margins = hf_greedy_margins(hf_model, p, b)
        same, n = compare_greedy(a, b, margins)
        assert same, f"{what}: outputs differ at token {n}: {a} vs {b}"
        stopped_early += n < len(b)
    assert stopped_early <= len(prompts) // 4, f"{what}: {stopped_early} comparisons stopped at near-ties"


def test_chunked_prefill_same_output_and_decodes_advance(engine, hf_smollm):
    tok = engine.tokenizer
    budget = engine.config.max_num_batched_tokens  # the largest compiled bucket
    prompt_len = engine.config.max_model_len - MAX_TOKENS
    long_prompt = long_token_prompt(tok, prompt_len, skip=0)
    shorts = [tok.encode(t, add_special_tokens=False)[:40] for t in sharegpt_prompts(3, skip=900)]
    with scheduler_settings(engine, budget=budget, caching=False):
        alone = run(engine, [long_prompt]).outputs[0]
    # The reference is HF's own greedy choice at each position (up to a near-tie).
    ok, compared = compare_greedy(hf_greedy_tokens(hf_smollm, long_prompt, alone), alone,
                                  hf_greedy_margins(hf_smollm, long_prompt, alone))
    assert ok, f"the {budget}-token-chunk prefill's output parts from HF at token {compared}"

    half = budget // 2
    with scheduler_settings(engine, budget=half, caching=False):
        shorts_run = Run(engine, shorts, max_tokens=40, ignore_eos=True)
        shorts_run.step()  # the short prompts' prefill and first tokens
        long_run = Run(engine, [long_prompt], share_with=shorts_run)
        long_req = engine.scheduler.requests[long_run.ids[0]]
        chunks = []
        while long_req.num_computed_tokens < long_req.num_prompt_tokens:
            decoded = [len(shorts_run.tokens[rid]) for rid in shorts_run.ids]
            sched = long_run.step()
            assert sched.total_num_scheduled_tokens <= half
            chunks += [n for r, n in sched.num_scheduled_tokens.items() if r == long_req.request_id]
            assert [len(shorts_run.tokens[rid]) for rid in shorts_run.ids] == [d + 1 for d in decoded], \
                "a running decode did not advance during the long prefill"
        long_run.finish()
    chunked = long_run.outputs[0]
    assert len(chunks) >= prompt_len // half and max(chunks) == half - 3
    assert_identical(hf_smollm, [long_prompt], [chunked], [alone], f"budget {half} vs {budget}")
    assert not engine.has_unfinished_requests()


def test_prefix_cache_hits_and_same_outputs_as_caching_off(engine, hf_smollm):
    tok = engine.tokenizer
    prefix = long_token_prompt(tok, 400, skip=300)
    tails = [tok.encode(t, add_special_tokens=False)[:30] for t in sharegpt_prompts(2, skip=500)]
    prompts = [prefix + t for t in tails]
    with scheduler_settings(engine, caching=False):
        off = [run(engine, [p]).outputs[0] for p in prompts]
    with scheduler_settings(engine, caching=True):
        before = engine.get_stats()
        first = run(engine, [prompts[0]])
        second = run(engine, [prompts[1]])
        after = engine.get_stats()
    assert first.cached[first.ids[0]] == 0
    cached = second.cached[second.ids[0]]
    assert cached >= len(prefix) // 16 * 16, cached  # its whole pages
    # Only the tail was computed: prompt - cached, plus one token per decode step after the first.
    assert second.computed[second.ids[0]] == len(prompts[1]) - cached + len(second.outputs[0]) - 1
    assert after.prefix_cache_hits - before.prefix_cache_hits == cached
    assert after.prefix_cache_queries - before.prefix_cache_queries == sum(map(len, prompts))
    assert_identical(hf_smollm, prompts, [first.outputs[0], second.outputs[0]], off, "caching on vs off")


def test_preemption_under_a_small_pool_same_outputs(engine, hf_smollm):
    tok = engine.tokenizer
    stream = long_token_prompt(tok, 16 * 120, skip=40)
    prompts = [stream[i * 120:(i + 1) * 120] for i in range(16)]  # distinct: no shared prefix
    pool = engine.scheduler.kv.block_pool
    # Shrink the pool for this test: a ballast holds all but 64 pages (16 requests of 120 + 16
    # tokens need up to 16 x 9 = 144 at once).
    ballast = pool.allocate(pool.num_free_pages - 64)
    try:
        before = engine.get_stats().num_preemptions_total
        usage = []
        squeezed = run(engine, prompts,
                       on_step=lambda s: usage.append(engine.get_stats().kv_cache_usage)).outputs
        preemptions = engine.get_stats().num_preemptions_total - before
        assert preemptions > 0
        assert max(usage) > 0.95
    finally:
        pool.free(ballast)
    assert engine.get_stats().kv_cache_usage == 0.0
    # Unconstrained: the whole pool (362 pages) holds all 16 at once.
    ref = run(engine, prompts).outputs
    assert engine.get_stats().num_preemptions_total - before == preemptions
    assert_identical(hf_smollm, prompts, squeezed, ref, "preempted vs unconstrained")


def test_prefix_cache_and_preemption_counters_reach_metrics():
    from jaxserve.engine import SchedulerStats
    from jaxserve.metrics import Metrics

    m = Metrics("m")
    m.update_stats(SchedulerStats(num_preemptions_total=3, prefix_cache_queries=100, prefix_cache_hits=64))
    text = m.render().decode()
    assert 'jaxserve:num_preemptions_total{model_name="m"} 3.0' in text
    assert 'jaxserve:prefix_cache_queries_total{model_name="m"} 100.0' in text
    assert 'jaxserve:prefix_cache_hits_total{model_name="m"} 64.0' in text
