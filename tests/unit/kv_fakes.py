"""A model-free stand-in for ModelRunner that checks the scheduler's KV bookkeeping.

It keeps the pool as page -> list of token ids, writes each scheduled token at its slot
(block_ids[pos // page_size], pos % page_size) as the real step does, then reads the whole
context back through the block table: a page mix-up (wrong prefix-cache hit, a page freed while in
use, a stale page after preemption) shows up as a context that differs from the request's tokens.
The sampled token is a deterministic function of the context read back and the sequence's seed,
so the outputs of two runs are equal exactly when every step saw the right K/V. A forked choice
(``n`` > 1) draws from its parent's context in the step that forks it; the runner copies pages
after the step, as the real one does, so the choice's next step reads its own pages.
"""

from jaxserve.core.request import Request
from jaxserve.core.scheduler_output import ModelRunnerOutput
from jaxserve.engine import EngineCoreRequest, LogprobsLists
from jaxserve.sampling_params import SamplingParams


def make_request(rid, prompt, max_tokens=4, **sp) -> Request:
    """A Request with its other choices (n > 1) attached as EngineCore.add_request does."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **sp)
    req = EngineCoreRequest(str(rid), list(prompt), params)
    parent = Request(req, seed=0)
    for i in range(1, params.n):
        child = Request(req, seed=i, index=i)
        child.fork_parent = parent
        parent.fork_children.append(child)
    return parent


class FakeRunner:
    """Keeps its own copy of each running request from the SchedulerOutputs alone (as the real
    ModelRunner's InputBatch does): no Request objects."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.pages = [[None] * page_size for _ in range(num_pages)]
        self.reqs: dict[str, dict] = {}

    def execute(self, sched) -> ModelRunnerOutput:
        ps = self.page_size
        for rid in sched.finished_req_ids:
            self.reqs.pop(rid, None)
        for r in sched.new_reqs:
            assert r.req_id not in self.reqs
            self.reqs[r.req_id] = {"tokens": list(r.token_ids), "blocks": list(r.block_ids),
                                   "computed": r.num_computed_tokens, "seed": r.seed,
                                   "num_prompt": r.num_prompt_tokens}
        for rid, pages in sched.new_block_ids.items():
            self.reqs[rid]["blocks"] += pages
        assert sched.total_num_scheduled_tokens == sum(sched.num_scheduled_tokens.values())
        out = {}
        for rid, n in sched.num_scheduled_tokens.items():
            st = self.reqs[rid]
            c, bt, tokens = st["computed"], st["blocks"], st["tokens"]
            assert len(bt) * ps >= c + n, "fewer pages than tokens"
            assert 0 not in bt, "the null page was handed to a request"
            # Like the device, this runner knows every token it sampled, even those the
            # scheduler has not been told about yet (async scheduling).
            assert c + n <= len(tokens), "a token nobody has sampled was scheduled"
            for pos in range(c, c + n):
                self.pages[bt[pos // ps]][pos % ps] = tokens[pos]
            if rid in sched.forked_from:  # the parent's last row gives its logits
                assert n == 0
                bt = self.reqs[sched.forked_from[rid]]["blocks"]
            context = [self.pages[bt[pos // ps]][pos % ps] for pos in range(c + n)]
            assert context == tokens[: c + n], f"request {rid} read wrong K/V"
            st["computed"] = c + n
            assert sched.samples[rid] == (c + n == len(tokens))
            if sched.samples[rid]:
                token = hash((tuple(context), st["seed"])) % 1000 + 10
                tokens.append(token)
                out[rid] = token
        for src, dst in sched.copy_pages:
            self.pages[dst] = list(self.pages[src])
        return ModelRunnerOutput(out, {}, self._prompt_logprobs(sched))

    def _prompt_logprobs(self, sched) -> dict:
        """Stand-in prompt log-probabilities: for each position p of the chunk that predicts a
        prompt token, that token (the scheduler's bookkeeping is what is under test)."""
        out = {}
        for rid in sched.prompt_logprobs:
            st = self.reqs[rid]
            end = min(st["computed"], st["num_prompt"] - 1)
            first = st["computed"] - sched.num_scheduled_tokens[rid]
            ids = [[t] for t in st["tokens"][first + 1 : end + 1]]
            if ids:
                out[rid] = (first + 1, LogprobsLists(ids, [[0.0]] * len(ids), [1] * len(ids)))
        return out


def run_to_completion(scheduler, runner, max_steps=100_000, on_step=None,
                      async_scheduling=False) -> dict[str, list[int]]:
    """Step until every request finishes; returns request id -> output tokens. With
    ``async_scheduling`` each step is scheduled before the previous step's tokens reach the
    scheduler, as EngineCore does."""
    outputs: dict[str, list[int]] = {}
    in_flight = None
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and in_flight is None:
            return outputs
        sched = scheduler.schedule()
        if on_step is not None:
            on_step(sched)
        sampled = runner.execute(sched) if sched.total_num_scheduled_tokens else None
        done = []
        if not async_scheduling:
            assert sched.total_num_scheduled_tokens, "no progress with unfinished requests"
            done = [(sched, sampled)]
        else:
            if in_flight is not None:
                done = [in_flight]
            else:
                assert sampled is not None, "no progress with unfinished requests"
            in_flight = (sched, sampled) if sampled is not None else None
        for s, tokens in done:
            for o in scheduler.update(s, tokens):
                outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("did not finish")
