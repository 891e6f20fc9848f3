"""Engine configuration: plain dataclasses filled from CLI flags / LLM(...) keyword arguments,
and the configuration the engine resolves from them.

ModelConfig is read from a HF ``config.json`` dict (the upstream format of every loader).
EngineConfig is what the user set; ``resolve_config`` fills in the device's defaults
(``jaxserve.platforms``) once the model is known, giving the ResolvedConfig the engine runs
with and sends to the API process in its ``Ready`` message.
"""

import dataclasses
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import msgspec

from jaxserve.platforms import CPU, GPU, Platform

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)
# The gated MLP's activations by HF name: silu (SwiGLU), gelu_pytorch_tanh (GeGLU, Gemma).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# HF's defaults (transformers' Gemma2Config, Gemma3TextConfig) for the keys a config of that
# family may leave out (Gemma 3's published configs nest a partial ``text_config``).
_GEMMA_DEFAULTS = dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                       hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                       tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096)
_HF_DEFAULTS = {
    "Gemma2ForCausalLM": {**_GEMMA_DEFAULTS, "vocab_size": 256000, "max_position_embeddings": 8192,
                          "rope_theta": 10000.0, "final_logit_softcapping": 30.0,
                          "attn_logit_softcapping": 50.0},
    "Gemma3ForCausalLM": {**_GEMMA_DEFAULTS, "vocab_size": 262208,
                          "max_position_embeddings": 131072, "rope_theta": 1_000_000.0,
                          "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6},
}


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
    qk_norm: bool  # RMSNorm on q and k per head before RoPE (Qwen3, Gemma 3)
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    # Mixture of experts (jaxserve.models.moe); num_experts 0 for a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert; 0: none
    norm_topk_prob: bool = False  # the chosen experts' weights renormalized to sum to 1
    sparse_layers: tuple[bool, ...] = ()  # per layer: an MoE block (else the dense MLP)
    # per layer: the sliding window (keys a query sees, itself included), None for full attention
    layer_windows: tuple[int | None, ...] = ()
    # The Gemma families (2 and 3); Llama's values otherwise.
    hidden_act: str = "silu"  # the gated MLP's activation (ACTIVATIONS)
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), in float32
    sandwich_norms: bool = False  # norms on the attention's and the MLP's outputs, one before it
    embed_scale: float = 1.0  # the embedding rows times this (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # softmax scale (query_pre_attn_scalar ** -0.5); None: D ** -0.5
    attn_logit_softcapping: float | None = None  # scores capped at C tanh(x / C)
    final_logit_softcapping: float | None = None  # logits capped so
    local_rope_theta: float | None = None  # the sliding layers' RoPE base, unscaled (Gemma 3)
    # RoPE on a head's first rotary_dim features, the rest passed through (partial_rotary_factor)
    rotary_dim: int | None = None  # None: all of head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict, max_model_len: int | None = None) -> "ModelConfig":
        """The config of an HF ``config.json`` dict; ``max_model_len`` (default the model's
        ``max_position_embeddings``) picks LongRoPE's factor set (``_rope_fields``).

        Raises ValueError for an architecture this engine does not implement, or a config
        option of a supported one that it does not (naming the option)."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        cfg = {**_HF_DEFAULTS.get(arch, {}), **cfg}
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        rope_theta, rope_scaling, local_rope_theta = _rope_fields(arch, cfg, max_model_len)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope = cfg.get("rope_parameters") or {}
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=(arch == "Qwen2ForCausalLM" or cfg.get("attention_bias", False)
                            or (arch == "Qwen2MoeForCausalLM" and cfg.get("qkv_bias", True))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            eos_token_ids=eos,
            layer_windows=_layer_windows(arch, cfg),
            local_rope_theta=local_rope_theta,
            rotary_dim=None if partial == 1.0 else int(head_dim * partial),
            **_moe_fields(arch, cfg),
            **_gemma_fields(arch, cfg),
        )


def _rope_fields(arch: str, cfg: dict,
                 max_model_len: int | None) -> tuple[float, dict | None, float | None]:
    """(rope_theta, rope_scaling or None, the sliding layers' own base or None) of an HF config:
    top-level keys, or transformers 5's ``rope_parameters`` (one dict, or for Gemma 3 one per
    layer type). Gemma 3's sliding layers use ``rope_local_base_freq`` without scaling.

    LongRoPE (Phi-3's ``longrope``, formerly ``su``) resolves to one factor set for the server's
    life, since the KV cache holds keys rotated by it: the long factors when ``max_model_len``
    exceeds ``original_max_position_embeddings``, the short ones otherwise, with HF's attention
    factor. HF switches per forward pass (long once a sequence passes the original length), so
    the two agree on every sequence when max_model_len <= the original length, and on sequences
    longer than it otherwise.

    Raises:
      ValueError: a rope type on Gemma 3's sliding layers other than the default.
    """
    rope = dict(cfg.get("rope_parameters") or {})
    local = rope.pop("sliding_attention", None)
    rope = rope.pop("full_attention", rope)
    scaling = cfg.get("rope_scaling") or rope or None
    kind = scaling and scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        scaling = None
    elif kind in ("longrope", "su"):
        scaling = _longrope(cfg, scaling, max_model_len)
    theta = rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0
    if arch != "Gemma3ForCausalLM":
        return theta, scaling, None
    local = local or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported config option rope_parameters.sliding_attention "
                         f"rope_type {local['rope_type']!r} of {arch}")
    return theta, scaling, local.get("rope_theta") or cfg["rope_local_base_freq"]


def _longrope(cfg: dict, scaling: dict, max_model_len: int | None) -> dict:
    """LongRoPE's ``{"rope_type": "longrope", "ext_factors", "attention_factor"}`` for a server
    of ``max_model_len`` tokens (``_rope_fields``; transformers' ``_compute_longrope_parameters``
    for the attention factor)."""
    max_pos = cfg["max_position_embeddings"]
    original = (scaling.get("original_max_position_embeddings")
                or cfg.get("original_max_position_embeddings") or max_pos)
    factor = scaling.get("factor") or max_pos / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0 else
                            math.sqrt(1 + math.log(factor) / math.log(original)))
    long = (max_model_len or max_pos) > original
    return {"rope_type": "longrope", "attention_factor": attention_factor,
            "ext_factors": tuple(scaling["long_factor" if long else "short_factor"])}


def _gemma_fields(arch: str, cfg: dict) -> dict:
    """ModelConfig's activation and Gemma fields (HF's ``Gemma2*`` / ``Gemma3Text*`` modules:
    GeGLU, (1 + w) RMSNorms around both blocks, the scaled embedding, the attention scale and
    soft-capping).

    Raises:
      ValueError: an activation outside ACTIVATIONS (naming the config key).
    """
    gemma = arch.startswith("Gemma")
    key = "hidden_activation" if gemma else "hidden_act"
    act = cfg.get(key) or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported config option {key} {act!r} of {arch} "
                         f"(supported: {', '.join(ACTIVATIONS)})")
    if not gemma:
        return dict(hidden_act=act)
    return dict(hidden_act=act, norm_unit_offset=True, sandwich_norms=True,
                embed_scale=cfg["hidden_size"] ** 0.5,
                attn_scale=cfg["query_pre_attn_scalar"] ** -0.5,
                attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
                final_logit_softcapping=cfg.get("final_logit_softcapping"))


def _layer_windows(arch: str, cfg: dict) -> tuple[int | None, ...]:
    """Each layer's sliding window as HF's modeling code of ``arch`` applies it (None: full
    attention): Mistral, Mixtral and Phi-3 put ``sliding_window`` on every layer; the Gemma families
    on the layers ``layer_types`` marks "sliding_attention" (by default every other one from
    the first for Gemma 2, all but every ``sliding_window_pattern``-th for Gemma 3); the Qwen
    families only with ``use_sliding_window``, on the layers ``layer_types`` (or HF's default
    rule for it) marks (Qwen3-MoE: every layer).

    Raises:
      ValueError: a ``layer_types`` entry other than full_attention and sliding_attention.
    """
    n = cfg["num_hidden_layers"]
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        return (cfg.get("sliding_window") or None,) * n
    if arch.startswith("Gemma"):  # every other layer (Gemma 2), or five of every six (Gemma 3)
        window = cfg["sliding_window"]
        pattern = 2 if arch == "Gemma2ForCausalLM" else (
            cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern"))
        default = lambda i: (i + 1) % pattern  # noqa: E731
    elif not arch.startswith("Qwen") or not cfg.get("use_sliding_window"):
        return (None,) * n
    else:
        window = cfg.get("sliding_window") or 4096
        if arch == "Qwen3MoeForCausalLM":
            return (window,) * n
        last_full = cfg.get("max_window_layers", 28)
        default = ((lambda i: i >= last_full) if arch != "Qwen2MoeForCausalLM"  # noqa: E731
                   else (lambda i: (i + 1) % 2 and i < last_full))
    types = cfg.get("layer_types") or [
        "sliding_attention" if default(i) else "full_attention" for i in range(n)]
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"unsupported config option layer_types {sorted(unknown)} of {arch}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _moe_fields(arch: str, cfg: dict) -> dict:
    """ModelConfig's mixture-of-experts fields of an MoE family's HF config (HF's defaults for
    the keys it leaves out); none for a dense one.

    Raises:
      ValueError: an expert count below the experts per token.
    """
    if arch == "MixtralForCausalLM":
        fields = dict(num_experts=cfg.get("num_local_experts", 8),
                      num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
                      moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                      sparse_layers=(True,) * cfg["num_hidden_layers"])
    elif arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        qwen2 = arch == "Qwen2MoeForCausalLM"
        # Hub configs say num_experts; transformers 5 writes num_local_experts.
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 60 if qwen2 else 128))
        step = cfg.get("decoder_sparse_step", 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        fields = dict(
            num_experts=num_experts, num_experts_per_tok=cfg.get("num_experts_per_tok", 4 if qwen2 else 8),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 1408 if qwen2 else 768),
            shared_expert_intermediate_size=(cfg.get("shared_expert_intermediate_size", 5632)
                                             if qwen2 else 0),
            norm_topk_prob=cfg.get("norm_topk_prob", False),
            # HF's rule (Qwen2MoeDecoderLayer, Qwen3MoeDecoderLayer).
            sparse_layers=tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0
                                for i in range(cfg["num_hidden_layers"])))
    else:
        return {}
    if 0 < fields["num_experts"] < fields["num_experts_per_tok"]:
        raise ValueError(f"num_experts_per_tok {fields['num_experts_per_tok']} exceeds the "
                         f"{fields['num_experts']} experts of {arch}")
    return fields


class Valid(NamedTuple):
    """A numeric EngineConfig field's valid values (``metadata["valid"]``)."""

    ok: Callable[[float], bool]
    text: str  # what a valid value is, for the error message: "positive", "in (0, 1]"


_POSITIVE = Valid(lambda v: v > 0, "positive")


@dataclass
class EngineConfig:
    """Everything the engine process needs to start (vLLM's ``EngineArgs``).

    Every field is a CLI flag of ``python -m jaxserve.serve`` and ``scripts/offline_batch.py``
    (``max_num_seqs`` -> ``--max-num-seqs``), generated by ``jaxserve/engine/arg_utils.py`` from
    the field's default, its type (a ``Literal`` gives the choices, ``bool`` a
    ``--x/--no-x`` pair) and its metadata: ``help``, and for a number ``valid`` (a ``Valid``),
    checked by the flag so that a bad value is a usage error naming it. ``resolved`` marks a
    field whose None or "auto" the engine replaces with the device's default (``resolve_config``).
    """

    model: str | None = field(default=None, metadata={"help": (
        "HF folder, GGUF file, orbax folder, or (with --load-format dummy) a preset name or "
        "config.json; None: SmolLM2-135M-Instruct, fetched on first use")})
    load_format: Literal["auto", "gguf", "safetensors", "orbax", "dummy"] = field(
        default="auto", metadata={"help": (
            "checkpoint format; auto: from the path; dummy: random weights for --model PRESET "
            "or config.json")})
    dtype: Literal["auto", "bfloat16", "float32"] = field(default="auto", metadata={
        "help": "weights dtype (and the KV cache's with --kv-cache-dtype auto); auto: "
                f"{GPU.dtype} on GPU, {CPU.dtype} on CPU", "resolved": True})
    quantization: Literal["fp8", "compressed-tensors", "modelopt", "fbgemm_fp8"] | None = field(
        default=None, metadata={"help": (
            "weight format of the decoder layers' linear projections; fp8: float8_e4m3fn "
            "weights quantized at load with a scale per output channel, activations quantized "
            "per token at run time (W8A8; embeddings, norms and the LM head stay in --dtype); "
            "compressed-tensors, modelopt, fbgemm_fp8: an FP8 checkpoint of that method (read "
            "from its quantization_config without the flag; a flag naming another method is an "
            "error); None: the checkpoint's method, or --dtype")})
    kv_cache_dtype: Literal["auto", "bfloat16", "float32", "fp8"] = field(
        default="auto", metadata={"help": (
            "KV cache dtype; auto: the weights' dtype; fp8: float8_e4m3fn with a float32 scale "
            "per token and KV head (about half the bytes of bfloat16, so about twice the "
            "tokens fit)"), "resolved": True})
    max_model_len: int | None = field(default=None, metadata={"help": (
        "longest sequence, prompt + output, tokens; None: the model's max_position_embeddings "
        f"on GPU, at most {CPU.max_model_len} on CPU"), "valid": _POSITIVE, "resolved": True})
    max_num_seqs: int | None = field(default=None, metadata={
        "help": f"most sequences in one step; None: {CPU.max_num_seqs} on CPU, "
                f"{GPU.max_num_seqs} on GPU", "valid": _POSITIVE, "resolved": True})
    max_num_batched_tokens: int | None = field(default=None, metadata={"help": (
        "token budget of one step, at least --max-num-seqs (chunked prefill splits longer "
        f"prompts); None: {CPU.max_num_batched_tokens} on CPU, {GPU.max_num_batched_tokens} on "
        "GPU"), "valid": _POSITIVE, "resolved": True})
    # The Pallas kernels tile KV pages in power-of-two blocks (docs/architecture.md,
    # "KV page pool").
    page_size: int = field(default=16, metadata={
        "help": "tokens per KV page (block)",
        "valid": Valid(lambda v: v > 0 and v & (v - 1) == 0, "a power of two")})
    kv_cache_gib: float = field(default=2.0, metadata={
        "help": "KV pool size on CPU, GiB (of each device, with --tensor-parallel-size)",
        "valid": _POSITIVE})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "fraction of the GPU's total memory the engine may use (weights, activations, "
                "KV pool)",
        "valid": Valid(lambda v: 0 < v <= 1, "in (0, 1]")})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse cached KV pages across requests with a shared prefix"})
    async_scheduling: bool = field(default=True, metadata={
        "help": "schedule and dispatch step N+1 while the device runs step N (the host learns "
                "sampled tokens one step late); --no-async-scheduling waits for each step"})
    attention_backend: Literal["auto", "pallas", "reference"] = field(default="auto", metadata={
        "help": f"pallas: the Pallas kernels; reference: pure JAX; auto: {GPU.attention_backend} "
                f"on GPU, {CPU.attention_backend} on CPU", "resolved": True})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "devices the model is split over (Megatron-style tensor parallelism on a "
                "jax.sharding mesh; docs/parallelism.md); must divide the model's attention "
                "heads", "valid": _POSITIVE})
    num_hosts: int = field(default=1, metadata={
        "help": "hosts (processes) the --tensor-parallel-size devices span; above 1, each host "
                "starts with the same flags and its own --host-id, host 0 serves and the others "
                "follow its steps (jax.distributed; docs/parallelism.md)", "valid": _POSITIVE})
    host_id: int = field(default=0, metadata={
        "help": "this host's index, 0 to --num-hosts - 1; host 0 runs the server, the others "
                "run without one", "valid": Valid(lambda v: v >= 0, "non-negative")})
    distributed_coordinator: str | None = field(default=None, metadata={"help": (
        "host:port where host 0 runs the jax.distributed coordinator (with --num-hosts above "
        "1); None: JAX detects it from the cluster's environment (SLURM, Open MPI, ...)")})
    generation_config: str = field(default="auto", metadata={"help": (
        "sampling defaults for requests that leave them out (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_tokens): auto: the model's generation_config.json (the default "
        "model: its model card's chat defaults); vllm: none (temperature 1.0, no top-p/top-k); "
        "or a folder holding a generation_config.json")})
    # Same range as SamplingParams.seed.
    seed: int = field(default=0, metadata={
        "help": "seed of the engine's default RNG (requests without their own seed) and of "
                "dummy weights",
        "valid": Valid(lambda v: 0 <= v < 2**63, "a non-negative 63-bit integer")})


def _resolved_type(hint):
    """The type of a resolved field: ``X`` for ``X | None``, a Literal without "auto"."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        return Literal[tuple(a for a in args if a != "auto")]
    (hint,) = (a for a in args if a is not type(None))
    return hint


_HINTS = typing.get_type_hints(EngineConfig)
ResolvedConfig = msgspec.defstruct(
    "ResolvedConfig",
    [(f.name, _resolved_type(_HINTS[f.name]) if f.metadata.get("resolved") else _HINTS[f.name])
     for f in dataclasses.fields(EngineConfig)],
    frozen=True, module=__name__)
ResolvedConfig.__doc__ = """EngineConfig's fields as the engine runs with them: the ``resolved``
ones hold the device's default where the user left them unset (no None, no "auto")."""


def resolve_config(config: EngineConfig, platform: Platform,
                   max_position_embeddings: int) -> ResolvedConfig:
    """The configuration the engine runs with on ``platform`` for a model of
    ``max_position_embeddings`` tokens.

    Raises:
      ValueError: --max-model-len above max_position_embeddings, or --max-num-batched-tokens
        below --max-num-seqs (the message names the flag).
    """
    dtype = platform.dtype if config.dtype == "auto" else config.dtype
    resolved = dict(
        dtype=dtype,
        kv_cache_dtype=dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype,
        max_model_len=(config.max_model_len
                       or platform.default_max_model_len(max_position_embeddings)),
        max_num_seqs=config.max_num_seqs or platform.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens or platform.max_num_batched_tokens,
        attention_backend=(platform.attention_backend if config.attention_backend == "auto"
                           else config.attention_backend),
    )
    if resolved["max_model_len"] > max_position_embeddings:
        raise ValueError(f"--max-model-len {resolved['max_model_len']} exceeds the model's "
                         f"max_position_embeddings {max_position_embeddings}")
    if resolved["max_num_batched_tokens"] < resolved["max_num_seqs"]:
        raise ValueError("--max-num-batched-tokens must be at least --max-num-seqs")
    return ResolvedConfig(**{**dataclasses.asdict(config), **resolved})
