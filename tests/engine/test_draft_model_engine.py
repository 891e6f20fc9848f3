"""The draft_model speculative method (docs/spec_decode.md) on a tiny random Llama target with
its own first layer as the draft (``checkpoints_tools.convert.first_layers``): greedy outputs
equal HF's up to the near-tie rule with drafts accepted; a draft that is the target itself has
every draft accepted, greedy and sampled (q = p: its pool follows the target's, and each
verified row finds its draft's q), and bad drafts are start-up errors naming
``--speculative-config``."""

import numpy as np
import pytest
import transformers

from checkpoints_tools.convert import first_layers
from jaxserve.model_loader import load_checkpoint, save_hf_folder
from jaxserve.sampling_params import SamplingParams
from tests.greedy import assert_equals_hf_greedy
from tests.tiny_models import TINY, TINY_CONFIGS, save_tiny_model

# 8-token steps (few buckets to compile): prompts in chunks; a pool of 9 pages of 16 tokens
# (32 KB each with the self-draft's pool) for 3 sequences of up to 116 tokens, so it preempts
ENGINE = dict(max_model_len=128, max_num_batched_tokens=8, max_num_seqs=4,
              kv_cache_gib=0.00029, log=lambda s: None)
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, smollm):
    """(target folder, draft folder: its first layer, the HF target)."""
    target = tmp_path_factory.mktemp("target")
    hf_model = save_tiny_model("llama", target, smollm.tokenizer)
    draft = tmp_path_factory.mktemp("draft")
    save_hf_folder(draft, first_layers(load_checkpoint(str(target), "safetensors"), 1))
    return target, draft, hf_model


def spec(model: str) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 3}


def generate(folder, draft, prompts, *params: SamplingParams):
    """Token ids of each prompt under each of ``params`` (greedy when none), the engine's
    speculative decoding counters after each, and the engine's scheduler."""
    from jaxserve import LLM

    llm = LLM(str(folder), speculative_config=spec(str(draft)), **ENGINE)
    runs = []
    for sp in params or (SamplingParams(temperature=0, max_tokens=MAX_TOKENS),):
        outs = llm.generate(prompts, sp, use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outs],
                     llm.engine.get_stats().spec_decoding))
    return runs, llm.engine.scheduler


def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, TINY["vocab_size"], size=n).tolist() for n in (5, 40, 100)]


def test_greedy_equals_hf_with_drafts_accepted(tiny_pair):
    target, draft, hf_model = tiny_pair
    [(ours, stats)], _ = generate(target, draft, prompts())
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > 0
    assert_equals_hf_greedy(hf_model, prompts(), ours, MAX_TOKENS)


def test_target_as_its_own_draft_accepts_every_draft(tiny_pair):
    """Also through preemption and, in the second run, prefix-cache hits (pages whose draft
    K/V a finished request's steps wrote)."""
    target, _, _ = tiny_pair
    sampled = SamplingParams(temperature=0.8, top_k=40, max_tokens=MAX_TOKENS, seed=1)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    [(_, s1), (_, s2)], scheduler = generate(target, target, prompts(), greedy, sampled)
    assert scheduler.num_preemptions > 0 and scheduler.prefix_cache_hits > 0
    assert s1.num_draft_tokens > 20
    assert s1.num_accepted_tokens >= 0.95 * s1.num_draft_tokens
    drafted = s2.num_draft_tokens - s1.num_draft_tokens
    assert drafted > 20
    assert s2.num_accepted_tokens - s1.num_accepted_tokens >= 0.95 * drafted


def test_bad_draft_is_a_start_up_error(tiny_pair, tmp_path):
    from jaxserve import LLM

    target, _, _ = tiny_pair
    other = transformers.LlamaForCausalLM(TINY_CONFIGS["llama"]().__class__(
        **{**TINY_CONFIGS["llama"]().to_dict(), "vocab_size": 256}))
    other.save_pretrained(tmp_path)
    for model, words in ((str(tmp_path), "vocabulary"), (str(tmp_path / "nowhere"), "model")):
        with pytest.raises(ValueError, match="--speculative-config") as e:
            LLM(str(target), speculative_config=spec(model), **ENGINE)
        assert words in str(e.value)
