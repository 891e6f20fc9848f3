"""RoPE inverse frequencies, with Llama-3 ("llama3"), linear or LongRoPE scaling: numpy only,
shared by the model and the GGUF loader (which recognises Llama-3 scaling from llama.cpp's
``rope_freqs``)."""

import math

import numpy as np


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies (radians per position).

    Args:
      head_dim: features a head rotates (even; the rotary part of a partial-rotary head).
      theta: RoPE base.
      scaling: HF ``rope_scaling`` (``rope_type`` or ``type``: ``llama3`` or ``linear``), or
        LongRoPE's as ``ModelConfig`` resolves it (``rope_type`` ``longrope`` with its chosen
        ``ext_factors``, [head_dim // 2]), or None.

    Raises:
      ValueError: for a rope_scaling type other than llama3, linear or longrope.
    """
    d = head_dim
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if not scaling:
        return inv_freq.astype(np.float32)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":  # transformers' _compute_longrope_parameters
        return (inv_freq / np.asarray(scaling["ext_factors"], np.float64)).astype(np.float32)
    factor = scaling["factor"]
    if kind == "linear":
        return (inv_freq / factor).astype(np.float32)
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear, "
                         f"longrope)")
    # Llama 3.1's frequency-dependent scaling (transformers' _compute_llama3_parameters).
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: LongRoPE's ``attention_factor``, else 1."""
    return (scaling or {}).get("attention_factor", 1.0)
