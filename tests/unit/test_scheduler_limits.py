"""Scheduler limits left unset take the device's defaults; set ones are kept."""

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine.core import resolve_scheduler_limits


def test_device_defaults_and_explicit_values():
    cpu = resolve_scheduler_limits(EngineConfig(), on_gpu=False, max_model_len=4096)
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens, cpu.max_model_len) == (32, 512, 4096)
    gpu = resolve_scheduler_limits(EngineConfig(), on_gpu=True, max_model_len=131072)
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens) == (256, 8192)
    mine = resolve_scheduler_limits(EngineConfig(max_num_seqs=8), on_gpu=True, max_model_len=64)
    assert (mine.max_num_seqs, mine.max_num_batched_tokens, mine.max_model_len) == (8, 8192, 64)
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        resolve_scheduler_limits(EngineConfig(max_num_batched_tokens=16), on_gpu=True,
                                 max_model_len=64)
