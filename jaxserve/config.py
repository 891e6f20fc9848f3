"""Engine configuration: plain dataclasses filled from CLI flags / LLM(...) keyword arguments.

ModelConfig is read from a HF ``config.json`` dict (the upstream format of every loader).
"""

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a Llama-family decoder, from HF config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # RMSNorm on q and k per head before RoPE (Qwen3)
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelConfig":
        """Raises ValueError for an architecture this engine does not implement."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(cfg.get("rope_parameters") or {})
        rope_scaling = cfg.get("rope_scaling") or rope or None
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0,
            rope_scaling=rope_scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=arch == "Qwen2ForCausalLM" or cfg.get("attention_bias", False),
            qk_norm=arch == "Qwen3ForCausalLM",
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            eos_token_ids=eos,
        )


@dataclass
class EngineConfig:
    """Everything the engine process needs to start (CLI flags of ``python -m jaxserve.serve``).

    Attributes:
      model: a HF folder, a GGUF file, an orbax folder, a dummy preset name or config.json path;
        None means the default model (SmolLM2-135M-Instruct, fetched on first use).
      load_format: "auto", "gguf", "safetensors", "orbax" or "dummy".
      dtype: "auto" (bfloat16 on GPU, float32 on CPU), "bfloat16" or "float32".
      max_model_len: longest sequence (prompt + output) in tokens; None = min(model's, 4096).
      max_num_seqs: most sequences in one step.
      max_num_batched_tokens: token budget of one step (chunked prefill splits longer prompts).
      page_size: tokens per KV page (block).
      kv_cache_gib: KV pool size on CPU, GiB.
      gpu_memory_utilization: fraction of the GPU's total memory the engine may use.
      enable_prefix_caching: reuse full KV pages across requests with the same prefix.
      attention_backend: "auto" (Pallas on GPU, reference on CPU), "pallas" or "reference".
      seed: seed of the engine's default RNG (requests without their own seed).
    """

    model: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    page_size: int = 16
    kv_cache_gib: float = 2.0
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    seed: int = 0
