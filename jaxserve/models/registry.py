"""From a loaded checkpoint to a model config and its parameters on the device."""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.config import ModelConfig
from jaxserve.models import fp8_checkpoint
from jaxserve.models.llama import checked_weights, params_from_hf, random_params
from pallas_kernels import kv_quant


def check_checkpoint(hf_config: dict, weights: dict | None, quantization: str | None = None,
                     max_model_len: int | None = None):
    """What ``build_params`` checks before it builds anything, with nothing built: the model
    config, the weight format, and (``weights`` given) every tensor's presence, shape and FP8
    dtype (``llama.checked_weights``). ``checkpoints_tools.convert`` runs it so that what it
    writes loads.

    Returns:
      (``ModelConfig``, the weight format: ``fp8_checkpoint.weight_format``'s).
    Raises:
      ValueError: as ``build_params``, but for the mesh size.
    """
    if quantization not in (None, "fp8", *fp8_checkpoint.METHODS):
        raise ValueError(f"unsupported {fp8_checkpoint.FLAG} {quantization!r} "
                         f"(fp8, {', '.join(fp8_checkpoint.METHODS)})")
    fmt = fp8_checkpoint.weight_format(hf_config, quantization)
    config = ModelConfig.from_hf_config(hf_config, max_model_len)
    if fmt is not None and config.num_experts:
        raise ValueError(f"{fp8_checkpoint.FLAG} {quantization or fmt.method}: FP8 weights of "
                         f"mixture-of-experts models ({config.architecture}) are not supported")
    if (isinstance(fmt, fp8_checkpoint.Fp8Checkpoint)
            and config.architecture == "Phi3ForCausalLM"):
        raise ValueError(f"quantization_config {fmt.method}: FP8 checkpoints of "
                         f"{config.architecture} are not supported (--quantization fp8 "
                         f"quantizes its bf16 checkpoint at load)")
    if weights is not None:
        checked_weights(config, weights, fmt)
    return config, fmt


def build_params(hf_config: dict, weights: dict | None, dtype, seed: int = 0,
                 mesh: Mesh | None = None, quantization: str | None = None,
                 max_model_len: int | None = None) -> tuple[ModelConfig, dict]:
    """Model config and params (``jaxserve.models.llama``) of device arrays in ``dtype``, built
    one layer at a time and split over ``mesh`` (``jaxserve.models.sharding``) if given, the
    layers' linear projections as ``linear.Fp8Weight`` where ``quantization``
    (``--quantization``) or the checkpoint's ``quantization_config`` says so
    (``fp8_checkpoint.weight_format``); returns once they are on the device(s), so a caller's
    timing covers it.

    ``weights`` None gives random weights of the real shapes (``--load-format dummy``, drawn
    from ``seed``); for an FP8 checkpoint's config, quantized as ``--quantization fp8`` does.
    ``max_model_len`` as ``ModelConfig.from_hf_config``.

    Raises:
      ValueError: unsupported architecture or quantization (naming --quantization or the
        ``quantization_config`` field; FP8 weights of an MoE model; an FP8 checkpoint of
        Phi-3, whose scales belong to its fused projections), a missing tensor, a tensor of
        the wrong shape or dtype (``check_checkpoint``'s checks, the tensors' in
        ``params_from_hf``, all before anything is built), or a mesh size that does not divide
        the model (naming --tensor-parallel-size).
    """
    # The tensors are checked by params_from_hf, before it builds the first.
    config, fmt = check_checkpoint(hf_config, None, quantization, max_model_len)
    if weights is None:
        params = random_params(config, dtype, seed, mesh, None if fmt is None else "fp8")
    else:
        params = params_from_hf(config, weights, dtype, mesh, fmt)
    return config, jax.block_until_ready(params)


def resolve_kv_cache_dtype(kv_cache_dtype: str):
    """A resolved --kv-cache-dtype -> the pool's dtype: "fp8" is float8_e4m3fn
    (``pallas_kernels.kv_quant``).

    Raises:
      ValueError: for a name other than bfloat16, float32, fp8.
    """
    if kv_cache_dtype == "fp8":
        return jnp.dtype(kv_quant.FP8_DTYPE)
    if kv_cache_dtype in ("bfloat16", "float32"):
        return jnp.dtype(kv_cache_dtype)
    raise ValueError(f"unsupported --kv-cache-dtype {kv_cache_dtype!r} (bfloat16, float32, fp8)")
