"""Scheduler with a model-free runner (tests/unit/kv_fakes.py): token budget, sequence cap,
chunked prefill, prefix-cache hits, preemption order, and outputs unchanged by all of them."""

import random

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.sampling_params import StructuredOutputsParams
from tests.unit.kv_fakes import FakeRunner, make_request, run_to_completion

PS = 4


def make(num_pages=256, budget=32, max_seqs=4, max_model_len=512, caching=True):
    sched = Scheduler(
        KVCacheManager(num_pages, PS, enable_caching=caching),
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
        eos_token_ids=(0,),
    )
    return sched, FakeRunner(num_pages, PS)


def check_invariants(sched):
    """Budget and sequence cap, each request's pages cover its tokens, reference counts equal
    the number of live holders, and usage counts referenced pages only."""

    def on_step(out):
        n_tok = out.total_num_scheduled_tokens
        assert n_tok == sum(out.num_scheduled_tokens.values()) <= sched.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= sched.max_num_seqs
        assert len(sched.running) <= sched.max_num_seqs
        pool = sched.kv.block_pool
        holders = [0] * pool.num_pages
        for r in sched.running:
            for p in r.block_ids:
                holders[p] += 1
        for r in sched.waiting:
            assert r.block_ids == []
        assert holders == pool.ref_counts
        assert set(pool.free_queue) == {p for p in range(1, pool.num_pages) if holders[p] == 0}
        used = sum(1 for h in holders[1:] if h)
        assert abs(sched.kv.usage() - used / pool.num_usable_pages) < 1e-12

    return on_step


def random_prompts(n, seed, shared_prefix=()):
    rng = random.Random(seed)
    return [list(shared_prefix) + [rng.randrange(10, 1000) for _ in range(rng.randrange(1, 90))]
            for _ in range(n)]


def run(prompts, max_tokens=6, async_scheduling=False, stop_token_ids=(), **kw):
    sched, runner = make(**kw)
    for i, p in enumerate(prompts):
        sched.add_request(make_request(i, p, max_tokens=max_tokens,
                                       stop_token_ids=list(stop_token_ids)))
    out = run_to_completion(sched, runner, on_step=check_invariants(sched),
                            async_scheduling=async_scheduling)
    assert not sched.requests and not sched.running and not sched.waiting
    assert sched.kv.block_pool.num_free_pages == sched.kv.block_pool.num_usable_pages
    assert sched.kv.usage() == 0
    return out, sched


def pairs(out):
    return list(out.num_scheduled_tokens.items())


def test_budget_and_seq_cap_every_step_and_outputs_unchanged():
    prompts = random_prompts(20, seed=1)
    ref, _ = run(prompts, budget=4096, max_seqs=64, caching=False)
    for budget, seqs in [(8, 2), (16, 4), (32, 3), (64, 8)]:
        out, _ = run(prompts, budget=budget, max_seqs=seqs)
        assert out == ref
    assert all(len(v) == 6 for v in ref.values())


def test_long_prompt_is_chunked_and_decodes_keep_advancing():
    sched, runner = make(budget=16, max_seqs=4)
    short = make_request("short", [5, 6, 7], max_tokens=40)
    sched.add_request(short)
    sched.update(out := sched.schedule(), runner.execute(out))  # short: prefill, first token
    long = make_request("long", list(range(100, 200)), max_tokens=2)
    sched.add_request(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = sched.schedule()
        assert pairs(out)[0] == ("short", 1)  # running first: a decode token every step
        chunks += [n for r, n in pairs(out) if r == "long"]
        before = short.num_output_tokens
        sched.update(out, runner.execute(out))
        assert short.num_output_tokens == before + 1
    assert chunks == [15] * 6 + [10]
    assert long.num_output_tokens == 1


def test_waiting_requests_admitted_in_arrival_order_after_running():
    sched, runner = make(budget=10, max_seqs=2)
    for i in range(3):
        sched.add_request(make_request(i, [1 + i] * 6, max_tokens=3))
    out = sched.schedule()
    assert pairs(out) == [("0", 6), ("1", 4)]
    sched.update(out, runner.execute(out))
    out = sched.schedule()  # seq cap 2: "2" waits
    assert pairs(out) == [("0", 1), ("1", 2)]


def test_shared_prefix_hits_and_same_outputs_as_caching_off():
    prefix = list(range(300, 340))  # 10 pages of 4
    prompts = random_prompts(12, seed=2, shared_prefix=prefix)
    ref, off = run(prompts, caching=False)
    assert off.prefix_cache_hits == 0
    out, on = run(prompts)
    assert out == ref
    assert on.prefix_cache_queries == sum(len(p) for p in prompts)
    # Requests admitted after the first prefix was computed reuse all 10 pages.
    assert on.prefix_cache_hits >= 40 * (12 - on.max_num_seqs)


def test_num_cached_tokens_reported_and_only_the_tail_computed():
    sched, runner = make(budget=64)
    a = make_request("a", list(range(50, 90)), max_tokens=2)
    sched.add_request(a)
    run_to_completion(sched, runner)
    b = make_request("b", list(range(50, 90)) + [7, 8], max_tokens=2)
    sched.add_request(b)
    out = sched.schedule()
    assert pairs(out) == [("b", 2)] and out.new_reqs[0].num_computed_tokens == 40
    outs = sched.update(out, runner.execute(out))
    assert outs[0].num_cached_tokens == 40


def test_preemption_newest_first_and_outputs_unchanged():
    prompts = random_prompts(16, seed=3)
    ref, _ = run(prompts, max_tokens=20, budget=4096, max_seqs=16, caching=False)
    for caching in (False, True):
        # 25 usable pages of 4 tokens: far too few for 16 requests of up to ~110 tokens at once.
        out, sched = run(prompts, max_tokens=20, num_pages=26, budget=64, max_seqs=16, caching=caching)
        assert out == ref
        assert sched.num_preemptions > 0


def test_preempts_the_newest_running_request():
    sched, runner = make(num_pages=7, budget=64, max_seqs=3)  # 6 usable pages
    reqs = [make_request(i, [10 + i] * 8, max_tokens=10) for i in range(3)]  # 2 pages each
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    assert sched.kv.block_pool.num_free_pages == 0
    out = sched.schedule()  # request 0 needs a 3rd page for position 8: request 2 is preempted
    assert list(out.num_scheduled_tokens) == ["0", "1"]
    assert reqs[2].status == RequestStatus.PREEMPTED and reqs[2].block_ids == []
    assert reqs[2].num_computed_tokens == 0 and sched.waiting[0] is reqs[2]
    assert sched.num_preemptions == 1
    sched.update(out, runner.execute(out))
    while sched.num_preemptions == 1:  # decodes until position 12 needs a 4th page
        out = sched.schedule()
        sched.update(out, runner.execute(out))
    assert list(out.num_scheduled_tokens) == ["0"]
    assert list(sched.waiting) == [reqs[1], reqs[2]]  # older first


def test_abort_frees_pages():
    sched, runner = make(budget=8)
    a = make_request("a", list(range(20)))
    b = make_request("b", list(range(20, 40)))
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    sched.abort_requests(["a", "b", "missing"])
    assert not sched.has_unfinished_requests()
    assert sched.kv.usage() == 0.0 and not sched.running and not sched.waiting


def test_stops_on_eos_stop_token_and_max_model_len():
    sched, _ = make(max_model_len=12)
    r = make_request("r", [1, 2, 3], max_tokens=100)
    r.sampling_params.ignore_eos = False
    assert sched._check_stop(r, 0) == ("stop", None)  # EOS: no stop_reason (vLLM's)
    r.sampling_params.stop_token_ids = [77]
    assert sched._check_stop(r, 77) == ("stop", 77)
    r.all_token_ids += [5] * 9
    assert sched._check_stop(r, 5) == ("length", None)


def test_min_tokens_holds_stops_back_unless_a_grammar_gave_them():
    """Before min_tokens a stop token does not stop a request, except a constrained one: the
    sampler lets a stop through only when the grammar allows nothing else (it is complete)."""
    sched, _ = make()
    r = make_request("r", [1, 2, 3], max_tokens=100)
    r.sampling_params.ignore_eos, r.sampling_params.min_tokens = False, 5
    r.all_token_ids += [0]
    assert sched._check_stop(r, 0) == (None, None)
    r.sampling_params.structured_outputs = StructuredOutputsParams(choice=["a"])
    assert sched._check_stop(r, 0) == ("stop", None)


def test_async_scheduling_gives_the_same_outputs():
    """Each step scheduled before the previous step's tokens reach the scheduler (EngineCore's
    async loop): the same tokens as the synchronous loop, through chunked prefill, prefix-cache
    hits, preemption, and stops (stop token ids end some requests while a step that includes
    them is in flight)."""
    prefix = list(range(300, 340))
    prompts = random_prompts(16, seed=5, shared_prefix=prefix)
    stop = dict(stop_token_ids=list(range(10, 60)))
    for kw in [dict(), dict(budget=16, max_seqs=3), dict(num_pages=60, budget=64, max_seqs=16)]:
        for caching in (False, True):
            sync, s1 = run(prompts, max_tokens=20, caching=caching, **kw, **stop)
            asyn, s2 = run(prompts, max_tokens=20, caching=caching, async_scheduling=True,
                          **kw, **stop)
            assert asyn == sync
            assert any(len(v) < 20 for v in sync.values())  # some stopped on a stop token
    assert s2.num_preemptions > 0


def run_choices(prompts, n, async_scheduling=False, **kw):
    """Each prompt as one request with n choices (choice i seeded i); returns outputs by
    engine id and the scheduler."""
    sched, runner = make(**kw)
    for i, p in enumerate(prompts):
        sched.add_request(make_request(i, p, max_tokens=8, n=n))
    out = run_to_completion(sched, runner, on_step=check_invariants(sched),
                            async_scheduling=async_scheduling)
    assert not sched.requests and sched.kv.usage() == 0
    assert sched.kv.block_pool.num_free_pages == sched.kv.block_pool.num_usable_pages
    return out, sched


def alone(prompt, seed, **kw):
    """One sequence of ``prompt`` seeded ``seed``, by itself: what a choice must produce."""
    sched, runner = make(**kw)
    req = make_request("x", prompt, max_tokens=8)
    req.seed = seed
    sched.add_request(req)
    return run_to_completion(sched, runner)["x"]


def test_n_choices_fork_once_the_prompt_is_computed():
    """Choices 1.. fork in the step that computes choice 0's prompt (pages shared, the partly
    filled last page copied): each choice's tokens equal its seed's run alone (so every step
    read the right K/V), and the prompt is computed once, with prefix caching on or off, for
    prompts that end mid-page and on a page boundary, chunked or not, sync or async."""
    prompts = [list(range(100, 137)), list(range(200, 232))]  # 37 tokens, and 8 pages of 4
    for caching in (False, True):
        for async_scheduling in (False, True):
            for budget in (64, 16):
                out, sched = run_choices(prompts, 3, async_scheduling, caching=caching,
                                         budget=budget, max_seqs=8)
                for i, p in enumerate(prompts):
                    for c in range(3):
                        assert out[f"{c}_{i}"] == alone(p, c, caching=caching), (i, c)
                assert sched.prompt_tokens_computed == sum(map(len, prompts))
                assert sched.num_preemptions == 0


def test_choices_without_room_start_on_their_own():
    """With fewer sequence slots than choices, the others wait and run as requests of their
    own: same tokens, the prompt computed again for them."""
    p = list(range(100, 137))
    out, sched = run_choices([p], 4, max_seqs=2, caching=False)
    assert [out[f"{c}_0"] for c in range(4)] == [alone(p, c) for c in range(4)]
    assert sched.prompt_tokens_computed == 4 * len(p)


def test_aborting_a_choice_before_the_fork():
    """Aborting choice 0 before its prompt is done starts the others on their own; aborting a
    waiting choice drops it alone."""
    p = list(range(100, 170))
    sched, runner = make(budget=16, max_seqs=8)
    sched.add_request(make_request("a", p, max_tokens=8, n=3))
    sched.update(out := sched.schedule(), runner.execute(out))  # a first prompt chunk
    sched.abort_requests(["2_a", "0_a"])
    assert [r.request_id for r in sched.waiting] == ["1_a"]
    out = run_to_completion(sched, runner)
    assert list(out) == ["1_a"] and out["1_a"] == alone(p, 1, budget=16)
    assert not sched.requests and sched.kv.usage() == 0


def test_prompt_logprob_requests_skip_cache_hits_and_cap_their_chunks():
    """A request wanting prompt log-probabilities computes every prompt position (no prefix
    cache hits) in chunks of at most max_prompt_logprob_rows positions a step, shared by all
    such requests of the step."""
    prefix = list(range(300, 340))
    sched, runner = make(budget=64, max_seqs=8)
    sched.max_prompt_logprob_rows = 12
    sched.add_request(make_request("warm", prefix + [5], max_tokens=1))
    run_to_completion(sched, runner)
    sched.add_request(make_request("a", prefix + [6, 7], max_tokens=2, prompt_logprobs=2))
    sched.add_request(make_request("b", prefix + [8], max_tokens=2, prompt_logprobs=0))
    sched.add_request(make_request("c", prefix + [9], max_tokens=2))
    a, b = sched.requests["a"], sched.requests["b"]
    out = sched.schedule()
    assert a.num_cached_tokens == 0
    assert out.prompt_logprobs == {"a"}  # a took all 12 rows: b waits, c with it (FIFO)
    assert out.num_scheduled_tokens == {"a": 12}
    sched.update(out, runner.execute(out))

    def capped(o):
        assert sum(n for r, n in o.num_scheduled_tokens.items() if r in o.prompt_logprobs) <= 12

    for async_scheduling in (False, True):
        if async_scheduling:
            a = make_request("a2", prefix + [6, 7], max_tokens=2, prompt_logprobs=2)
            b = make_request("b2", prefix + [8], max_tokens=2, prompt_logprobs=1)
            sched.add_request(a)
            sched.add_request(b)
        run_to_completion(sched, runner, on_step=capped, async_scheduling=async_scheduling)
        assert not sched.requests
        # Every prompt token after the first, once, in order.
        assert [ids[0] for ids in a.prompt_logprobs.logprob_token_ids] == a.prompt_token_ids[1:]
        assert [ids[0] for ids in b.prompt_logprobs.logprob_token_ids] == b.prompt_token_ids[1:]
