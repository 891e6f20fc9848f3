"""GGUF file -> :class:`Checkpoint` (float32 weights in HF names/layouts, HF config, tokenizer).

Source format: llama.cpp GGUF v3 read with the ``gguf`` package (``GGUFReader``; quantized
tensors dequantized with ``gguf.quants.dequantize``, which returns ``[rows, cols]`` = HF
``[out, in]``). Tensor names follow llama.cpp's ``gguf.constants.MODEL_TENSOR`` names
(``blk.N.attn_q`` ...) and are mapped back to HF names; Q/K rows of llama-arch files are
un-permuted (see :mod:`.llama_cpp_layout`). Architectures: ``llama`` (Llama, or Mistral when
``general.name`` says so), ``qwen2``, ``qwen3``.
"""

from __future__ import annotations

import copy
import pathlib
import re
from functools import partial

import numpy as np

from jaxserve.models.rope import rope_inv_freq

from .checkpoint import Checkpoint, LazyTensor, log
from .llama_cpp_layout import unpermute_qk

GGUF_MAGIC = b"GGUF"

# llama.cpp per-layer tensor name -> HF per-layer name (without "model.layers.N." prefix).
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp arch -> (HF architecture, HF model_type)
ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
         "qwen3": ("Qwen3ForCausalLM", "qwen3")}
_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|F16|F32|BF16|FP16)$", re.IGNORECASE)
IGNORED_TENSORS = {"rope_freqs"}


def is_gguf(path: pathlib.Path) -> bool:
    """True for a file ending in .gguf or starting with the GGUF magic."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def hf_tensor_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        hf = LAYER_TENSORS.get(m.group(2))
        return f"model.layers.{m.group(1)}.{hf}.{m.group(3)}" if hf else None
    m = re.fullmatch(r"(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(1) in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[m.group(1)]}.{m.group(2)}"
    return None


def read_metadata(reader) -> dict:
    """All GGUF key/values as python values (strings, numbers, lists)."""
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # noqa: BLE001 - exotic field types we do not need
            continue
    return out


def model_name(path: pathlib.Path, meta: dict) -> str:
    """File stem minus the quantization suffix (``SmolLM2-135M-Instruct.Q4_1`` ->
    ``SmolLM2-135M-Instruct``); the GGUF ``general.name`` is often a training-run label."""
    stem = _QUANT_SUFFIX.sub("", path.stem)
    return stem or str(meta.get("general.name") or path.stem)


def _llama3_rope_scaling(freqs: np.ndarray, head_dim: int, theta: float) -> dict:
    """Recover HF's ``rope_type: llama3`` parameters from llama.cpp's ``rope_freqs`` tensor
    ([head_dim // 2] divisors of the inverse frequencies), checking that the Llama 3.1 defaults
    with its largest divisor as the factor reproduce it.

    Raises:
      ValueError: when they do not.
    """
    cand = {"rope_type": "llama3", "factor": float(freqs.max()), "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    div = rope_inv_freq(head_dim, theta, None) / rope_inv_freq(head_dim, theta, cand)
    if not np.allclose(div, freqs, rtol=1e-3):
        raise ValueError("GGUF rope_freqs does not match Llama-3 rope scaling defaults; unsupported")
    return cand


def build_hf_config(meta: dict, tensor_names: set[str], tensors: dict) -> dict:
    """HF ``config.json`` content from GGUF ``{arch}.*`` metadata (and which tensors exist)."""
    arch = meta["general.architecture"]
    if arch not in ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(ARCHS)})")
    hf_arch, model_type = ARCHS[arch]
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        hf_arch, model_type = "MistralForCausalLM", "mistral"
    g = lambda k, d=None: meta.get(f"{arch}.{k}", d)  # noqa: E731
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    kv = g("attention.head_count_kv", heads)
    kv = int(max(kv) if isinstance(kv, list) else kv)
    head_dim = int(g("attention.key_length") or g("rope.dimension_count") or hidden // heads)
    vocab = g("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    theta = float(g("rope.freq_base", 10000.0))
    cfg = {
        "architectures": [hf_arch], "model_type": model_type,
        "hidden_size": hidden, "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim,
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta, "rope_scaling": None,
        "max_position_embeddings": int(g("context_length", 4096)), "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu", "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": "float32",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names, "mlp_bias": False,
        "attention_dropout": 0.0,
    }
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            cfg[hf_key] = int(meta[f"tokenizer.ggml.{key}"])
    if model_type == "llama":
        cfg["pretraining_tp"] = 1
    if model_type in ("qwen2", "mistral", "qwen3"):
        cfg.update(sliding_window=None, use_sliding_window=False)
    if model_type == "qwen2":
        cfg.pop("attention_bias")  # Qwen2 always has q/k/v bias; its config has no such key
    scaling_type = g("rope.scaling.type")
    if "rope_freqs.weight" in tensors:
        cfg["rope_scaling"] = _llama3_rope_scaling(tensors["rope_freqs.weight"], head_dim, theta)
    elif scaling_type and scaling_type != "none":
        cfg["rope_scaling"] = {"rope_type": scaling_type, "factor": float(g("rope.scaling.factor", 1.0))}
        if g("rope.scaling.original_context_length"):
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(g("rope.scaling.original_context_length"))
    return cfg


def _dequantize_rows(t, heads: int | None, index: tuple) -> np.ndarray:
    """Part ``index`` (one slice per HF dimension) of a GGUF tensor as float32 [out, in]: only
    the rows asked for are dequantized (each row's blocks stand alone). ``heads``: the Q or K
    head count of a llama-arch file, whose rows are un-permuted head by head (a slice of rows
    holds whole heads, as a tensor-parallel split of heads does)."""
    from gguf.quants import dequantize

    w = np.ascontiguousarray(dequantize(t.data[index[0]], t.tensor_type), dtype=np.float32)
    if heads is not None:
        w = np.ascontiguousarray(unpermute_qk(w, w.shape[0] * heads // t.data.shape[0]))
    return w[(slice(None), *index[1:])]


def load_gguf(path: str | pathlib.Path, *, with_weights: bool = True,
              with_tokenizer: bool = True, lazy: bool = False) -> Checkpoint:
    """Load a GGUF file.

    Args:
      path: the ``.gguf`` file.
      with_weights: False reads only metadata + tokenizer (``weights`` is None), fast.
      with_tokenizer: False leaves ``tokenizer`` None.
      lazy: weights are :class:`LazyTensor` objects that dequantize only the rows asked for (a
        tensor-parallel device's part) when indexed; nothing is dequantized up front.
    Returns:
      :class:`Checkpoint` with float32 weights ``[out, in]`` under HF names.
    """
    from jaxserve.tokenizer_io import load_tokenizer

    from .gguf_header import read_header

    path = pathlib.Path(path)
    log(f"reading GGUF {path}" + ("" if with_weights else " (metadata and tokenizer)"))
    header = read_header(path)
    cfg, by_name, arch = copy.deepcopy(header.hf_config), header.tensors, header.architecture
    tokenizer = load_tokenizer(header.tokenizer_dir) if with_tokenizer else None
    weights = None
    if with_weights:
        log(f"{'indexing' if lazy else 'dequantizing'} {len(by_name)} tensors ({arch}, "
            f"{cfg['num_hidden_layers']} layers)")
        weights = {}
        for name, t in by_name.items():
            if name.split(".")[0] in IGNORED_TENSORS:
                continue
            hf = hf_tensor_name(name)
            if hf is None:
                raise ValueError(f"{path}: unexpected GGUF tensor {name!r} for architecture {arch!r}")
            heads = None
            if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
                heads = cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
            # GGUF lists dimensions innermost first; HF's are [out, in].
            weights[hf] = LazyTensor(tuple(reversed(t.shape)), np.float32,
                                     partial(_dequantize_rows, t, heads))
        if not lazy:
            weights = {k: np.asarray(w) for k, w in weights.items()}
        log(f"{'indexed' if lazy else 'loaded'} "
            f"{sum(np.prod(w.shape) for w in weights.values()) / 1e6:.1f}M parameters")
    return Checkpoint(name=header.name, hf_config=cfg, weights=weights, tokenizer=tokenizer)
