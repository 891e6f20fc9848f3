"""Tiny random Llama (TP=4: KV heads replicated, vocabulary padded) and Qwen3-MoE (TP=2: q/k
norm, tied embeddings, a dense and a sparse layer) served on fake CPU devices give TP=1's greedy outputs (docs/architecture.md,
"Testing numerics"; the offline runs of every size are in test_tensor_parallel.py)."""

import pytest
from server_utils import Server

from tests.integration import tp_utils

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name,tp", [("llama", 4), ("qwen3_moe", 2)])
def test_tiny_model_served_tensor_parallel_matches_tp1(name, tp, tiny_tp_folders, tp_offline,
                                                        tp_prompts, tiny_hf_models):
    server = Server("--model", str(tiny_tp_folders[name]), "--tensor-parallel-size", str(tp),
                    *tp_utils.TP_CLI_FLAGS, env=tp_utils.fake_devices_env())
    try:
        choices = tp_utils.serve_greedy(server.url, tp_prompts)
    finally:
        server.stop()
    ref = tp_offline[f"{name}:1"]
    assert [c.prompt_token_ids for c in choices] == ref["prompt_ids"]
    tp_utils.assert_greedy_matches([c.token_ids for c in choices], ref["output_ids"],
                                   ref["prompt_ids"], tiny_hf_models[name],
                                   f"{name} served at TP={tp}")
