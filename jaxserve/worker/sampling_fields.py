"""The per-sequence sampling fields, declared once: the InputBatch's per-slot arrays, the
sampler's metadata dataclasses (and their pytree registration), the step's packed inputs
(``step_inputs.FIELDS``), the neutral values that pad a step's rows and fill the programs'
placeholder arguments, all derive from FIELDS.

A field belongs to one group:
- SAMPLING: ``SamplingMetadata``, read by every step (it travels in the step's packed inputs).
- FILTER: ``FilterMetadata``, read by the filtered sampler only (``sampler.sample_filtered``).
- SLOT: an InputBatch array that no metadata holds as such; the step's inputs are computed from
  it (``prepare_inputs``).

A field with ``of_request`` is an InputBatch array (one entry per slot, set when a request
enters the batch, gathered for a step's rows); one without it is computed for each step.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.core.scheduler_output import NewRequestData

SAMPLING, FILTER, SLOT = "sampling", "filter", "slot"


@dataclass(frozen=True)
class SamplingField:
    """One per-sequence field.

    Attributes:
      name: the attribute of its metadata dataclass, and of the InputBatch.
      dtype: numpy dtype of its [S] (or [max_num_seqs]) array.
      default: the neutral value (padding rows, free slots, placeholders).
      group: SAMPLING, FILTER or SLOT.
      doc: what it holds, for the dataclass docstrings.
      of_request: the slot's value from a request entering the batch; None: computed per step.
    """

    name: str
    dtype: type
    default: float | int | bool
    group: str
    doc: str
    of_request: Callable[[NewRequestData], float | int | bool] | None = None


def _param(name: str) -> Callable[[NewRequestData], float | int]:
    return lambda r: getattr(r.sampling_params, name)


FIELDS = (
    SamplingField("temperature", np.float32, 0, SAMPLING, "0 means greedy.",
                  _param("temperature")),
    SamplingField("top_k", np.int32, 0, SAMPLING, "0 disables.", _param("top_k")),
    SamplingField("top_p", np.float32, 1, SAMPLING, "in (0, 1].", _param("top_p")),
    SamplingField("seeds", np.uint32, 0, SAMPLING, "per-request seed.", lambda r: r.seed),
    SamplingField("steps", np.int32, 0, SAMPLING,
                  "tokens the request has generated so far; folded into its seed so a "
                  "request's draws do not depend on what else is in the batch."),
    SamplingField("rows", bool, False, FILTER,
                  "the rows ``sample_filtered`` draws again (the others keep their token)."),
    SamplingField("slots", np.int32, 0, FILTER, "each row's row of the SamplingState."),
    SamplingField("min_p", np.float32, 0, FILTER, "in [0, 1]; 0 disables.", _param("min_p")),
    SamplingField("presence_penalty", np.float32, 0, FILTER, "0 disables.",
                  _param("presence_penalty")),
    SamplingField("frequency_penalty", np.float32, 0, FILTER, "0 disables.",
                  _param("frequency_penalty")),
    SamplingField("repetition_penalty", np.float32, 1, FILTER, "> 0; 1 disables.",
                  _param("repetition_penalty")),
    SamplingField("logit_bias", bool, False, FILTER, "add the slot's logit-bias table.",
                  lambda r: r.sampling_params.logit_bias is not None),
    SamplingField("suppress_stop", bool, False, FILTER,
                  "the slot's stop token ids (EOS included) at -inf (min_tokens not reached "
                  "yet)."),
    SamplingField("count", bool, False, FILTER,
                  "add the drawn token to the slot's output counts (a penalized row whose "
                  "token is its next output)."),
    SamplingField("logprobs", bool, False, FILTER, "rows whose log-probabilities are wanted."),
    SamplingField("structured", bool, False, FILTER,
                  "rows constrained by their row of the step's grammar bitmask."),
    SamplingField("draft_ids", np.int32, -1, FILTER,
                  "the draft token the row verifies (speculative decoding), -1: none."),
    SamplingField("seq_start", np.int32, 0, FILTER,
                  "the first logits row of the row's sequence (a sequence with drafts has one "
                  "row per draft, then the bonus row)."),
    SamplingField("draft_prob_rows", np.int32, -1, FILTER,
                  "the row of ``draft_probs`` holding the q of the draft the row verifies (a "
                  "draft model's sampled draft; -1: none, or a point mass)."),
    SamplingField("min_tokens", np.int32, 0, SLOT, "output tokens before a stop is allowed.",
                  _param("min_tokens")),
    SamplingField("penalized", bool, False, SLOT,
                  "some penalty applies (the sampler counts its tokens).",
                  _param("penalized")),
    SamplingField("num_logprobs", np.int32, -1, SLOT,
                  "top log-probabilities wanted per sampled token, -1 for none.",
                  lambda r: -1 if r.sampling_params.logprobs is None
                  else r.sampling_params.logprobs),
    SamplingField("num_prompt_logprobs", np.int32, -1, SLOT,
                  "top log-probabilities wanted per prompt token, -1 for none.",
                  lambda r: -1 if r.sampling_params.prompt_logprobs is None
                  else r.sampling_params.prompt_logprobs),
)

PER_SLOT = tuple(f for f in FIELDS if f.of_request is not None)


def fields_of(group: str) -> tuple[SamplingField, ...]:
    return tuple(f for f in FIELDS if f.group == group)


def _metadata_class(name: str, group: str, doc: str) -> type:
    """A frozen dataclass of the group's fields (FIELDS order), each a jax.Array, registered
    as a pytree whose leaves are all of them."""
    fields = fields_of(group)
    attributes = "\n".join(f"  {f.name}: [S] {np.dtype(f.dtype).name}; {f.doc}" for f in fields)
    cls = dataclasses.make_dataclass(name, [(f.name, jax.Array) for f in fields], frozen=True)
    cls.__doc__ = f"{doc}\n\nAttributes:\n{attributes}\n"
    cls.__module__ = __name__
    jax.tree_util.register_dataclass(cls, data_fields=[f.name for f in fields], meta_fields=[])
    return cls


SamplingMetadata = _metadata_class(
    "SamplingMetadata", SAMPLING, "Per-sequence sampling settings of one step, padded to the "
    "step's S.")
FilterMetadata = _metadata_class(
    "FilterMetadata", FILTER, "Per-sequence settings of ``sample_filtered``, padded to the "
    "step's S (built only in steps that dispatch it).")


def neutral(cls: type, s: int, **values: np.ndarray):
    """An instance of a metadata class for s rows: ``values`` where given, every other field
    at its default (numpy arrays of the field's dtype)."""
    by_name = {f.name: f for f in FIELDS}
    return cls(**{f.name: values[f.name] if f.name in values
                  else np.full(s, by_name[f.name].default, by_name[f.name].dtype)
                  for f in dataclasses.fields(cls)})
