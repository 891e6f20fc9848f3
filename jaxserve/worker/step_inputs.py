"""The step's host inputs in one int32 buffer, so that a step makes one host-to-device transfer.

Each numpy argument of a compiled call is a transfer of its own, and on the H200 each costs
host time before the step can start (a staging copy, the copy's launch, and a host callback
that frees the staging buffer: 0.16-0.35 ms for some of the 17 in a ``jax.profiler`` trace of
an idle engine's first step, docs/performance.md). The fields are laid end to end in the order
of FIELDS; float32 and uint32 fields travel as their bits. ``StepLayout`` is static per token
bucket: the step's jit closes over it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.worker.sampling_fields import SAMPLING, fields_of

# (name, length: "t" tokens, "s" sequences, "s+1", "l" logits rows, "r" prompt-logprob rows,
# "w" block table writes, "p" sequences that draft on the device, dtype); the SamplingMetadata
# fields as sampling_fields declares them
FIELDS = (
    *((name, "t", np.int32)
      for name in ("token_ids", "prev_rows", "prev_drafts", "draft_at", "positions",
                   "slot_mapping", "lora_slots")),
    ("query_start_loc", "s+1", np.int32),
    *((name, "s", np.int32) for name in ("seq_lens", "seq_slots")),
    ("logits_indices", "l", np.int32),
    *((f.name, "l", f.dtype) for f in fields_of(SAMPLING)),
    ("hidden_indices", "r", np.int32),
    *((name, "w", np.int32)
      for name in ("block_table_rows", "block_table_cols", "block_table_pages")),
    ("spec_seqs", "p", np.int32),
)


@dataclass(frozen=True)
class StepLayout:
    """Field lengths of one token bucket: tokens T, sequences S, prompt-logprob rows R, block
    table writes W, logits rows L (None: S, one per sequence; more with speculative decoding,
    where a sequence with k drafts takes k + 1), sequences whose drafts the step makes
    (``spec_decode.device_drafts``, the n-gram method; 0 without)."""

    tokens: int
    seqs: int
    rows: int
    writes: int
    logits_rows: int | None = None
    drafting_seqs: int = 0

    @property
    def num_logits_rows(self) -> int:
        return self.seqs if self.logits_rows is None else self.logits_rows

    @functools.cached_property
    def _spans(self) -> list[tuple[str, int, int, np.dtype]]:
        n = {"t": self.tokens, "s": self.seqs, "s+1": self.seqs + 1, "l": self.num_logits_rows,
             "r": self.rows, "w": self.writes, "p": self.drafting_seqs}
        spans, at = [], 0
        for name, length, dtype in FIELDS:
            spans.append((name, at, at + n[length], np.dtype(dtype)))
            at += n[length]
        return spans

    @property
    def size(self) -> int:
        return self._spans[-1][2]

    def pack(self, fields: dict[str, np.ndarray]) -> np.ndarray:
        """[size] int32 of every field of FIELDS (each of its length and dtype).

        Raises:
          ValueError: a field missing, or of the wrong length or dtype.
        """
        out = np.empty(self.size, np.int32)
        for name, a, b, dtype in self._spans:
            value = fields[name]
            if value.shape != (b - a,) or value.dtype != dtype:
                raise ValueError(f"step input {name}: {value.dtype}{list(value.shape)}, "
                                 f"expected {dtype}[{b - a}]")
            out[a:b] = value.view(np.int32)
        return out

    def unpack(self, packed: jax.Array) -> dict[str, jax.Array]:
        """``pack``'s inverse, inside the step: name -> [length] array of its dtype."""
        return {name: packed[a:b] if dtype == np.int32
                else jax.lax.bitcast_convert_type(packed[a:b], jnp.dtype(dtype))
                for name, a, b, dtype in self._spans}
