"""PEFT LoRA folders, read and checked against the base model (no JAX: the API process checks
an adapter before it registers one, and the engine reads the same way before it serves one).

A PEFT folder (PEFT's ``save_pretrained``) holds ``adapter_config.json`` (``r``,
``lora_alpha``, ``use_rslora``, ``target_modules``, ...) and ``adapter_model.safetensors`` with,
per adapted projection, ``base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_A.weight``
``[r, in]`` and ``...lora_B.weight`` ``[out, r]`` (torch's ``[out, in]`` layout). The update is
``W x + s B A x`` with ``s = lora_alpha / r`` (Hu et al. 2021, "LoRA") or, with rsLoRA,
``s = lora_alpha / sqrt(r)`` (Kalajdzievski 2023).

Refused, each with an error naming the adapter and the reason: a missing file, an adapter of
another PEFT method (``peft_type`` other than ``LORA``; a config without ``peft_type`` is read
as LoRA, as vLLM reads it), an ``adapter_config.json`` whose LoRA fields are missing or invalid
(one line naming the field), a rank above ``--max-lora-rank``, target modules other than the
decoder layers' q/k/v/o/gate/up/down projections (e.g. ``embed_tokens``, ``lm_head``), PEFT
options that change the math (DoRA, biases, ``lora_bias``, ``modules_to_save``, per-module rank
or alpha patterns, ``fan_in_fan_out``), and tensors whose shapes or layer numbers do not fit the
base model (an adapter for another model).
"""

import json
import math
import pathlib
import re
from dataclasses import dataclass

import msgspec
import numpy as np
import pydantic
from safetensors import SafetensorError, safe_open

from jaxserve.config import ModelConfig

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# The projections an adapter may target: HF names, each in the decoder layers' attention or MLP.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                     r"(\w+)\.lora_([AB])\.weight")


class LoRAShapes(msgspec.Struct, frozen=True):
    """What an adapter must fit: the decoder layers and each target module's (in, out) features.
    The engine sends it to the API process in ``Ready``."""

    num_layers: int
    modules: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, c: ModelConfig) -> "LoRAShapes":
        """The shapes of the model's first layer's HF projection weights (``[out, in]``)."""
        from jaxserve.models.llama import hf_tensor_shapes  # JAX: the engine's side only

        modules = {}
        for name, shape in hf_tensor_shapes(c)[1].items():
            m = re.fullmatch(r"(?:self_attn|mlp)\.(\w+)\.weight", name)
            if m and m[1] in TARGET_MODULES:
                modules[m[1]] = (shape[1], shape[0])
        return cls(c.num_layers, modules)


class _AdapterConfig(pydantic.BaseModel):
    """The fields of PEFT's ``LoraConfig`` that the math depends on (others are ignored)."""

    r: int = pydantic.Field(gt=0)
    lora_alpha: float
    use_rslora: bool = False
    target_modules: list[str] | str
    use_dora: bool = False
    bias: str = "none"
    lora_bias: bool = False
    modules_to_save: list[str] | None = None
    rank_pattern: dict = {}
    alpha_pattern: dict = {}
    fan_in_fan_out: bool = False


def _read_config(text: str) -> _AdapterConfig:
    """``adapter_config.json``'s text as a LoRA config.

    Raises:
      ValueError: not JSON, not an object, a ``peft_type`` other than ``LORA`` (a config without
        one is read as LoRA, as vLLM reads it), or a LoRA field missing or invalid; one line
        naming the field (``r: Input should be greater than 0``).
    """
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"not a JSON object but {type(raw).__name__}")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"peft_type {peft_type!r}: only LoRA adapters (peft_type 'LORA') are "
                         "served")
    try:
        return _AdapterConfig.model_validate(raw)
    except pydantic.ValidationError as e:
        # Per field, its deepest error (a union reports one per member; the deepest is about
        # the value, e.g. target_modules' item).
        errors = {}
        for err in e.errors(include_url=False, include_input=False):
            field = str(err["loc"][0])
            if field not in errors or len(err["loc"]) > len(errors[field]["loc"]):
                errors[field] = err
        raise ValueError("; ".join(
            f"{field}: {'field required' if err['type'] == 'missing' else err['msg']}"
            for field, err in errors.items())) from None


@dataclass
class LoRAAdapter:
    """One adapter as read.

    Attributes:
      rank: r.
      scaling: s, lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).
      weights: (layer, module name) -> (A [r, in], B [out, r]) float32, the modules the file
        holds; empty when read without weights (a check only).
    """

    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


def read_adapter(path: str, shapes: LoRAShapes | None, max_rank: int,
                 with_weights: bool = True) -> LoRAAdapter:
    """Read and check the PEFT folder ``path`` against ``shapes`` (without ``with_weights``
    only its config and tensor shapes are read; without ``shapes``, before the model is known,
    what can be checked without it).

    Raises:
      ValueError: the folder or a file is missing or unreadable, or the adapter is refused (the
        module docstring lists why); the message names the adapter's path.
    """
    folder = pathlib.Path(path)

    def refuse(why: str) -> ValueError:
        return ValueError(f"LoRA adapter {path}: {why}")

    if not folder.is_dir():
        raise refuse("no such folder")
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (folder / name).is_file():
            pickle = name == WEIGHTS_NAME and (folder / "adapter_model.bin").is_file()
            # A pickle runs code as it loads: it is not read (PEFT saves safetensors by default).
            raise refuse(f"no {name} in the folder" + (
                " (its adapter_model.bin, a pickle, is not read: save the adapter with PEFT's "
                "default safe_serialization=True)" if pickle else ""))
    try:
        text = (folder / CONFIG_NAME).read_text()
    except (OSError, ValueError) as e:  # ValueError: not UTF-8
        raise refuse(f"unreadable {CONFIG_NAME}: {e}") from None
    try:
        cfg = _read_config(text)
    except ValueError as e:
        raise refuse(f"{CONFIG_NAME}: {e}") from None
    if cfg.r > max_rank:
        raise refuse(f"rank {cfg.r} exceeds --max-lora-rank {max_rank}")
    if isinstance(cfg.target_modules, str):
        raise refuse(f"target_modules {cfg.target_modules!r} is not a list of module names")
    unsupported = sorted(set(cfg.target_modules) - set(TARGET_MODULES))
    if unsupported:
        raise refuse(f"unsupported target modules {unsupported}; supported: "
                     f"{list(TARGET_MODULES)}")
    options = {"use_dora": cfg.use_dora, "bias": cfg.bias != "none",
               "lora_bias": cfg.lora_bias, "modules_to_save": bool(cfg.modules_to_save),
               "rank_pattern": bool(cfg.rank_pattern), "alpha_pattern": bool(cfg.alpha_pattern),
               "fan_in_fan_out": cfg.fan_in_fan_out}
    if any(options.values()):
        raise refuse(f"unsupported PEFT options {[k for k, v in options.items() if v]}")
    scaling = cfg.lora_alpha / (math.sqrt(cfg.r) if cfg.use_rslora else cfg.r)
    weights: dict[tuple[int, str], list] = {}
    try:
        with safe_open(folder / WEIGHTS_NAME, framework="numpy") as f:
            for name in f.keys():
                m = _TENSOR.fullmatch(name)
                if m is None or m[2] not in cfg.target_modules:
                    raise refuse(f"tensor {name}: not a LoRA weight of a target module "
                                 f"{list(TARGET_MODULES)}")
                layer, module, which = int(m[1]), m[2], m[3]
                if shapes is None:
                    continue
                if layer >= shapes.num_layers or module not in shapes.modules:
                    raise refuse(f"tensor {name}: the base model has {shapes.num_layers} layers"
                                 + ("" if module in shapes.modules else f" and no {module}"))
                n_in, n_out = shapes.modules[module]
                expected = (cfg.r, n_in) if which == "A" else (n_out, cfg.r)
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected:
                    raise refuse(f"tensor {name} has shape {list(shape)}, the base model needs "
                                 f"{list(expected)} (an adapter for another base model?)")
                pair = weights.setdefault((layer, module), [None, None])
                pair[which == "B"] = (np.asarray(f.get_tensor(name), np.float32)
                                      if with_weights else shape)
    except (OSError, SafetensorError) as e:
        raise refuse(f"unreadable {WEIGHTS_NAME}: {e}") from None
    missing = sorted(f"layer {k[0]} {k[1]}" for k, (a, b) in weights.items()
                     if a is None or b is None)
    if missing:
        raise refuse(f"lora_A or lora_B missing for {missing[:4]}")
    return LoRAAdapter(cfg.r, scaling, {k: tuple(v) for k, v in weights.items()}
                       if with_weights else {})

