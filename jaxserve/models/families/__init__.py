"""The architecture table: an HF ``architectures[0]`` -> its ``Family`` (one module a family:
what its config sets in ``ModelConfig``, HF's defaults, its checkpoints' tensor names).

Every family runs the one decoder of ``jaxserve.models.llama`` with the options its config
sets, over Llama's parameter layout and sharding rules (``jaxserve.models.sharding``); a family
whose checkpoints name tensors otherwise maps them to Llama's names at load.
"""

from jaxserve.models.families import gemma, llama, phi3, qwen
from jaxserve.models.families.family import ACTIVATIONS, Family, rope_fields

# Options HF's modeling code of these families implements that the decoder does not: refused
# when set to anything but the value given here.
_UNSUPPORTED = {"mlp_bias": False, "use_bidirectional_attention": False}

ARCHITECTURES: dict[str, Family] = (llama.ARCHITECTURES | qwen.ARCHITECTURES
                                    | gemma.ARCHITECTURES | phi3.ARCHITECTURES)
# The HF names (block, gate, up, down) of every MoE family's experts.
EXPERT_NAMES = tuple(f.expert_names for f in ARCHITECTURES.values() if f.expert_names)
# HF's model_type -> architecture, for a config that names no ``architectures`` (HF's auto
# classes pick the model by model_type).
MODEL_TYPES = {f.model_type: arch for arch, f in ARCHITECTURES.items()}


def architecture(cfg: dict) -> str:
    """The config's architecture: its ``architectures[0]``, else its ``model_type``'s.

    Raises:
      ValueError: a config with neither key (naming them), or an architecture or model_type
        outside the table.
    """
    if cfg.get("architectures"):
        arch = cfg["architectures"][0]
    elif "model_type" in cfg:
        arch = MODEL_TYPES.get(cfg["model_type"])
        if arch is None:
            raise ValueError(f"unsupported model_type {cfg['model_type']!r} (config.json names "
                             f"no architectures); supported: {', '.join(MODEL_TYPES)}")
    else:
        raise ValueError("config.json has neither 'architectures' nor 'model_type': it does not "
                         "say which model it is")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    return arch


def model_config_fields(cfg: dict, max_model_len: int | None = None) -> dict:
    """``ModelConfig``'s fields of an HF config: the shapes every family has, then the
    family's own (``Family.fields``); ``max_model_len`` as ``family.rope_fields``.

    Raises:
      ValueError: an unsupported architecture, a config option of a supported one that is
        not implemented (naming it), or a key the architecture needs that the config lacks
        (``config.json: missing required key 'hidden_size'``).
    """
    try:
        return _fields(cfg, max_model_len)
    except KeyError as e:  # the config's keys are read where they are used, in every family
        raise ValueError(f"config.json: missing required key {e.args[0]!r}") from None


def _fields(cfg: dict, max_model_len: int | None) -> dict:
    arch = architecture(cfg)
    family = ARCHITECTURES[arch]
    cfg = {**family.defaults, **cfg}
    num_heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    for key, plain in _UNSUPPORTED.items():
        if cfg.get(key, plain) not in (plain, None):
            raise ValueError(f"unsupported config option {key} {cfg[key]!r} of {arch}")
    act = cfg.get(family.activation_key) or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported config option {family.activation_key} {act!r} of {arch} "
                         f"(supported: {', '.join(ACTIVATIONS)})")
    return dict(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", False),
        o_proj_bias=cfg.get("attention_bias", False),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
        hidden_act=act,
        layer_windows=(None,) * cfg["num_hidden_layers"],
    ) | rope_fields(cfg, max_model_len) | family.fields(cfg)
