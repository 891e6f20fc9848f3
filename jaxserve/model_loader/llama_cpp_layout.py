"""llama.cpp's Q/K row permutation for llama-arch GGUF files, and its inverse.

HF Llama applies RoPE in the "rotate_half" layout: within each head, feature ``j`` pairs with
feature ``j + head_dim/2``. llama.cpp's llama-arch RoPE (GPT-J style) pairs adjacent features
``2j, 2j+1``. So ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders the output rows of
``q_proj``/``k_proj`` per head: it views the ``[n_head * head_dim, ...]`` rows as
``[n_head, 2, head_dim/2, ...]`` and swaps the middle two axes, interleaving the two halves
(row ``h*D + 2j + s`` of the GGUF tensor = HF row ``h*D + s*D/2 + j``). For K the head count is
the KV head count. Loading undoes it: view as ``[n_head, head_dim/2, 2, ...]`` and swap back.
Qwen2/Qwen3 GGUFs use NEOX RoPE in llama.cpp (same layout as HF) and are not permuted.
"""

from __future__ import annotations

import numpy as np


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF layout -> llama.cpp layout. ``w``: ``[n_head * head_dim]`` or ``[n_head * head_dim, in]``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp layout -> HF layout; the inverse of :func:`permute_qk` (same shapes)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
