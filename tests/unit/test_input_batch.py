"""InputBatch's block table changes: a copy that applies only ``take_block_table_changes``
stays equal to the host table through admissions, new pages, departures and slot reuse (the
model runner keeps such a copy on the device)."""

import numpy as np

from jaxserve.core.scheduler_output import NewRequestData, SchedulerOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.input_batch import InputBatch


def _new(rid: str, pages: list[int]) -> NewRequestData:
    return NewRequestData(req_id=rid, token_ids=[1, 2, 3], num_prompt_tokens=3,
                          sampling_params=SamplingParams(), seed=0, block_ids=pages,
                          num_computed_tokens=0, stop_token_ids=[])


def test_changes_keep_a_copy_equal_to_the_table():
    rng = np.random.default_rng(0)
    batch = InputBatch(max_num_seqs=4, max_model_len=256, max_pages_per_seq=16)
    copy = np.zeros_like(batch.block_table)
    running: dict[str, int] = {}  # req_id -> pages held
    for step in range(200):
        sched = SchedulerOutput()
        for rid in list(running):
            if rng.random() < 0.2:
                sched.finished_req_ids.add(rid)
                del running[rid]
            elif running[rid] < 16 and rng.random() < 0.5:
                n = int(rng.integers(1, 16 - running[rid] + 1))
                sched.new_block_ids[rid] = rng.integers(1, 1000, n).tolist()
                running[rid] += n
        while len(running) < 4 and rng.random() < 0.7:
            rid = f"r{step}-{len(running)}"
            n = int(rng.integers(1, 17))
            sched.new_reqs.append(_new(rid, rng.integers(1, 1000, n).tolist()))
            running[rid] = n
        batch.update_states(sched)
        rows, cols, pages = batch.take_block_table_changes()
        copy[rows, cols] = pages
        np.testing.assert_array_equal(copy, batch.block_table, err_msg=f"step {step}")
    rows, _, _ = batch.take_block_table_changes()
    assert len(rows) == 0  # taken once
