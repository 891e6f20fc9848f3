import numpy as np
import pytest

from jaxserve.model_loader import load_checkpoint
from jaxserve.model_loader.gguf_loader import _llama3_rope_scaling, hf_tensor_name
from jaxserve.model_loader.llama_cpp_layout import permute_qk, unpermute_qk

from tiny_gguf import HEAD_DIM, N_HEAD, N_KV, VOCAB, make_tiny_gguf


def test_smollm_config(smollm):
    c = smollm.hf_config
    assert smollm.name == "SmolLM2-135M-Instruct"
    assert c["architectures"] == ["LlamaForCausalLM"]
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (30, 576, 1536)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["vocab_size"] == 49152 and c["tie_word_embeddings"] is True
    assert c["rope_theta"] == 1e5 and c["rope_scaling"] is None
    assert c["max_position_embeddings"] == 8192 and abs(c["rms_norm_eps"] - 1e-5) < 1e-9
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)


def test_smollm_weights(smollm):
    w = smollm.weights
    assert len(w) == 2 + 30 * 9 and "lm_head.weight" not in w
    assert all(a.dtype == np.float32 for a in w.values())
    assert w["model.embed_tokens.weight"].shape == (49152, 576)
    assert w["model.norm.weight"].shape == (576,)
    layer = {k.split("layers.0.")[1]: v.shape for k, v in w.items() if ".layers.0." in k}
    assert layer == {
        "self_attn.q_proj.weight": (576, 576), "self_attn.k_proj.weight": (192, 576),
        "self_attn.v_proj.weight": (192, 576), "self_attn.o_proj.weight": (576, 576),
        "mlp.gate_proj.weight": (1536, 576), "mlp.up_proj.weight": (1536, 576),
        "mlp.down_proj.weight": (576, 1536), "input_layernorm.weight": (576,),
        "post_attention_layernorm.weight": (576,)}
    assert np.isfinite(w["model.embed_tokens.weight"]).all()


def test_tensor_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.3.mystery.weight") is None


def _llama_cpp_rope_freqs(head_dim, theta, factor):
    """The ``rope_freqs`` tensor llama.cpp's convert_hf_to_gguf.py writes for Llama 3.1
    scaling (low/high frequency factors 1 and 4, original context 8192)."""
    out = []
    for f in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * np.pi / f
        smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
        out.append(1.0 if wavelen < 8192 / 4 else factor if wavelen > 8192 else
                   1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def test_llama3_rope_scaling_from_rope_freqs():
    freqs = _llama_cpp_rope_freqs(128, 500000.0, 8.0)
    assert _llama3_rope_scaling(freqs, 128, 500000.0) == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError, match="rope_freqs"):
        _llama3_rope_scaling(np.linspace(1.0, 8.0, 64, dtype=np.float32), 128, 500000.0)


def _rope(x, pos, interleaved):
    """RoPE on x[..., D]: HF rotate_half pairs (j, j+D/2); llama.cpp/GPT-J pairs (2j, 2j+1)."""
    d = x.shape[-1]
    inv = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)


@pytest.mark.parametrize("n_head,head_dim,d_in", [(9, 64, 32), (3, 8, 5), (2, 4, 1)])
def test_qk_permutation_inverse_and_rope_semantics(n_head, head_dim, d_in):
    rng = np.random.default_rng(0)
    w_hf = rng.standard_normal((n_head * head_dim, d_in))
    w_cpp = permute_qk(w_hf, n_head)
    np.testing.assert_array_equal(unpermute_qk(w_cpp, n_head), w_hf)
    np.testing.assert_array_equal(unpermute_qk(w_cpp[:, 0], n_head), w_hf[:, 0])  # biases
    assert not np.array_equal(w_cpp, w_hf)
    # The point of the permutation: llama.cpp's interleaved RoPE on the permuted projection is
    # HF's rotate-half RoPE on the original one, up to the same fixed row order in q and k, so
    # attention scores q.k agree.
    xq, xk = rng.standard_normal(d_in), rng.standard_normal(d_in)
    wk_hf = rng.standard_normal((n_head * head_dim, d_in))
    wk_cpp = permute_qk(wk_hf, n_head)
    for pq, pk in [(5, 2), (17, 0), (3, 3)]:
        q_hf = _rope((w_hf @ xq).reshape(n_head, head_dim), pq, False)
        k_hf = _rope((wk_hf @ xk).reshape(n_head, head_dim), pk, False)
        q_cpp = _rope((w_cpp @ xq).reshape(n_head, head_dim), pq, True)
        k_cpp = _rope((wk_cpp @ xk).reshape(n_head, head_dim), pk, True)
        np.testing.assert_allclose((q_hf * k_hf).sum(-1), (q_cpp * k_cpp).sum(-1), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_tiny_gguf_arch(tmp_path, arch):
    n_head, n_kv, hd, vocab = N_HEAD, N_KV, HEAD_DIM, VOCAB
    path = tmp_path / f"tiny-{arch}-F32.gguf"
    hf = make_tiny_gguf(path, arch)
    ck = load_checkpoint(str(path))
    assert ck.name == f"tiny-{arch}"
    assert ck.weights.keys() == hf.keys()
    for k in hf:
        np.testing.assert_array_equal(ck.weights[k], hf[k], err_msg=k)
    cfg = ck.hf_config
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                     "qwen3": "Qwen3ForCausalLM"}[arch]]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (n_head, n_kv, hd)
    assert cfg["tie_word_embeddings"] is False and cfg["vocab_size"] == vocab
    assert ck.tokenizer.encode("ab") == [ck.tokenizer.convert_tokens_to_ids("ab")]
    assert ck.tokenizer.bos_token == "<s>" and ck.tokenizer.chat_template

