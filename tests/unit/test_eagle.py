"""EAGLE heads (``jaxserve/spec_decode/eagle.py``) against a float32 torch reference written
here from the published architectures (EAGLE-1: fc over [embedding | h], Llama layers the first
without its input norm, the target's LM head; EAGLE-3: fc over three hidden states, one layer
whose attention reads [input_layernorm(embedding) | hidden_norm(h)] beside the residual h, the
final norm, the draft LM head mapped by d2t), on a random head in the public layout
(``scripts/make_eagle_head.py``): the forward, and a catch-up over a step split in two chunks
then a chain of drafts, which must see the reference's K/V at the reference's positions."""

import json
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from jaxserve.config import ModelConfig
from jaxserve.model_loader.hf_folder import load_hf_folder
from jaxserve.models import llama
from jaxserve.spec_decode import eagle
from jaxserve.spec_decode.eagle import head_config, random_weights
from jaxserve.worker.sampling_fields import SamplingMetadata, neutral
from pallas_kernels import get_attention_fn
from scripts.make_eagle_head import write_head

TARGET = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=96,
              hidden_size=32, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
              rope_theta=10000.0, max_position_embeddings=256)
PAGE = 4
ATTENTION = get_attention_fn("reference")


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def head(request, tmp_path_factory):
    """(method, the head as loaded, its tensors as written, the target's embedding and LM
    head)."""
    method = request.param
    cfg = head_config(TARGET, method, draft_vocab_size=40)
    weights = random_weights(cfg, method, std=0.2, seed=1)
    rng = np.random.default_rng(2)
    if method == "eagle":
        weights["layers.0.post_attention_layernorm.weight"] += 0.1 * rng.standard_normal(32)
        weights["fc.bias"] = 0.1 * rng.standard_normal(32).astype(np.float32)
    else:
        for name in ("input_layernorm", "hidden_norm"):
            weights[f"midlayer.{name}.weight"] += 0.1 * rng.standard_normal(32)
    folder = write_head(tmp_path_factory.mktemp(method), cfg, weights)
    ckpt = load_hf_folder(folder, with_tokenizer=False)
    target = {"embed_tokens": jnp.asarray(rng.standard_normal((96, 32)), jnp.float32),
              "lm_head": jnp.asarray(rng.standard_normal((96, 32)) * 0.2, jnp.float32)}
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 1
    h = eagle.load_head(method, ckpt.hf_config, ckpt.weights,
                        ModelConfig.from_hf_config(TARGET), target, jnp.float32)
    return method, h, {k: torch.tensor(np.asarray(v)) for k, v in ckpt.weights.items()}, target


def _norm(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions):
    d = x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = positions[:, None].float() * inv[None, :]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _attention(a, w, prefix, positions):
    """Causal grouped-query attention with RoPE of the T rows of a (one sequence)."""
    t = a.shape[0]
    q = (a @ w[prefix + "self_attn.q_proj.weight"].T).view(t, 4, 8)
    k = (a @ w[prefix + "self_attn.k_proj.weight"].T).view(t, 2, 8)
    v = (a @ w[prefix + "self_attn.v_proj.weight"].T).view(t, 2, 8)
    q, k = _rope(q, positions), _rope(k, positions)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) / 8 ** 0.5
    s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, 32)
    return o @ w[prefix + "self_attn.o_proj.weight"].T


def _mlp(x, w, prefix):
    g = x @ w[prefix + "mlp.gate_proj.weight"].T
    u = x @ w[prefix + "mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(g) * u) @ w[prefix + "mlp.down_proj.weight"].T


def reference(method, w, target, tokens, h):
    """(logits [T, V], the head's output [T, E]) of tokens [T] with hidden states h [T, E]
    (eagle3: already through fc) at positions 0..T-1, one sequence."""
    e = torch.tensor(np.asarray(target["embed_tokens"]))[tokens]
    pos = torch.arange(len(tokens))
    if method == "eagle":
        x = torch.cat([e, h], -1) @ w["fc.weight"].T + w["fc.bias"]
        x = x + _attention(x, w, "layers.0.", pos)  # layer 0: no input norm
        out = x + _mlp(_norm(x, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0.")
        return out @ torch.tensor(np.asarray(target["lm_head"])).T, out
    p = "midlayer."
    a = torch.cat([_norm(e, w[p + "input_layernorm.weight"]),
                   _norm(h, w[p + "hidden_norm.weight"])], -1)
    x = h + _attention(a, w, p, pos)
    out = x + _mlp(_norm(x, w[p + "post_attention_layernorm.weight"]), w, p)
    small = _norm(out, w["norm.weight"]) @ w["lm_head.weight"].T
    logits = torch.full((len(tokens), 96), float("-inf"))
    logits[:, torch.arange(40) + w["d2t"]] = small
    return logits, out


def _pool(h):
    shape = (h.config.num_kv_heads, 12, PAGE, h.config.head_dim)
    return [jnp.zeros(shape, jnp.float32)], [jnp.zeros(shape, jnp.float32)]


TABLE = jnp.arange(1, 12, dtype=jnp.int32)[None, :]  # one sequence, pages 1..11


def _metadata(start, n):
    pos = jnp.arange(start, start + n, dtype=jnp.int32)
    return llama.AttentionMetadata(pos, TABLE[0, pos // PAGE] * PAGE + pos % PAGE,
                                   jnp.array([0, n], jnp.int32),
                                   jnp.array([start + n], jnp.int32), TABLE)


def _inputs(method, h, n):
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 96, n + 1)
    width = 96 if method == "eagle3" else 32
    hidden = jnp.asarray(rng.standard_normal((n, width)), jnp.float32)
    combined = torch.tensor(np.asarray(eagle.combine(method, h.params, hidden)))
    return tokens, hidden, combined


def test_forward_equals_reference(head):
    method, h, w, target = head
    tokens, hidden, combined = _inputs(method, h, 9)
    if method == "eagle3":  # fc over the three hidden states
        np.testing.assert_allclose(combined.numpy(), (torch.tensor(np.asarray(hidden))
                                                      @ w["fc.weight"].T).numpy(), atol=1e-5)
    k, v = _pool(h)
    logits, out, _, _ = jax.jit(partial(eagle.forward, method, h.config, ATTENTION))(
        h.params, jnp.asarray(tokens[1:]), jnp.asarray(combined.numpy()), _metadata(0, 9), k, v)
    ref_logits, ref_out = reference(method, w, target, tokens[1:], combined)
    np.testing.assert_allclose(np.asarray(out), ref_out.numpy(), atol=1e-4, rtol=1e-4)
    finite = np.isfinite(ref_logits.numpy())
    assert (np.isfinite(np.asarray(logits)) == finite).all()
    np.testing.assert_allclose(np.asarray(logits)[finite], ref_logits.numpy()[finite],
                               atol=1e-4, rtol=1e-4)


def test_catch_up_then_drafts_see_the_references_context(head):
    """Two steps of a sequence's target tokens (0..5, 6..8), each caught up one position
    behind; then two drafts after token 9: their q are the reference's over the whole
    sequence, the first draft and the head's output appended."""
    method, h, w, target = head
    tokens, hidden, combined = _inputs(method, h, 9)
    k, v = _pool(h)
    slot_hidden = jnp.zeros((1, 32), jnp.float32)
    catch_up = jax.jit(partial(eagle.catch_up, method, h.config, ATTENTION, PAGE))
    for start, n, first_valid in ((0, 6, 0), (6, 3, 1)):
        md = _metadata(start, n)
        k, v, rows = catch_up(h.params, jnp.asarray(tokens[start:start + n]), md,
                              jnp.zeros(1, jnp.int32), hidden[start:start + n], slot_hidden,
                              jnp.array([first_valid], jnp.int32), k, v)
        slot_hidden = eagle.write_slot_hidden(slot_hidden, rows, jnp.zeros(1, jnp.int32),
                                              jnp.array([n - 1], jnp.int32))
    drafts, q, _, _ = jax.jit(partial(eagle.propose, method, h.config, ATTENTION, 2, PAGE))(
        h.params, k, v, TABLE,
        jnp.asarray(tokens[9:10]), jnp.array([9], jnp.int32), jnp.zeros(1, jnp.int32),
        jnp.int32(1), neutral(SamplingMetadata, 1), slot_hidden)
    ref_logits, ref_out = reference(method, w, target, tokens[1:], combined)
    d0 = int(drafts[0, 0])
    assert d0 == int(ref_logits[-1].argmax())
    ext_logits, _ = reference(method, w, target, np.append(tokens[1:], d0),
                              torch.cat([combined, ref_out[-1:]]))
    for j, logits in enumerate((ref_logits[-1], ext_logits[-1])):
        np.testing.assert_allclose(np.asarray(q[j]), logits.softmax(-1).numpy(), atol=1e-4)


def test_bad_heads_name_the_field(tmp_path):
    target = ModelConfig.from_hf_config(TARGET)
    for method, change, aux, words in (
            ("eagle", {"hidden_size": 48, "head_dim": 12}, None, "hidden_size"),
            ("eagle", {"vocab_size": 64}, None, "vocab_size"),
            ("eagle3", {}, [0, 1, 4], "eagle_aux_hidden_state_layer_ids")):
        cfg = head_config({**TARGET, **change}, method, 40, aux)
        with pytest.raises(ValueError, match=f"model: .*{words}"):
            eagle.load_head(method, cfg, random_weights(cfg, method), target, {}, jnp.float32)
    cfg = head_config(TARGET, "eagle3", draft_vocab_size=40)
    weights = random_weights(cfg, "eagle3")
    del weights["midlayer.hidden_norm.weight"]
    with pytest.raises(ValueError, match="model: .*midlayer.hidden_norm.weight"):
        eagle.load_head("eagle3", cfg, weights, target, {}, jnp.float32)
    weights = random_weights(cfg, "eagle3")
    weights["fc.weight"] = weights["fc.weight"][:, :64]
    with pytest.raises(ValueError, match="model: .*fc.weight has shape"):
        eagle.load_head("eagle3", cfg, weights, target, {}, jnp.float32)
    weights = random_weights(cfg, "eagle3")  # FP8 codes whose scales would be dropped
    weights["fc.weight"] = weights["fc.weight"].astype(ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match="model: .*fc.weight has dtype float8_e4m3fn"):
        eagle.load_head("eagle3", cfg, weights, target, {}, jnp.float32)
    with pytest.raises(ValueError, match="model: a quantized EAGLE head"):
        eagle.load_head("eagle3", {**cfg, "quantization_config": {"quant_method": "fbgemm_fp8"}},
                        random_weights(cfg, "eagle3"), target, {}, jnp.float32)
    with pytest.raises(ValueError, match="method: .*Qwen2ForCausalLM"):
        eagle.check_target(ModelConfig.from_hf_config(
            {**TARGET, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))


def test_dummy_head_and_tensor_parallel():
    """"model": "dummy" is a random head of the target's shapes; a mesh is refused."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.core import load_drafter

    target = ModelConfig.from_hf_config(TARGET)
    params = llama.random_params(target, jnp.float32)
    h = load_drafter("eagle3", "dummy", TARGET, target, params, jnp.float32, EngineConfig(), None)
    assert h.aux_layers == (2, 2, 1) and h.params["fc"].shape == (96, 32)
    assert h.params["embed_tokens"] is params["embed_tokens"]
    with pytest.raises(ValueError, match="method 'eagle3' runs on one device"):
        load_drafter("eagle3", "nowhere", TARGET, target, {}, jnp.float32, None, mesh=object())


def test_target_returns_the_heads_hidden_states_in_both_layer_layouts():
    """``llama.forward``'s aux_layers: the inputs of the layers asked for (layer 0's: the
    embedding), in the order asked, from the unrolled layers (a pool per layer) and the CPU's
    loop over a stacked pool alike; () the final norm's output."""
    c = ModelConfig.from_hf_config(TARGET)
    params = llama.random_params(c, jnp.float32, seed=4)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 96, 7), jnp.int32)
    shape = (c.num_kv_heads, 12, PAGE, c.head_dim)
    pools = {"per layer": [jnp.zeros(shape, jnp.float32)] * c.num_layers,
             "stacked": jnp.zeros((c.num_layers, *shape), jnp.float32)}

    @jax.jit
    def both(params, pool):
        return [llama.forward(c, params, tokens, _metadata(0, 7), pool, pool, jnp.arange(7),
                              attention_fn=ATTENTION, aux_layers=aux)[-1]
                for aux in ((3, 0, 2), ())]

    out = {(layout, aux): np.asarray(a) for layout, pool in pools.items()
           for aux, a in zip(((3, 0, 2), ()), both(params, pool))}
    for aux in ((3, 0, 2), ()):
        np.testing.assert_allclose(out["per layer", aux], out["stacked", aux], atol=1e-5)
    np.testing.assert_allclose(out["stacked", (3, 0, 2)][:, 32:64],
                               np.asarray(params["embed_tokens"])[tokens], atol=0)
    assert out["stacked", ()].shape == (7, 32)
