"""Dummy checkpoints: a real model's HF config, no weights (the model code makes random ones).

``--model PRESET`` (see :data:`PRESETS`, values copied from the models' published
``config.json``) or a path to a ``config.json``. The tokenizer is borrowed from the default model
(SmolLM2-135M-Instruct, vocab 49152; docs/architecture.md, "Models and checkpoints"): ids beyond it
are the model code's to handle. A model whose vocabulary is smaller than that (Mistral-7B's 32,768)
gets its vocabulary grown to the tokenizer's, so that every text prompt is in range (the log says
so; random weights of a slightly larger embedding and head, an added 0.3% of Mistral-7B's
weights). The borrowed tokenizer is cached as ``$JAXSERVE_CACHE/tokenizers/<name>/`` so that
machines without the GGUF (e.g. the GPU box) can carry just that folder.
"""

from __future__ import annotations

import copy
import json
import pathlib

from jaxserve.config import ModelConfig

from .checkpoint import Checkpoint, log
from .text_only import text_only

_LLAMA_COMMON = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                 "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
                 "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True}

PRESETS: dict[str, dict] = {
    "llama-3.1-8b": {**_LLAMA_COMMON, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                     "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                     "max_position_embeddings": 131072, "vocab_size": 128256,
                     "tie_word_embeddings": False, "bos_token_id": 128000,
                     "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"},
    "llama-3.1-70b": {**_LLAMA_COMMON, "hidden_size": 8192, "intermediate_size": 28672,
                      "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                      "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                      "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192,
                                       "rope_type": "llama3"},
                      "max_position_embeddings": 131072, "vocab_size": 128256,
                      "tie_word_embeddings": False, "bos_token_id": 128000,
                      "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"},
    "llama-3.2-1b": {**_LLAMA_COMMON, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                     "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                     "max_position_embeddings": 131072, "vocab_size": 128256,
                     "tie_word_embeddings": True, "bos_token_id": 128000,
                     "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"},
    "smollm2-135m": {**_LLAMA_COMMON, "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "rope_scaling": None,
                     "max_position_embeddings": 8192, "vocab_size": 49152, "tie_word_embeddings": True,
                     "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "torch_dtype": "bfloat16"},
    "qwen2.5-0.5b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
                     "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
                     "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 32768,
                     "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 21,
                     "vocab_size": 151936, "tie_word_embeddings": True, "bos_token_id": 151643,
                     "eos_token_id": 151645, "attention_dropout": 0.0, "initializer_range": 0.02,
                     "use_cache": True, "torch_dtype": "bfloat16"},
    "qwen2-0.5b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
                   "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                   "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
                   "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 131072,
                   "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 24,
                   "vocab_size": 151936, "tie_word_embeddings": True, "bos_token_id": 151643,
                   "eos_token_id": 151643, "attention_dropout": 0.0, "initializer_range": 0.02,
                   "use_cache": True, "torch_dtype": "bfloat16"},
    "qwen2.5-32b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
                    "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
                    "num_attention_heads": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-6,
                    "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 32768,
                    "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 70,
                    "vocab_size": 152064, "tie_word_embeddings": False, "bos_token_id": 151643,
                    "eos_token_id": 151645, "attention_dropout": 0.0, "initializer_range": 0.02,
                    "use_cache": True, "torch_dtype": "bfloat16"},
    "qwen3-0.6b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
                   "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "attention_bias": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                   "rope_scaling": None, "max_position_embeddings": 40960, "sliding_window": None,
                   "use_sliding_window": False, "max_window_layers": 28, "vocab_size": 151936,
                   "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645,
                   "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
                   "torch_dtype": "bfloat16"},
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
                 "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "attention_bias": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                 "rope_scaling": None, "max_position_embeddings": 40960, "sliding_window": None,
                 "use_sliding_window": False, "max_window_layers": 36, "vocab_size": 151936,
                 "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
                 "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
                 "torch_dtype": "bfloat16"},
    "mistral-7b": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
                   "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "rope_scaling": None,
                   "max_position_embeddings": 32768, "sliding_window": None, "vocab_size": 32768,
                   "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
                   "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
                   "torch_dtype": "bfloat16"},
    "qwen3-30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                      "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "attention_bias": False,
                      "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
                      "max_position_embeddings": 40960, "sliding_window": None,
                      "use_sliding_window": False, "max_window_layers": 48, "vocab_size": 151936,
                      "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
                      "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
                      "router_aux_loss_coef": 0.001, "torch_dtype": "bfloat16"},
    "mixtral-8x7b": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                     "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                     "rope_theta": 1000000.0, "max_position_embeddings": 32768,
                     "sliding_window": None, "vocab_size": 32000, "tie_word_embeddings": False,
                     "bos_token_id": 1, "eos_token_id": 2, "attention_dropout": 0.0,
                     "initializer_range": 0.02, "use_cache": True, "router_aux_loss_coef": 0.02,
                     "torch_dtype": "bfloat16"},
    "gemma-2-9b": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                   "attention_bias": False, "attention_dropout": 0.0,
                   "attn_logit_softcapping": 50.0, "bos_token_id": 2, "eos_token_id": 1,
                   "final_logit_softcapping": 30.0, "head_dim": 256,
                   "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                   "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 14336,
                   "max_position_embeddings": 8192, "num_attention_heads": 16,
                   "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0,
                   "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                   "sliding_window": 4096, "torch_dtype": "float32", "vocab_size": 256000},
    "phi-3-mini-4k": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                      "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192,
                      "num_hidden_layers": 32, "num_attention_heads": 32,
                      "num_key_value_heads": 32, "max_position_embeddings": 4096,
                      "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                      "rope_theta": 10000.0, "rope_scaling": None, "sliding_window": 2047,
                      "vocab_size": 32064, "tie_word_embeddings": False, "bos_token_id": 1,
                      "eos_token_id": 32000, "pad_token_id": 32000, "attention_bias": False,
                      "initializer_range": 0.02, "torch_dtype": "bfloat16"},
    # The published config: a vision-language checkpoint, served text-only (text_only.py).
    "gemma-3-27b": {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                    "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
                    "image_token_index": 262144, "initializer_range": 0.02,
                    "mm_tokens_per_image": 256, "torch_dtype": "bfloat16",
                    "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
                                    "model_type": "gemma3_text", "num_attention_heads": 32,
                                    "num_hidden_layers": 62, "num_key_value_heads": 16,
                                    "query_pre_attn_scalar": 168,
                                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                    "sliding_window": 1024},
                    "vision_config": {"hidden_size": 1152, "image_size": 896,
                                      "intermediate_size": 4304, "model_type": "siglip_vision_model",
                                      "num_attention_heads": 16, "num_hidden_layers": 27,
                                      "patch_size": 14, "vision_use_head": False}},
}

DEFAULT_TOKENIZER_NAME = "SmolLM2-135M-Instruct"
DEFAULT_TOKENIZER_VOCAB = 49152  # its vocabulary, special tokens included


def default_tokenizer():
    """The default model's tokenizer, from the cache folder or built from its GGUF (fetching it)."""
    from .default_model import cache_dir, default_model_path  # (loader.py says why here)
    from .gguf_loader import load_gguf
    from jaxserve.tokenizer_io import load_tokenizer, save_tokenizer

    folder = cache_dir() / "tokenizers" / DEFAULT_TOKENIZER_NAME
    if (folder / "tokenizer.json").is_file():
        return load_tokenizer(folder)
    tok = load_gguf(default_model_path(), with_weights=False).tokenizer
    tmp = folder.with_name(folder.name + ".part")
    save_tokenizer(tok, tmp)
    if not folder.exists():
        tmp.replace(folder)
    return tok


def load_dummy(model: str, *, with_tokenizer: bool = True) -> Checkpoint:
    """A preset name (case-insensitive) or a path to an HF ``config.json`` (or its folder);
    ``with_tokenizer=False`` leaves the tokenizer None. A vision-language config gives its
    language model's (``text_only``).

    Raises:
      ValueError: neither a preset nor a config.json, or a config ``ModelConfig`` refuses.
    """
    key = model.lower()
    if key in PRESETS:
        name, cfg = model, copy.deepcopy(PRESETS[key])
    else:
        path = pathlib.Path(model)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"dummy model {model!r}: not a preset ({', '.join(PRESETS)}) "
                             f"and not a config.json path")
        cfg = json.loads(path.read_text())
        name = path.parent.name if path.name == "config.json" else path.stem
    ckpt = text_only(Checkpoint(name=name, hf_config=cfg, weights=None,
                                tokenizer=default_tokenizer() if with_tokenizer else None))
    config = ModelConfig.from_hf_config(ckpt.hf_config)  # with the family's defaults
    log(f"dummy model {name}: {config.architecture}, {config.num_layers} layers, hidden "
        f"{config.hidden_size}, no weights")
    if config.vocab_size < DEFAULT_TOKENIZER_VOCAB:
        log(f"dummy model {name}: vocabulary {config.vocab_size} grown to the borrowed "
            f"tokenizer's {DEFAULT_TOKENIZER_VOCAB}, so that every text prompt is in range")
        ckpt.hf_config["vocab_size"] = DEFAULT_TOKENIZER_VOCAB
    return ckpt
