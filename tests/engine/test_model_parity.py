"""Parity with HF transformers (torch, CPU, float32), docs/architecture.md, "Testing numerics":
prompt logits within 1e-4 relative per row, and identical 32-token greedy continuations."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from jaxserve.config import ModelConfig
from jaxserve.models import llama, sharding
from jaxserve.sampling_params import SamplingParams
from pallas_kernels.reference import attention
from tests.conftest import sharegpt_prompts
from tests.greedy import compare_greedy, hf_greedy_margins
from tests.tiny_models import (HF_CLASSES, TINY, TINY_CONFIGS, VARIANT_CONFIGS, save_tiny_model,
                               tiny_model as build_tiny_model, tiny_phi3_longrope)

PAGE = 16


def our_prompt_logits(hf_config: dict, weights: dict, ids: list[int]) -> np.ndarray:
    """[len(ids), V] logits of one prompt through our model (reference attention), written into
    a paged pool with a scrambled block table."""
    config = ModelConfig.from_hf_config(hf_config)
    return prompt_logits(config, llama.params_from_hf(config, weights, jnp.float32), ids)


def prompt_logits(config: ModelConfig, params: dict, ids: list[int], mesh=None) -> np.ndarray:
    """``our_prompt_logits`` of built params, split over ``mesh`` if given (``sharding``)."""
    n = len(ids)
    pages = -(-n // PAGE)
    rng = np.random.default_rng(0)
    block_table = rng.permutation(np.arange(1, pages + 8))[:pages].astype(np.int32)
    pos = np.arange(n, dtype=np.int32)
    md = llama.AttentionMetadata(
        positions=pos,
        slot_mapping=(block_table[pos // PAGE] * PAGE + pos % PAGE).astype(np.int32),
        query_start_loc=np.array([0, n], np.int32),
        seq_lens=np.array([n], np.int32),
        block_tables=block_table[None],
    )
    kv_heads = sharding.Layout.of(config, sharding.mesh_size(mesh)).num_kv_heads
    pool = jnp.zeros((kv_heads, pages + 8, PAGE, config.head_dim))
    if mesh is not None:
        pool = jax.device_put(pool, sharding.kv_sharding(mesh))
    pool = [pool] * config.num_layers
    logits, _, _ = jax.jit(
        lambda p, t, md, k, v, li: llama.forward(config, p, t, md, k, v, li,
                                                 attention_fn=attention, mesh=mesh)
    )(params, np.asarray(ids, np.int32), md, pool, pool, np.arange(n))
    return np.asarray(logits)


def assert_logits_close(ours: np.ndarray, ref: np.ndarray):
    rel = np.linalg.norm(ours - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert rel.max() <= 1e-4, f"worst row relative error {rel.max():.2e}"


def assert_greedy_identical(llm, hf_model, prompts_ids: list[list[int]], max_tokens: int = 32):
    outs = llm.generate(prompts_ids, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    full = 0
    for ids, out in zip(prompts_ids, outs):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )[0, len(ids):].tolist()
        margins = hf_greedy_margins(hf_model, ids, ref)
        ok, compared = compare_greedy(out.outputs[0].token_ids, ref, margins)
        assert ok, f"diverged at token {compared}: ours {out.outputs[0].token_ids} vs HF {ref}"
        full += compared == len(ref)
    assert full >= max(1, len(prompts_ids) - 1), "near-ties cut most comparisons short"


def test_smollm2_prompt_logits_match_hf(smollm, hf_smollm):
    prompt = sharegpt_prompts(1, max_chars=1500)[0]
    ids = smollm.tokenizer.encode(prompt)[:300]
    with torch.no_grad():
        ref = hf_smollm(torch.tensor([ids])).logits[0].numpy()
    assert_logits_close(our_prompt_logits(smollm.hf_config, smollm.weights, ids), ref)


def test_smollm2_greedy_matches_hf(smollm_llm, hf_smollm):
    tok = smollm_llm.tokenizer
    chats = [[{"role": "user", "content": p}] for p in sharegpt_prompts(3, max_chars=400)]
    ids = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in chats]
    assert_greedy_identical(smollm_llm, hf_smollm, ids)


def test_default_model_answers_paris(smollm_llm):
    out = smollm_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=16), use_tqdm=False,
    )
    assert "Paris" in out[0].outputs[0].text


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny_model(request, tmp_path_factory, smollm):
    """A tiny random HF model saved as an HF folder (with the default model's tokenizer)."""
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, save_tiny_model(request.param, folder, smollm.tokenizer)


def router_margin(hf_model, ids: list[int], top_k: int) -> float:
    """The smallest gap, over the prompt's tokens and the sparse layers, between a token's k-th
    and (k+1)-th router probability in HF's float32 forward. Float32 rounding moves these
    probabilities by ~1e-7: where every gap is 10x that, both implementations must pick the
    same experts, and a mismatch is a bug, not a near-tie."""
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), output_router_logits=True)
    gaps = [torch.topk(torch.softmax(r.float(), -1), top_k + 1).values for r in out.router_logits]
    return min(float((g[:, top_k - 1] - g[:, top_k]).min()) for g in gaps)


def test_tiny_models_match_hf(tiny_model):
    from jaxserve import LLM

    name, folder, hf_model = tiny_model
    hf_config = json.loads((folder / "config.json").read_text())
    config = ModelConfig.from_hf_config(hf_config)
    assert config.architecture == HF_CLASSES[name]
    # As the checkpoint stores them (transformers 5 holds MoE experts fused in memory).
    weights = load_file(folder / "model.safetensors")
    rng = np.random.default_rng(1)
    ids = rng.integers(0, TINY["vocab_size"], size=200).tolist()
    if config.num_experts:
        assert any(config.sparse_layers) and router_margin(hf_model, ids, config.num_experts_per_tok) > 1e-6
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    assert_logits_close(our_prompt_logits(hf_config, weights, ids), ref)

    # A 16-token budget: 5 token buckets to compile, the longer prompts in chunks.
    llm = LLM(str(folder), log=lambda s: None, max_model_len=256, max_num_batched_tokens=16,
              max_num_seqs=4, kv_cache_gib=0.01)
    prompts = [rng.integers(0, TINY["vocab_size"], size=n).tolist() for n in (5, 40, 100)]
    assert_greedy_identical(llm, hf_model, prompts)


@pytest.mark.parametrize("name", sorted(VARIANT_CONFIGS))
def test_config_variants_match_hf(name, tmp_path):
    """Prompt logits of other configs of each family (options and shapes the tiny models leave
    out) equal HF's on a prompt longer than their windows."""
    hf_model = build_tiny_model(name)
    hf_model.save_pretrained(tmp_path)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    ids = np.random.default_rng(2).integers(0, TINY["vocab_size"], size=120).tolist()
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    assert_logits_close(our_prompt_logits(hf_config, load_file(tmp_path / "model.safetensors"),
                                          ids), ref)


def test_phi3_longrope_matches_hf_in_its_regime(tmp_path):
    """LongRoPE's factor set is fixed by max_model_len (ModelConfig._rope_fields): the long
    factors past the original 64 tokens equal HF on a 200-token prompt, the short ones (a
    server of at most 64 tokens) on a 60-token prompt; each differs from the other set."""
    torch.manual_seed(0)
    hf_model = transformers.Phi3ForCausalLM(tiny_phi3_longrope()).eval()
    hf_model.save_pretrained(tmp_path)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    weights = load_file(tmp_path / "model.safetensors")
    rng = np.random.default_rng(3)
    for n, max_model_len, other in ((200, None, 64), (60, 64, None)):
        ids = rng.integers(0, TINY["vocab_size"], size=n).tolist()
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].numpy()
        for length, close in ((max_model_len, True), (other, False)):
            config = ModelConfig.from_hf_config(hf_config, length)
            ours = prompt_logits(config, llama.params_from_hf(config, weights, jnp.float32), ids)
            if close:
                assert_logits_close(ours, ref)
            else:
                assert np.abs(ours - ref).max() > 1e-2
