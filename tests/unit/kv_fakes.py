"""A model-free stand-in for ModelRunner that checks the scheduler's KV bookkeeping.

It keeps the pool as page -> list of token ids, writes each scheduled token at its slot
(block_ids[pos // page_size], pos % page_size) as the real step does, then reads the whole
context back through the block table: a page mix-up (wrong prefix-cache hit, a page freed while in
use, a stale page after preemption) shows up as a context that differs from the request's tokens.
The sampled token is a deterministic function of the context read back, so the outputs of two
runs are equal exactly when every step saw the right K/V.
"""

from jaxserve.core.request import Request
from jaxserve.engine import EngineCoreRequest
from jaxserve.sampling_params import SamplingParams


def make_request(rid, prompt, max_tokens=4, **sp) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **sp)
    return Request(EngineCoreRequest(str(rid), list(prompt), params), seed=0)


class FakeRunner:
    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.pages = [[None] * page_size for _ in range(num_pages)]

    def execute(self, sched) -> list[int]:
        ps = self.page_size
        out = []
        for req, n in sched.scheduled:
            c = req.num_computed_tokens
            bt = req.block_ids
            assert len(bt) * ps >= c + n, "fewer pages than tokens"
            assert 0 not in bt, "the null page was handed to a request"
            for pos in range(c, c + n):
                self.pages[bt[pos // ps]][pos % ps] = req.all_token_ids[pos]
            context = [self.pages[bt[pos // ps]][pos % ps] for pos in range(c + n)]
            assert context == req.all_token_ids[: c + n], f"request {req.request_id} read wrong K/V"
            out.append(hash(tuple(context)) % 1000 + 10)
        return out


def run_to_completion(scheduler, runner, max_steps=100_000, on_step=None) -> dict[str, list[int]]:
    """Step until every request finishes; returns request id -> output tokens."""
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        sched = scheduler.schedule()
        if on_step is not None:
            on_step(sched)
        assert sched.scheduled, "no progress with unfinished requests"
        for o in scheduler.update(sched, runner.execute(sched)):
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("did not finish")
