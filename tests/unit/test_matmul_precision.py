"""float32 weights multiply in float32 on every backend (``llama.matmul_precision``): the GPU's
default rounds float32 dot operands to TF32, which parts greedy outputs from HF's float32.
16-bit weights keep the default precision."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import llama
from jaxserve.worker.model_runner import ModelRunner
from tests.unit.test_step_no_control_flow import attention_stub, tiny_config

DOT = re.compile(r"stablehlo\.dot_general[^\n]*")


def step_dots(dtype) -> list[str]:
    config = tiny_config()
    runner = ModelRunner(config, llama.random_params(config, dtype), page_size=16,
                         max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
                         kv_dtype=dtype, attention_fn=attention_stub)
    runner.allocate_kv_cache(8)
    args = runner.placeholder_args(runner.k_cache, runner.v_cache)
    text = runner.programs.step[8].lower(*args.step[8]).as_text()
    return DOT.findall(text)


@pytest.mark.parametrize("dtype, precision", [(np.float32, "HIGHEST"), (jnp.bfloat16, "DEFAULT")])
def test_step_dots_take_the_weights_precision(dtype, precision):
    dots = step_dots(dtype)
    assert len(dots) >= 5  # qkv, o, gate_up, down (a layer function), the LM head
    for dot in dots:
        found = re.search(r"precision = \[(\w+), (\w+)\]", dot)
        assert (found.groups() if found else ("DEFAULT", "DEFAULT")) == (precision, precision), dot
