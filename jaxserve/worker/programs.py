"""The programs a step may dispatch, and ``Programs``: the typed table of them, jitted
(``jit_programs``), as placeholder arguments, or compiled (``compilation.compile_programs``).

The step is one executable per token bucket (and a decode-only one for the small buckets where
the platform builds it), without control flow on the GPU (the model runner's module docstring
says why); the others are dispatched only when a step needs them.
"""

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Generic, TypeVar

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.config import ModelConfig
from jaxserve.models import llama, sharding
from jaxserve.spec_decode import device_drafts, draft_model, eagle
from jaxserve.spec_decode.device_drafts import NgramDrafting
from jaxserve.spec_decode.draft_model import DraftModel
from jaxserve.spec_decode.eagle import EagleHead
from jaxserve.worker.executable_cache import KeyedJit
from jaxserve.worker.sampler import (compute_logprobs, sample_filtered, sample_unfiltered,
                                     write_state_row)
from jaxserve.worker.sampling_fields import SamplingMetadata
from jaxserve.worker.step_inputs import StepLayout
from pallas_kernels import kv_quant
from pallas_kernels.flash_attention import decode_query_tokens

P = TypeVar("P")


@dataclass
class Programs(Generic[P]):
    """One entry per program a step may dispatch: the jitted function, its placeholder
    arguments, or its compiled executable.

    Attributes:
      step: by token bucket T, the model step (``_step``).
      decode_step: by token bucket T, the model step of a step whose every sequence decodes
        one token (its attention ``decode_only``); empty where the platform builds none.
      filter: by logits row count L (the sequence count S, without speculative decoding),
        the filtered sampler (``_filter``).
      state_writer: ``sampler.write_state_row``, a request's sampler-state row.
      page_copy: ``_copy_pages``, forked choices' pages.
      block_table_write: ``_write_block_table``, entries that do not fit in the step's inputs.
      prompt_logprobs: ``_prompt_logprobs``.
      draft_step: by token bucket T, ``_draft_step`` (the draft_model method) or
        ``_eagle_step`` (eagle, eagle3); else empty.
      propose: ``draft_model.propose`` or ``eagle.propose``; else None.
      draft_page_copy: ``_copy_pages`` of the drafter's pool; else None.
      hidden_fixup: ``eagle.write_slot_hidden`` (eagle, eagle3: the h of a sequence whose
        drafts were rejected); else None.
      history_write: ``_write_history``, a slot's token history (the n-gram method); else None.
    """

    step: dict[int, P]
    decode_step: dict[int, P]
    filter: dict[int, P]
    state_writer: P
    page_copy: P
    block_table_write: P
    prompt_logprobs: P
    draft_step: dict[int, P] = field(default_factory=dict)
    propose: P | None = None
    draft_page_copy: P | None = None
    hidden_fixup: P | None = None
    history_write: P | None = None

    def entries(self) -> Iterator[tuple[str, int | None, P]]:
        """(field, T or S or None, entry) of every program: steps, samplers, then the others
        (the draft model's, when there is one)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                yield from ((f.name, n, v) for n, v in value.items())
            elif value is not None:
                yield f.name, None, value

    def get(self, field: str, n: int | None) -> P:
        value = getattr(self, field)
        return value if n is None else value[n]

    @classmethod
    def of_entries(cls, entries) -> "Programs":
        """``entries``' inverse: a table of the (field, n, entry) triples given."""
        tables: dict[str, dict | object] = {"step": {}, "decode_step": {}, "filter": {},
                                            "draft_step": {}}
        for field, n, value in entries:
            if n is None:
                tables[field] = value
            else:
                tables[field][n] = value
        return cls(**tables)


def jit_programs(config: ModelConfig, params: dict, attention_fn: Callable,
                 grouped_gemm: Callable, mesh: Mesh | None, max_rows: int, branch_free: bool,
                 layouts: dict[int, StepLayout], row_counts: list[int], stacked_kv_pool: bool,
                 max_drafts: int = 0, draft: DraftModel | EagleHead | None = None,
                 page_size: int = 0, ngram: NgramDrafting | None = None,
                 decode_buckets: tuple[int, ...] = ()) -> Programs:
    """Every program, jitted: the step of each token bucket of ``layouts`` (its layout is
    static; the pool and the block table are donated; its tokens padded to ``max_rows``, the
    most logits rows of any bucket), the filtered sampler (one for every L of ``row_counts``;
    ``max_drafts``: the most drafts a sequence carries, speculative decoding), and the others.
    On a mesh the params are split by the Megatron layout, the pool (stacked by layer with
    ``stacked_kv_pool``) by KV head, everything else replicated. ``draft``: the draft_model
    method's model or an EAGLE head (one device only), whose programs join the table (the
    step then returns the head's hidden states too); ``page_size``: the pools' (for its
    ``propose``). ``attention_fn`` and ``grouped_gemm`` (the MoE layers' expert GEMMs) are the
    models' kernels (``llama.forward``). ``ngram``: the n-gram method's settings, whose drafts
    the step makes (``device_drafts``; its drafting state is the step's last argument and
    output), None without. ``decode_buckets``: the token buckets that also get a
    ``decode_step``."""
    max_decode_q = decode_query_tokens(max_drafts, config.num_heads // config.num_kv_heads)
    if max_decode_q > 1:  # a sequence's verified drafts go to the decode kernel with its token
        attention_fn = partial(attention_fn, max_decode_q=max_decode_q)
    filter_fn = partial(_filter, max_drafts)
    # the n-gram method's history is donated; its row drafts stay readable by the host
    donate = (3, 4, 5) if ngram is None else (3, 4, 5, 7)
    if mesh is None:
        jit_step = partial(KeyedJit, donate_argnums=donate)
        jit_filter = KeyedJit(filter_fn, donate_argnums=(4,))
    else:
        rep, kv = sharding.replicated(mesh), sharding.kv_sharding(mesh, stacked_kv_pool)
        drafting = () if ngram is None else (rep, rep)
        jit_step = partial(
            KeyedJit, donate_argnums=donate,
            in_shardings=(sharding.param_shardings(params, mesh), rep, rep, kv, kv, rep,
                          *drafting),
            out_shardings=(rep, rep, rep, kv, kv, rep, *drafting[:1]))
        jit_filter = KeyedJit(filter_fn, donate_argnums=(4,), in_shardings=rep,
                             out_shardings=rep)
    drafts, aux_layers = {}, None
    if isinstance(draft, EagleHead):
        aux_layers, static = draft.aux_layers, (draft.method, draft.config, attention_fn)
        drafts = dict(
            draft_step={t: KeyedJit(partial(_eagle_step, *static, page_size, max_rows, layout),
                                    donate_argnums=(3, 4, 7)) for t, layout in layouts.items()},
            propose=KeyedJit(partial(eagle.propose, *static, max_drafts, page_size),
                             donate_argnums=(1, 2)),
            draft_page_copy=KeyedJit(_copy_pages, donate_argnums=(0, 1)),
            hidden_fixup=KeyedJit(eagle.write_slot_hidden, donate_argnums=(0,)))
    elif draft is not None:
        drafts = dict(
            draft_step={t: KeyedJit(partial(_draft_step, draft.config, attention_fn, grouped_gemm,
                                            layout),
                                    donate_argnums=(3, 4)) for t, layout in layouts.items()},
            propose=KeyedJit(partial(draft_model.propose, draft.config, attention_fn,
                                     grouped_gemm, max_drafts, page_size), donate_argnums=(1, 2)),
            draft_page_copy=KeyedJit(_copy_pages, donate_argnums=(0, 1)))
    elif ngram is not None:
        drafts = dict(history_write=KeyedJit(_write_history, donate_argnums=(0,)))
    decode_attention = partial(attention_fn, decode_only=True)
    return Programs(
        step={t: jit_step(partial(_step, config, attention_fn, grouped_gemm, mesh, max_rows,
                                  branch_free, layout, aux_layers, ngram))
              for t, layout in layouts.items()},
        decode_step={t: jit_step(partial(_step, config, decode_attention, grouped_gemm, mesh,
                                         max_rows, branch_free, layouts[t], aux_layers, ngram))
                     for t in decode_buckets},
        filter={n: jit_filter for n in row_counts},
        state_writer=KeyedJit(write_state_row, donate_argnums=(0,)),
        page_copy=KeyedJit(_copy_pages, donate_argnums=(0, 1)),
        block_table_write=KeyedJit(_write_block_table, donate_argnums=(0,)),
        prompt_logprobs=KeyedJit(partial(_prompt_logprobs, config, mesh)), **drafts)


def _step_tokens(x, prev_sampled):
    """[T] the step's input tokens: ``token_ids``, or the previous step's sampled token where
    ``prev_rows`` points at one."""
    prev_rows = x["prev_rows"]
    return jnp.where(prev_rows >= 0, prev_sampled[jnp.maximum(prev_rows, 0)], x["token_ids"])


def _step_metadata(x, block_table) -> llama.AttentionMetadata:
    """The step's attention metadata, its sequences' rows gathered from ``block_table``."""
    return llama.AttentionMetadata(x["positions"], x["slot_mapping"], x["query_start_loc"],
                                   x["seq_lens"], block_table[x["seq_slots"]])


def _step(config, attention_fn, grouped_gemm, mesh, max_rows, branch_free, layout, aux_layers,
          ngram, params, packed, prev_sampled, k_cache, v_cache, block_table, *drafting):
    """One model step of a token bucket, from its host inputs ``packed`` ([layout.size] int32,
    ``StepLayout.pack``: one transfer).

    ``prev_rows`` [T]: for each input token, the row of ``prev_sampled`` (the previous step's
    sampled tokens) that holds it, or -1 to take ``token_ids``. The step writes the block table
    entries changed since the last step (``block_table_rows/cols/pages``, ``_write_block_table``)
    to the device-resident ``block_table`` [max_num_seqs, P] (InputBatch slots), then gathers
    its sequences' rows ``seq_slots`` [S] from it: one dispatch, where a separate write cost an
    idle engine's first token ~1 ms of host time on the H200. Returns the greedy and plain
    rows' tokens padded to [max_rows] (so that the next step's prev_sampled has one shape
    in every bucket), the logits [L, V] (one row per ``logits_indices``) for ``_filter``, the hidden rows [R, E] at
    ``hidden_indices`` for ``_prompt_logprobs``, the updated KV pool and the updated block
    table. ``branch_free``: no control flow (the GPU; see the sampler's module docstring).
    ``mesh``: the tensor-parallel mesh (None: one device). ``aux_layers``: with an EAGLE head
    (``llama.forward``'s), the step returns the head's hidden states [T, nE] last. ``ngram``
    (the n-gram method, ``device_drafts``): ``drafting`` is the previous step's row drafts
    [max_rows] and the token history (donated), the step settles the previous step's drafts and makes its
    own, and returns (its row drafts [max_rows], its rows' settled ``steps`` [L] for
    ``_filter``, the history) after the block table."""
    x = layout.unpack(packed)
    block_table = _write_block_table(block_table, x["block_table_rows"], x["block_table_cols"],
                                     x["block_table_pages"])
    drafted = ()
    if ngram is None:
        token_ids = _step_tokens(x, prev_sampled)
    else:
        x, token_ids, row_drafts, history = device_drafts.settle_and_draft(
            ngram, x, prev_sampled, *drafting, block_table)
        row_drafts = jnp.pad(row_drafts, (0, max_rows - row_drafts.shape[0]),
                             constant_values=-1)
        drafted = ((row_drafts, x["steps"], history),)
    md = _step_metadata(x, block_table)
    sm = SamplingMetadata(**{f.name: x[f.name] for f in dataclasses.fields(SamplingMetadata)})
    logits, k_cache, v_cache, hidden, *aux = llama.forward(
        config, params, token_ids, md, k_cache, v_cache, x["logits_indices"],
        attention_fn=attention_fn, mesh=mesh, hidden_indices=x["hidden_indices"],
        lora_slots=x["lora_slots"], aux_layers=aux_layers, grouped_gemm=grouped_gemm)
    sampled = sample_unfiltered(logits, sm, branch_free=branch_free)
    return (jnp.pad(sampled, (0, max_rows - sampled.shape[0])), logits, hidden, k_cache,
            v_cache, block_table, *drafted, *aux)


def _draft_step(config, attention_fn, grouped_gemm, layout, params, packed, prev_sampled,
                k_cache, v_cache, block_table):
    """``draft_model.draft_step`` over the tokens of the step of ``packed`` (the same inputs
    as ``_step``; ``block_table``: the one that step returned, its writes applied). Returns the
    draft pool."""
    x = layout.unpack(packed)
    return draft_model.draft_step(config, attention_fn, grouped_gemm,
                                  _step_metadata(x, block_table), params,
                                  _step_tokens(x, prev_sampled), k_cache, v_cache)


def _eagle_step(method, config, attention_fn, page_size, max_rows, layout, params, packed,
                prev_sampled, k_cache, v_cache, block_table, hidden, slot_hidden, carry_rows):
    """``eagle.catch_up`` over the tokens of the step of ``packed`` (as ``_draft_step``), with
    that step's head hidden states ``hidden`` [T, nE], then each sequence's newest h into
    ``slot_hidden`` (donated). ``carry_rows`` [3, S] int32: per sequence, whether slot_hidden
    holds the h before its first token, the slot to write (past the table: none) and its
    logits row whose h that is. Returns the head's pool, slot_hidden, and the h of the step's
    logits rows padded to [max_rows, E] (for ``eagle.write_slot_hidden`` once rejected drafts
    are known)."""
    x = layout.unpack(packed)
    md = _step_metadata(x, block_table)
    k_cache, v_cache, h = eagle.catch_up(
        method, config, attention_fn, page_size, params, _step_tokens(x, prev_sampled), md,
        x["seq_slots"], hidden, slot_hidden, carry_rows[0], k_cache, v_cache)
    rows_hidden = h[x["logits_indices"]]
    rows_hidden = jnp.pad(rows_hidden, ((0, max_rows - rows_hidden.shape[0]), (0, 0)))
    slot_hidden = eagle.write_slot_hidden(slot_hidden, rows_hidden, carry_rows[1], carry_rows[2])
    return k_cache, v_cache, slot_hidden, rows_hidden


def _filter(max_drafts, logits, sampled, sm, fm, state, bitmask, draft_probs):
    """The step's tokens ([max_rows]) with the rows of ``fm`` drawn again (a step's L rows
    come first; constrained rows under their row of ``bitmask`` [L, W] int32), the sampler
    state with their emitted tokens counted, and their Logprobs. ``draft_probs``: the q of
    the draft model's drafts (``draft_model.propose``), None without a draft model."""
    s = logits.shape[0]
    tokens, state, logprobs = sample_filtered(logits, sampled[:s], sm, fm, state, bitmask,
                                              max_drafts, draft_probs)
    return sampled.at[:s].set(tokens), state, logprobs


def _prompt_logprobs(config, mesh, params, hidden, targets):
    """Logprobs of ``targets`` [R] from the hidden rows [R, E] that precede them."""
    return compute_logprobs(llama.compute_logits(config, params, hidden, mesh), targets)


def jit_zeroed_pools(shape, dtype, num_layers: int | None, where) -> Callable:
    """The program that makes the zeroed KV pools (``_zeroed_pools``), placed by ``where``."""
    return KeyedJit(partial(_zeroed_pools, shape, dtype, num_layers), out_shardings=where)


def _zeroed_pools(shape, dtype, num_layers: int | None):
    """(K pools, V pools): lists of num_layers zeroed pools of ``shape`` each, or with None one
    each (a pool stacked by layer, ``shape`` [L, ...]) (``kv_quant.pool_zeros``)."""
    if num_layers is None:
        return kv_quant.pool_zeros(shape, dtype), kv_quant.pool_zeros(shape, dtype)
    return ([kv_quant.pool_zeros(shape, dtype) for _ in range(num_layers)],
            [kv_quant.pool_zeros(shape, dtype) for _ in range(num_layers)])


def _write_block_table(block_table, rows, cols, pages):
    """``block_table`` [max_num_seqs, P] with ``pages`` [N] written at (``rows``, ``cols``);
    entries with a row past the table pad (dropped)."""
    return block_table.at[rows, cols].set(pages, mode="drop")


def _write_history(history, slot, token_ids):
    """``history`` [N, max_model_len] int32 with row ``slot`` set to ``token_ids``: the known
    tokens of a request entering the batch (``device_drafts``)."""
    return history.at[slot].set(token_ids)


def _copy_pages(k_cache, v_cache, src, dst):
    """Copy KV pages ``src`` [N] to ``dst`` [N] in every layer (0 -> 0 pads: the null page), of
    per-layer pools or pools stacked by layer (pages on axis 2, all layers at once)."""
    def copy(pool, axis: int):
        at = (slice(None),) * axis
        return jax.tree.map(lambda a: a.at[(*at, dst)].set(a[(*at, src)]), pool)

    if isinstance(k_cache, list):
        return [copy(k, 1) for k in k_cache], [copy(v, 1) for v in v_cache]
    return copy(k_cache, 2), copy(v_cache, 2)
