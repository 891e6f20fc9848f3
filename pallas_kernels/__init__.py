"""Attention ops over the paged KV pool: Pallas kernels and their pure-JAX oracles.

* ``attention`` — the model's one entry point for a mixed ragged batch (Pallas, Triton backend).
* ``paged_attention`` — decode only, one query token per sequence (Pallas, flash-decoding).
* ``reference`` — pure-JAX oracles with the same signatures (the model's CPU path).
* ``get_attention_fn(backend)`` — picks one for ``--attention-backend auto|pallas|reference``.
"""

import functools
from collections.abc import Callable

import jax

from pallas_kernels import reference
from pallas_kernels.flash_attention import PrefillTuning, attention
from pallas_kernels.paged_attention import DecodeTuning, paged_attention

ATTENTION_BACKENDS = ("auto", "pallas", "reference")

__all__ = [
    "ATTENTION_BACKENDS",
    "DecodeTuning",
    "PrefillTuning",
    "attention",
    "get_attention_fn",
    "paged_attention",
    "reference",
]


def get_attention_fn(backend: str = "auto") -> Callable:
    """The ``attention(q, k_pages, v_pages, query_start_loc, seq_lens, block_tables)`` to use.

    "auto" is Pallas on GPU and the pure-JAX reference elsewhere. "pallas" off a GPU runs the
    kernels in interpret mode (slow; for tests).

    Raises:
      ValueError: for a backend name other than auto, pallas, reference.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r} ({', '.join(ATTENTION_BACKENDS)})")
    on_gpu = jax.default_backend() == "gpu"
    if backend == "auto":
        backend = "pallas" if on_gpu else "reference"
    if backend == "reference":
        return reference.attention
    if on_gpu:
        return attention
    return functools.partial(attention, interpret=True)
