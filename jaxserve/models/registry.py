"""From a loaded checkpoint to a model config and its parameters on the device."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models.llama import LlamaForCausalLM, params_from_hf


def build_params(hf_config: dict, weights: dict | None, dtype, seed: int = 0) -> tuple[ModelConfig, dict]:
    """Model config and pure params dict of device arrays in ``dtype``.

    ``weights`` None gives random weights of the real shapes (``--load-format dummy``).

    Raises:
      ValueError: unsupported architecture, a missing tensor, or a tensor of the wrong shape.
    """
    config = ModelConfig.from_hf_config(hf_config)
    if weights is None:
        model = LlamaForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed))
        return config, nnx.to_pure_dict(nnx.state(model))
    abstract = nnx.to_pure_dict(
        nnx.state(nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0))))
    )
    params = params_from_hf(config, weights, dtype)
    for path, spec in jax.tree_util.tree_leaves_with_path(abstract):
        got = functools.reduce(lambda d, k: d[k.key], path, params)
        if got.shape != spec.shape:
            name = "/".join(k.key for k in path)
            raise ValueError(f"tensor {name} has shape {got.shape}, expected {spec.shape}")
    return config, params


def resolve_dtype(dtype: str):
    """"auto" is bfloat16 on GPU and float32 on CPU.

    Raises:
      ValueError: for a name other than auto, bfloat16, float32.
    """
    if dtype == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    if dtype in ("bfloat16", "float32"):
        return jnp.dtype(dtype)
    raise ValueError(f"unsupported dtype {dtype!r} (auto, bfloat16, float32)")
