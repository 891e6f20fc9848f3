"""The device copy of the block table: the step writes the entries changed since the last step
before it gathers its rows, and when there are more than one step takes (BLOCK_TABLE_WRITES),
the earlier ones go first by the separate write program; after each step the copy equals the
InputBatch's table."""

import numpy as np

from jaxserve.core.scheduler_output import NewRequestData, SchedulerOutput
from jaxserve.models import llama
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker import model_runner
from jaxserve.worker.model_runner import ModelRunner
from tests.unit.test_step_no_control_flow import attention_stub, tiny_config


def _new(rid: str, prompt_len: int, pages: list[int]) -> NewRequestData:
    return NewRequestData(req_id=rid, token_ids=list(range(3, 3 + prompt_len)),
                          num_prompt_tokens=prompt_len,
                          sampling_params=SamplingParams(temperature=0, max_tokens=4), seed=0,
                          block_ids=pages, num_computed_tokens=0, stop_token_ids=[])


def test_the_device_block_table_follows_the_host_one(monkeypatch):
    monkeypatch.setattr(model_runner, "BLOCK_TABLE_WRITES", 3)  # before the programs compile
    config = tiny_config()
    runner = ModelRunner(config, llama.random_params(config, np.float32), page_size=4,
                         max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
                         kv_dtype=np.float32, attention_fn=attention_stub)
    runner.compile_buckets(32, log=lambda _: None)
    runner.allocate_kv_cache(32)
    host = runner.input_batch.block_table

    # 8 pages in one step: two writes of 3 go first, the step writes the last 2
    sched = SchedulerOutput(num_scheduled_tokens={"a": 6}, samples={"a": False},
                            new_reqs=[_new("a", 30, list(range(10, 18)))],
                            total_num_scheduled_tokens=6)
    runner.get_output(runner.execute(sched))
    np.testing.assert_array_equal(np.asarray(runner.block_table), host)
    assert list(host[runner.input_batch.req_index["a"], :8]) == list(range(10, 18))

    # a second request and a page for the first: 3 entries, the step's alone
    sched = SchedulerOutput(num_scheduled_tokens={"a": 6, "b": 2}, samples={"a": False, "b": False},
                            new_reqs=[_new("b", 5, [20, 21])], new_block_ids={"a": [18]},
                            total_num_scheduled_tokens=8)
    runner.get_output(runner.execute(sched))
    np.testing.assert_array_equal(np.asarray(runner.block_table), host)
    assert host[runner.input_batch.req_index["a"], 8] == 18
