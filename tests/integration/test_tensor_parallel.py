"""Tensor parallelism on fake CPU devices (issue 15, docs/parallelism.md): greedy outputs at
TP = 2, 3, 4 equal TP = 1's (docs/design.md section 7), offline and through the server; the
step's collectives are the Megatron layout's; sizes the model or the machine cannot take are
refused with an error naming the flag.

Each JAX process with fake devices is a subprocess (``XLA_FLAGS`` is read when JAX starts): the
offline runs share one (``tp_offline`` in conftest.py), the server runs its engine in its own.
"""

import concurrent.futures
import subprocess
import sys

import openai
import pytest
from server_utils import REPO, Server

from tests.integration import tp_utils

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name,tp", [("default", 3), ("llama", 2), ("llama", 4), ("qwen3", 2),
                                     ("qwen3", 4)])
def test_offline_greedy_matches_tp1(name, tp, tp_offline, hf_smollm, tiny_hf_models):
    ref, ours = tp_offline[f"{name}:1"], tp_offline[f"{name}:{tp}"]
    assert ours["prompt_ids"] == ref["prompt_ids"]
    hf = hf_smollm if name == "default" else tiny_hf_models[name]
    tp_utils.assert_greedy_matches(ours["output_ids"], ref["output_ids"], ref["prompt_ids"], hf,
                                   f"{name} offline at TP={tp}")


@pytest.mark.parametrize("tp", [2, 4])
def test_step_collectives_are_megatrons(tp, tp_offline):
    # Tiny Llama, 2 layers: an all-reduce after the embedding, after each O and each down
    # projection; one all-gather, of the [S, V] logits (never of a weight).
    found = tp_offline["collectives"][str(tp)]
    assert found["ops"] == {"all-reduce": 1 + 2 * 2, "all-gather": 1}
    padded_vocab = -(-tp_utils.TINY["llama"][2]["vocab_size"] // tp) * tp
    num_seqs = tp_utils.TP_FLAGS["max_num_seqs"]
    assert found["gathered"][0].startswith(f"f32[{num_seqs},{padded_vocab}]"), found


def _serve_greedy(server: Server, prompts: list[str]) -> list:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
    name = client.models.list().data[0].id

    def one(prompt):
        r = client.completions.create(model=name, prompt=prompt, max_tokens=tp_utils.MAX_TOKENS,
                                      temperature=0, extra_body={"return_token_ids": True})
        return r.choices[0]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # batched, as served
        return list(pool.map(one, prompts))


def test_server_tp3_default_model_matches_tp1(tp_offline, tp_prompts, hf_smollm):
    server = Server("--tensor-parallel-size", "3", *tp_utils.TP_CLI_FLAGS,
                    env=tp_utils.fake_devices_env())
    try:
        choices = _serve_greedy(server, tp_prompts)
        log = server.output()
    finally:
        server.stop()
    assert "split over 3 devices (tensor parallel)" in log
    ref = tp_offline["default:1"]
    assert [c.prompt_token_ids for c in choices] == ref["prompt_ids"]
    tp_utils.assert_greedy_matches([c.token_ids for c in choices], ref["output_ids"],
                                   ref["prompt_ids"], hf_smollm, "default model served at TP=3")


def _serve_cli(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve.serve", "--port", "0", *flags],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=tp_utils.fake_devices_env())


@pytest.mark.parametrize("tp,error", [
    ("2", "--tensor-parallel-size 2 does not divide the model's 9 attention heads; sizes that "
          "fit this model: 1, 3"),
    ("4", "--tensor-parallel-size 4 does not divide the model's 9 attention heads"),
    ("5", "--tensor-parallel-size 5 exceeds the 4 cpu device(s) JAX sees"),
])
def test_server_refuses_sizes_that_do_not_fit(tp, error):
    # The SmolLM2 shape as dummy weights: the same heads as the default model, nothing to read.
    proc = _serve_cli("--model", "smollm2-135m", "--load-format", "dummy",
                      "--tensor-parallel-size", tp)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
