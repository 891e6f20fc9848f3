"""Shared by the tensor-parallel tests: engine flags, tiny models, fake-device subprocesses and
the greedy comparison against TP=1 (docs/architecture.md, "Testing numerics")."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys

from tests.conftest import cli_flags

REPO = pathlib.Path(__file__).resolve().parents[2]
# Small limits keep start-up compilation short: 5 token buckets and 3 samplers per engine.
TP_FLAGS = {"max_model_len": 512, "max_num_batched_tokens": 16, "max_num_seqs": 4,
            "kv_cache_gib": 0.1}
TP_CLI_FLAGS = cli_flags(TP_FLAGS)
MAX_TOKENS = 16
NUM_PROMPTS = 8
MIN_FULL = 6  # comparisons (of NUM_PROMPTS) that must run in full, past every near-tie
# Fake CPU devices of every tensor-parallel process: TP 2, 3 and 4 all fit.
NUM_DEVICES = 4

# Tiny random models whose vocabularies do not split evenly (padded rows) and whose KV heads are
# fewer than 4 devices (replicated at TP=4). Large init so that greedy choices are clear.
TINY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(vocab_size=49153, num_attention_heads=4, num_key_value_heads=2,
                   tie_word_embeddings=False)),
    # A dense first layer and a sparse second one (each expert split by columns).
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(vocab_size=49154, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                       tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0])),
}


def fake_devices_env(n: int = NUM_DEVICES) -> dict:
    """The environment of a subprocess whose JAX sees ``n`` CPU devices."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def make_tiny_folder(root: pathlib.Path, name: str, tokenizer) -> pathlib.Path:
    """A tiny random HF folder (``TINY[name]``, 2 layers, hidden 64) with ``tokenizer``."""
    import torch
    import transformers

    config_cls, model_cls, shape = TINY[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=1024,
        eos_token_id=2, initializer_range=0.2, **shape)
    folder = root / f"tiny-{name}"
    getattr(transformers, model_cls)(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_offline(runs: list[dict], prompts: list[str], collectives_of: str | None = None,
                devices: int = NUM_DEVICES) -> dict:
    """``tests/integration/tp_generate.py`` in a subprocess with ``devices`` fake CPU devices."""
    spec = {"prompts": prompts, "max_tokens": MAX_TOKENS, "flags": TP_FLAGS, "runs": runs,
            "collectives_of": collectives_of}
    proc = subprocess.run([sys.executable, "-m", "tests.integration.tp_generate"],
                          input=json.dumps(spec), capture_output=True, text=True, timeout=1200,
                          cwd=REPO, env=fake_devices_env(devices))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def serve_greedy(url: str, prompts: list[str]) -> list:
    """Greedy completions of ``prompts`` sent at once to the server at ``url`` through the
    official client; each choice with its ``prompt_token_ids`` and ``token_ids``."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    name = client.models.list().data[0].id

    def one(prompt):
        r = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"return_token_ids": True})
        return r.choices[0]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # batched, as served
        return list(pool.map(one, prompts))


def assert_greedy_matches(outputs: list[list[int]], reference: list[list[int]],
                          prompt_ids: list[list[int]], hf_model, what: str) -> None:
    """Each output equals the TP=1 reference up to the reference's first near-tie (margins from
    HF transformers on the same weights), and at least MIN_FULL of them run in full."""
    from tests.greedy import compare_greedy, hf_greedy_margins

    assert len(outputs) == len(reference) == NUM_PROMPTS
    full = 0
    for i, (ours, ref, ids) in enumerate(zip(outputs, reference, prompt_ids)):
        margins = hf_greedy_margins(hf_model, ids, ref)
        ok, compared = compare_greedy(ours, ref, margins)
        assert ok, f"{what}: prompt {i} diverged from TP=1 at token {compared}: {ours} vs {ref}"
        full += compared == len(ref)
    assert full >= MIN_FULL, f"{what}: only {full} of {NUM_PROMPTS} compared in full (near-ties)"


def run_python(code: str, devices: int = NUM_DEVICES) -> dict:
    """``python -c code`` with ``devices`` fake CPU devices; returns the JSON it prints last."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env=fake_devices_env(devices))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])
