"""Attention ops over the paged KV pool: Pallas kernels and their pure-JAX oracles; and the MoE
experts' grouped GEMM (``grouped_matmul.grouped_matmul``, ``jax.lax.ragged_dot``'s semantics).

* ``attention`` — the model's one entry point for a mixed ragged batch (Pallas, Triton backend).
* ``paged_attention`` — decode only, one query token per sequence (Pallas, flash-decoding).
* ``reference`` — pure-JAX oracles with the same signatures (the model's CPU path).
* ``get_attention_fn(backend, interpret)`` — picks one for ``--attention-backend``
  pallas|reference (``jaxserve.platforms`` resolves auto, and says where Pallas is interpreted).
* ``reads_stacked_pools(attention_fn)`` — whether it reads a pool stacked by layer
  (``pool_layer``: the CPU's layer loop).
* ``pool_head_dim(attention_fn, head_dim)`` — the head width of the pool it reads (the Pallas
  kernels': a power of two).
* ``get_kv_write_fn(attention_fn, num_tokens)`` — the KV write that goes with it (``kv_write``:
  a Pallas kernel for the Pallas kernels' pools at prefill sizes).
"""

import functools
from collections.abc import Callable

from pallas_kernels import kv_write, reference
from pallas_kernels.flash_attention import PrefillTuning, attention
from pallas_kernels.paged_attention import DecodeTuning, paged_attention

ATTENTION_BACKENDS = ("pallas", "reference")

__all__ = [
    "ATTENTION_BACKENDS",
    "DecodeTuning",
    "PrefillTuning",
    "attention",
    "get_attention_fn",
    "get_kv_write_fn",
    "paged_attention",
    "pool_head_dim",
    "reads_stacked_pools",
    "reference",
]


def get_attention_fn(backend: str, interpret: bool = False) -> Callable:
    """The ``attention(q, k_pages, v_pages, query_start_loc, seq_lens, block_tables, *,
    sm_scale=None, sliding_window=None, logits_soft_cap=None)`` to use:
    the Pallas kernels ("pallas"; with ``interpret``, in interpret mode: slow, for tests off a
    GPU) or the pure-JAX reference ("reference").

    Raises:
      ValueError: for a backend name other than pallas, reference.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r} ({', '.join(ATTENTION_BACKENDS)})")
    if backend == "reference":
        return reference.attention
    if interpret:
        return functools.partial(attention, interpret=True)
    return attention


def reads_stacked_pools(attention_fn: Callable) -> bool:
    """Whether ``attention_fn`` reads a layer of a pool stacked by layer
    (``pool_layer.PoolLayer``): the reference does; the Pallas kernels take one layer's pool."""
    return attention_fn is reference.attention


def pool_head_dim(attention_fn: Callable, head_dim: int) -> int:
    """The head width (features) of the KV pool ``attention_fn`` reads for heads of
    ``head_dim``: the reference reads any; the Pallas kernels' loads need power-of-two sizes
    (Triton), so a head of 96 (Phi-3-mini) is stored in 128 columns, the rest zeros, and the
    model pads its queries and new keys and values to match (``llama._write_and_attend``):
    zero features add nothing to a score or an output."""
    if attention_fn is reference.attention:
        return head_dim
    return 1 << (head_dim - 1).bit_length()


def get_kv_write_fn(attention_fn: Callable, num_tokens: int) -> Callable | None:
    """The KV write for a step of ``num_tokens`` tokens into the pools ``attention_fn`` reads:
    for the Pallas ``attention`` (``attention_fn`` it, or it with arguments bound by
    ``functools.partial``) past ``kv_write.SCATTER_MAX_TOKENS`` tokens, the Pallas kernel
    (``kv_write.write_kv``, interpreted where ``attention_fn`` is); else None: the model writes
    with XLA's scatter (``llama.write_kv``, which also writes a pool stacked by layer)."""
    fn, keywords = attention_fn, {}
    while isinstance(fn, functools.partial):
        keywords = {**fn.keywords, **keywords}
        fn = fn.func
    if fn is not attention or num_tokens <= kv_write.SCATTER_MAX_TOKENS:
        return None
    return functools.partial(kv_write.write_kv, interpret=keywords.get("interpret", False))
