"""LoRA parity with HF transformers + PEFT (float32, CPU; docs/lora.md): one forward over a
batch of rows of the base model and of three adapters (ranks 2, 4 and 8 in a rank-8 pool,
different alphas and target modules, one rsLoRA), read from PEFT folders by the engine's
``LoRAModelManager``; each row's logits equal HF + PEFT's within 1e-4 relative. And the offline
engine with adapters and n-gram drafts: greedy equal to HF + PEFT's."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
from safetensors.numpy import load_file

from jaxserve.config import ModelConfig
from jaxserve.lora.checkpoint import LoRAShapes
from jaxserve.lora.layers import add_pool
from jaxserve.lora.manager import LoRAModelManager
from jaxserve.lora.request import LoRARequest
from jaxserve.models import llama, sharding
from pallas_kernels.reference import attention
from tests.engine.test_model_parity import PAGE, assert_logits_close
from tests.greedy import compare_greedy, hf_greedy_margins, hf_greedy_tokens
from tests.lora_adapters import MAX_RANK, hf_logits, tiny_llama_with_adapters
from tests.tiny_models import TINY

N = 40  # tokens of each row's prompt


def test_adapter_and_base_rows_in_one_batch_match_hf_peft(tmp_path, smollm):
    model, adapters = tiny_llama_with_adapters(tmp_path, smollm.tokenizer)
    names = [None, "sql", "chat", "math", None, "chat"]
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, TINY["vocab_size"], N).tolist() for _ in names]

    hf_config = json.loads((tmp_path / "base" / "config.json").read_text())
    config = ModelConfig.from_hf_config(hf_config)
    params = llama.params_from_hf(config, load_file(tmp_path / "base" / "model.safetensors"),
                                  jnp.float32)
    params = add_pool(params, 3, MAX_RANK, jnp.float32)
    manager = LoRAModelManager(params, LoRAShapes.of(config), sharding.Layout.of(config, 1), 3,
                               MAX_RANK, 3)
    ids = {None: 0}
    for i, name in enumerate(adapters, 1):
        manager.add_lora(LoRARequest(name, i, str(adapters[name])))
        ids[name] = i
    params, slots = manager.activate(params, np.array([ids[n] for n in names], np.int32))

    rows = len(names)
    pos = np.tile(np.arange(N, dtype=np.int32), rows)
    pages = -(-N // PAGE)
    block_tables = 1 + np.arange(rows * pages, dtype=np.int32).reshape(rows, pages)
    seq = np.repeat(np.arange(rows), N)
    md = llama.AttentionMetadata(
        positions=pos, slot_mapping=block_tables[seq, pos // PAGE] * PAGE + pos % PAGE,
        query_start_loc=np.arange(0, rows * N + 1, N, dtype=np.int32),
        seq_lens=np.full(rows, N, np.int32), block_tables=block_tables)
    pool = [jnp.zeros((config.num_kv_heads, rows * pages + 1, PAGE, config.head_dim))] * 2
    logits, _, _ = jax.jit(lambda p, t, md, k, v, s: llama.forward(
        config, p, t, md, k, v, np.arange(rows * N), attention_fn=attention, lora_slots=s))(
        params, np.concatenate(prompts).astype(np.int32), md, pool, pool, np.repeat(slots, N))
    logits = np.asarray(logits).reshape(rows, N, -1)
    for row, (name, prompt) in enumerate(zip(names, prompts)):
        assert_logits_close(logits[row], hf_logits(model, {}, prompt)[None] if name is None
                            else hf_logits(model, {name: adapters[name]}, prompt)[name])


def test_offline_adapters_with_ngram_drafts_match_hf_peft_greedy(tmp_path, smollm):
    """The offline engine (``LLM(enable_lora=True)``, 3 adapters over 2 device slots, rows of
    the base model beside them) with n-gram speculation on: every greedy output equals HF +
    PEFT's argmax at each position (the earlier ones teacher-forced) up to the near-tie rule,
    and drafts were accepted, so verify rows were scored under their request's adapter."""
    from jaxserve import LLM, SamplingParams

    model, adapters = tiny_llama_with_adapters(tmp_path, smollm.tokenizer)
    rng = np.random.default_rng(5)
    motif = rng.integers(3, TINY["vocab_size"], 10).tolist()
    prompts = [motif * 4, motif * 3 + [7, 8], rng.integers(3, TINY["vocab_size"], 30).tolist()]
    names = ["sql", "chat", "math", None, "sql", "chat"]
    requests = {n: LoRARequest(n, i, str(adapters[n])) for i, n in enumerate(adapters, 1)}
    llm = LLM(str(tmp_path / "base"), log=lambda s: None, enable_lora=True, max_loras=2,
              max_lora_rank=MAX_RANK, max_model_len=256, max_num_batched_tokens=32,
              max_num_seqs=4, kv_cache_gib=0.01,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_max": 3, "prompt_lookup_min": 2})
    outs = llm.generate(prompts * 2, SamplingParams(temperature=0, max_tokens=16),
                        lora_request=[requests.get(n) for n in names], use_tqdm=False)
    stats = llm.engine.get_stats().spec_decoding
    assert stats.num_accepted_tokens > 0
    loras = [requests.get(n) for n in names]  # vLLM's: each output names its adapter
    assert [(o.lora_request, o.outputs[0].lora_request) for o in outs] == list(zip(loras, loras))
    compared = []
    for name, prompt, out in zip(names, prompts * 2, outs):
        ours = out.outputs[0].token_ids
        ref = model if name is None else peft.PeftModel.from_pretrained(model, adapters[name])
        same, n = compare_greedy(ours, hf_greedy_tokens(ref.eval(), prompt, ours),
                                 hf_greedy_margins(ref, prompt, ours))
        if name is not None:
            ref.unload()
        assert same, (name, n, ours)
        compared.append(n)
    assert sorted(compared)[1] == 16, f"near-ties cut most comparisons short: {compared}"
