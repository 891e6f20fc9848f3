"""Attention ops over the paged KV pool: Pallas kernels and their pure-JAX oracles."""

from collections.abc import Callable

import jax

from pallas_kernels import reference

ATTENTION_BACKENDS = ("auto", "pallas", "reference")


def get_attention_fn(backend: str = "auto") -> Callable:
    """The ``attention(q, k_pages, v_pages, query_start_loc, seq_lens, block_tables)`` to use.

    "auto" is Pallas on GPU and the pure-JAX reference on CPU.

    Raises:
      ValueError: for a backend name other than auto, pallas, reference.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r} ({', '.join(ATTENTION_BACKENDS)})")
    if backend == "auto":
        backend = "pallas" if jax.default_backend() == "gpu" else "reference"
    if backend == "reference":
        return reference.attention
    from pallas_kernels.flash_attention import attention

    return attention
