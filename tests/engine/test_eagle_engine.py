"""The eagle and eagle3 speculative methods (docs/spec_decode.md) on a tiny random Llama
target with random heads in the public layout (``scripts/make_eagle_head.py``): greedy outputs
equal HF's (the near-tie rule) whatever the head (rejection sampling), sampled seeded requests
finish (two choices each) and the h a slot carries is the target's; an EAGLE-1 head built to
reproduce a one-layer target (attention off in both, fc picking the embedding, the target's
MLP) has its drafts accepted, which checks that each head step reads the right token; bad
heads and targets are start-up errors naming ``--speculative-config``."""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from jaxserve.sampling_params import SamplingParams
from jaxserve.spec_decode.eagle import head_config, random_weights
from scripts.make_eagle_head import write_head
from tests.greedy import compare_greedy, hf_generate, hf_greedy_margins
from tests.tiny_models import TINY, save_tiny_model

# As the draft_model tests: 8-token steps (prompts in chunks), a pool small enough to preempt.
ENGINE = dict(max_model_len=128, max_num_batched_tokens=8, max_num_seqs=4,
              kv_cache_gib=0.00029, log=lambda s: None)
GREEDY = SamplingParams(temperature=0, max_tokens=16)
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=16, seed=1, n=2)


def spec(method: str, model) -> dict:
    return {"method": method, "model": str(model), "num_speculative_tokens": 3}


def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, TINY["vocab_size"], size=n).tolist() for n in (5, 40, 100)]


def generate(folder, speculative_config, *params: SamplingParams):
    """Token ids of each prompt under each of ``params``, with the speculative decoding
    counters after the last."""
    from jaxserve import LLM

    llm = LLM(str(folder), speculative_config=speculative_config, **ENGINE)
    runs = [[c.token_ids for o in llm.generate(prompts(), sp, use_tqdm=False) for c in o.outputs]
            for sp in params]
    return runs, llm.engine.get_stats().spec_decoding


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm):
    """(target folder, the HF target)."""
    folder = tmp_path_factory.mktemp("target")
    return folder, save_tiny_model("llama", folder, smollm.tokenizer)


@pytest.fixture(scope="module")
def target(tiny):
    return tiny[0]


@pytest.fixture(scope="module")
def hf_greedy(tiny):
    """HF's greedy tokens of each prompt (no engine start-up: the plain engine's equal them,
    test_model_parity) and their top-2 margins."""
    hf_model = tiny[1]
    out = []
    for ids in prompts():
        ref = hf_generate(hf_model, ids, GREEDY.max_tokens)
        out.append((ref, hf_greedy_margins(hf_model, ids, ref)))
    return out


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_equals_hf(tiny, hf_greedy, method, tmp_path):
    """Then, after one more request, the h its slot carries is the target's at the newest
    position the sequence computed, through rejected drafts (compared with HF's)."""
    from jaxserve import LLM

    target, hf_model = tiny
    cfg = head_config(json.loads((target / "config.json").read_text()), method, 200, [0, 1, 1])
    head = write_head(tmp_path / method, cfg, random_weights(cfg, method, std=0.1))
    llm = LLM(str(target), speculative_config=spec(method, head), **ENGINE)
    greedy, sampled = ([c.token_ids for o in llm.generate(prompts(), sp, use_tqdm=False)
                        for c in o.outputs] for sp in (GREEDY, SAMPLED))
    for out, (ref, margins) in zip(greedy, hf_greedy):
        ok, n = compare_greedy(out, ref, margins)
        assert ok, (n, out, ref)
    assert [len(t) for t in sampled] == [SAMPLED.max_tokens] * 6
    stats = llm.engine.get_stats().spec_decoding
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= 2 * stats.num_drafts
    hidden_pos = llm.engine.runner.input_batch.hidden_pos
    hidden_pos[:] = -2  # a slot the next request takes starts at -1
    prompt = prompts()[1]
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    [slot] = np.flatnonzero(hidden_pos != -2)
    pos = int(hidden_pos[slot])
    assert pos >= len(prompt)
    with torch.no_grad():
        states = hf_model(torch.tensor([prompt + out]), output_hidden_states=True).hidden_states
    if method == "eagle":  # the final norm's output (HF's last hidden state)
        want = states[-1][0, pos].numpy()
    else:  # fc over the inputs of layers 0, 1, 1
        fc = load_file(str(head / "model.safetensors"))["fc.weight"]
        want = fc @ np.concatenate([states[i][0, pos].numpy() for i in (0, 1, 1)])
    np.testing.assert_allclose(np.asarray(llm.engine.runner.slot_hidden[slot]), want,
                               atol=1e-4)


def test_head_that_reproduces_the_target_is_accepted(tmp_path, smollm):
    """A one-layer target without attention (o_proj 0) and a final norm of ones predicts the
    token after t from token t alone: lm_head(norm(e + mlp(n(e)))). An EAGLE-1 head whose fc
    keeps the embedding of the token it reads, with the same MLP and no attention, outputs
    e + mlp(n(e)) of that token, whose argmax through the target's LM head is the target's."""
    folder = tmp_path / "target"
    save_tiny_model("llama", folder, smollm.tokenizer)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    t = {k: v for k, v in load_file(str(folder / "model.safetensors")).items()
         if not k.startswith("model.layers.1.")}
    t["model.layers.0.self_attn.o_proj.weight"][:] = 0
    t["model.norm.weight"][:] = 1
    write_head(folder, cfg, t)
    head = head_config(cfg, "eagle")
    w = random_weights(head, "eagle")
    e = TINY["hidden_size"]
    w["fc.weight"] = np.concatenate([np.eye(e), np.zeros((e, e))], axis=1).astype(np.float32)
    w["layers.0.self_attn.o_proj.weight"][:] = 0
    for name in ("post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"):
        w[f"layers.0.{name}"] = t[f"model.layers.0.{name}"]
    model = write_head(tmp_path / "head", head, w)
    (greedy, sampled), stats = generate(folder, spec("eagle", model), GREEDY, SAMPLED)
    assert [len(t) for t in greedy + sampled] == [16] * 9
    assert stats.num_draft_tokens > 40
    assert stats.num_accepted_tokens >= 0.8 * stats.num_draft_tokens
    assert stats.num_accepted_tokens_per_pos[-1] > 0


def test_bad_head_or_target_is_a_start_up_error(target, tmp_path, smollm):
    from jaxserve import LLM

    cfg = json.loads((target / "config.json").read_text())
    wide = head_config({**cfg, "hidden_size": 2 * cfg["hidden_size"]}, "eagle")
    qwen = tmp_path / "qwen2"
    save_tiny_model("qwen2", qwen, smollm.tokenizer)
    narrow = head_config(cfg, "eagle")
    for folder, head, words in ((target, wide, "hidden_size"), (qwen, narrow, "method")):
        model = write_head(tmp_path / words, head, random_weights(head, "eagle"))
        with pytest.raises(ValueError, match="--speculative-config") as e:
            LLM(str(folder), speculative_config=spec("eagle", model), **ENGINE)
        assert words in str(e.value)
