"""A tiny random GGUF written with gguf's own GGUFWriter, the way convert_hf_to_gguf.py lays it out
(llama.cpp tensor names; Q/K rows permuted for llama arch)."""

import numpy as np

from jaxserve.model_loader.llama_cpp_layout import permute_qk

N_HEAD, N_KV, HEAD_DIM, VOCAB = 4, 2, 8, 30

def write_gguf(path, arch, tensors, n_head, n_kv, head_dim, extra_meta=()):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    hidden = n_head * head_dim
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    alphabet = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["ab", "Ġ", "<s>", "</s>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "llama-bpe")
    w.add_token_list(alphabet)
    w.add_token_types([1] * (len(alphabet) - 2) + [3, 3])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(len(alphabet) - 2)
    w.add_eos_token_id(len(alphabet) - 1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for k, v in extra_meta:
        getattr(w, k)(v)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return len(alphabet)



def make_tiny_gguf(path, arch: str, seed: int = 1) -> dict:
    """Write ``path`` for ``arch`` (llama/qwen2/qwen3); return the HF-layout weights it encodes."""
    rng = np.random.default_rng(seed)
    n_head, n_kv, hd, vocab = N_HEAD, N_KV, HEAD_DIM, VOCAB
    hidden = n_head * hd
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    hf = {"model.embed_tokens.weight": f(vocab, hidden), "model.norm.weight": f(hidden),
          "lm_head.weight": f(vocab, hidden),
          "model.layers.0.self_attn.q_proj.weight": f(n_head * hd, hidden),
          "model.layers.0.self_attn.k_proj.weight": f(n_kv * hd, hidden),
          "model.layers.0.self_attn.v_proj.weight": f(n_kv * hd, hidden),
          "model.layers.0.self_attn.o_proj.weight": f(hidden, n_head * hd),
          "model.layers.0.mlp.gate_proj.weight": f(16, hidden),
          "model.layers.0.mlp.up_proj.weight": f(16, hidden),
          "model.layers.0.mlp.down_proj.weight": f(hidden, 16),
          "model.layers.0.input_layernorm.weight": f(hidden),
          "model.layers.0.post_attention_layernorm.weight": f(hidden)}
    if arch == "qwen3":
        hf["model.layers.0.self_attn.q_norm.weight"] = f(hd)
        hf["model.layers.0.self_attn.k_norm.weight"] = f(hd)
    if arch == "qwen2":
        for p, n in (("q", n_head), ("k", n_kv), ("v", n_kv)):
            hf[f"model.layers.0.self_attn.{p}_proj.bias"] = f(n * hd)
    gguf_names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
                  "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                  "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
                  "self_attn.k_norm": "attn_k_norm"}
    tensors = {}
    for name, arr in hf.items():
        base, kind = name.rsplit(".", 1)
        if base.startswith("model.layers.0."):
            g = f"blk.0.{gguf_names[base[len('model.layers.0.'):]]}.{kind}"
        else:
            g = f"{gguf_names[base]}.{kind}"
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            arr = permute_qk(arr, n_head if "q_proj" in base else n_kv)  # what convert_hf_to_gguf does
        tensors[g] = arr
    write_gguf(path, arch, tensors, n_head, n_kv, hd)
    return hf
