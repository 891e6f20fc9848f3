"""The draft_model method (vLLM V1's ``v1/spec_decode/draft_model.py``): a smaller model with the
target's vocabulary drafts k tokens per sequence, greedily, on the device.

The draft model has its own params and its own KV pool, of the target pool's page count and
page size, indexed by the same block table: a page id holds the target's K/V in the target pool
and the draft's K/V of the same tokens in the draft pool. Two programs keep it:

- ``draft_step`` (one per token bucket) runs the draft model over exactly the tokens of the
  target's step (prompt chunks, decodes and verified drafts alike), from the same packed inputs,
  so the draft pool covers every position the target pool covers: prefix-cache hits, preemption
  and rollback need nothing of their own (rejected positions are written again later).
- ``propose`` runs after a step whose drafts the scheduler asked for: from each sequence's last
  emitted token (not in either pool yet), k single-token steps, each writing its token's K/V and
  drawing the next draft with the sampler's ``sample_draft`` (greedy rows: the argmax; others:
  from q, the draft's distribution under the request's temperature, top-k and top-p), whose q
  the runner keeps for the verifying step. Its K/V past the emitted token go to the lookahead pages
  the scheduler allocated; the next step's ``draft_step`` writes them again with the same tokens.
  The k steps are ``draft_chain``, which EAGLE heads (``eagle.py``) run too.

The verifying step's rows draw from ``rejection_sampler.verify_distribution`` of the target's
p and that q (greedy rows: accept while the argmax equals the draft), which keeps the target's
distribution exactly (Leviathan et al. 2023; Chen et al. 2023).
"""

import dataclasses
from dataclasses import dataclass

import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.worker.sampler import sample_draft
from jaxserve.worker.sampling_fields import SamplingMetadata


@dataclass
class DraftModel:
    """The draft model of ``--speculative-config``'s "model".

    Attributes:
      config: its shapes; ``vocab_size`` equals the target's.
      params: its params on the device (``jaxserve.models.llama``).
    """

    config: ModelConfig
    params: dict


def check_vocabulary(draft: ModelConfig, target: ModelConfig) -> None:
    """Raises ValueError, naming the field, when the draft model's vocabulary is not the
    target's (its drafts would be other tokens)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"model: the draft model's vocabulary has {draft.vocab_size} tokens, "
                         f"the target's {target.vocab_size}; they must share the tokenizer")


def draft_step(config: ModelConfig, attention_fn, grouped_gemm, metadata, params, token_ids,
               k_cache, v_cache):
    """The draft model over a step's tokens: writes their K/V into the draft pool.

    Args:
      config, params: the draft model.
      attention_fn, grouped_gemm: its kernels (``llama.forward``).
      metadata: the step's ``llama.AttentionMetadata`` (the target's, same block table).
      token_ids: [T] int32, the step's tokens.
      k_cache, v_cache: the draft pool (donate it).

    Returns:
      (k_cache, v_cache) updated; the logits are not computed (XLA drops them).
    """
    _, k_cache, v_cache = llama.forward(config, params, token_ids, metadata, k_cache, v_cache,
                                        jnp.zeros(1, jnp.int32), attention_fn=attention_fn,
                                        grouped_gemm=grouped_gemm)
    return k_cache, v_cache


def propose(config: ModelConfig, attention_fn, grouped_gemm, num_drafts: int, page_size: int,
            params, k_cache, v_cache, block_table, token_ids, positions, slots, num_seqs,
            sm: SamplingMetadata):
    """num_drafts drafts after each sequence's last emitted token (``draft_chain`` from it, at
    its position).

    Args:
      config, params: the draft model.
      attention_fn, grouped_gemm: its kernels (``llama.forward``).
      num_drafts, page_size, k_cache, v_cache, block_table, slots, num_seqs, sm: as
        ``draft_chain``.
      token_ids: [B] int32 each sequence's last emitted token; rows from num_seqs on pad.
      positions: [B] int32 its position (its pages cover positions + num_drafts - 1).

    Returns:
      (drafts [B, num_drafts] int32, q [B * num_drafts, V] float32, k_cache, v_cache), as
      ``draft_chain``.
    """
    rows = jnp.arange(token_ids.shape[0], dtype=jnp.int32)

    def step(tokens, md, k_cache, v_cache, carry):
        return (*llama.forward(config, params, tokens, md, k_cache, v_cache, rows,
                               attention_fn=attention_fn, grouped_gemm=grouped_gemm), carry)

    drafts, q, k_cache, v_cache, _ = draft_chain(
        step, num_drafts, page_size, k_cache, v_cache, block_table, token_ids, positions,
        slots, num_seqs, sm, None)
    return drafts, q, k_cache, v_cache


def draft_chain(step, num_drafts: int, page_size: int, k_cache, v_cache, block_table,
                token_ids, positions, slots, num_seqs, sm: SamplingMetadata, carry):
    """num_drafts single-token steps of a drafter (the draft model, an EAGLE head) per
    sequence, each at the next position, writing its K/V there and drawing the next draft
    with the sampler's ``sample_draft``.

    Args:
      step: ``(token_ids [B], md, k_cache, v_cache, carry) -> (logits [B, V] float32 over the
        target's vocabulary, k_cache, v_cache, carry)``, one step of the drafter.
      num_drafts: k (static).
      page_size: tokens per page (static).
      k_cache, v_cache: the drafter's pool (donate it).
      block_table: [max_num_seqs, P] int32, the device block table.
      token_ids: [B] int32 the first step's input token; rows from num_seqs on pad.
      positions: [B] int32 the first step's position (the pages cover positions +
        num_drafts - 1).
      slots: [B] int32 the sequences' InputBatch slots.
      num_seqs: int32 scalar, the rows in use.
      sm: [B] the sequences' sampling settings, ``steps`` the output index of their first
        draft.
      carry: what ``step`` passes on from one step to the next (EAGLE: the hidden state).

    Returns:
      (drafts [B, num_drafts] int32, q [B * num_drafts, V] float32: row b * num_drafts + j the
      distribution draft j of sequence b was drawn from, k_cache, v_cache, carry).
    """
    b = token_ids.shape[0]
    live = jnp.arange(b) < num_seqs
    tables = block_table[slots]
    # padding rows own no query token (the step's layout): they attend to and write nothing
    qsl = jnp.minimum(jnp.arange(b + 1, dtype=jnp.int32), num_seqs)
    drafts, probs = [], []
    for j in range(num_drafts):
        pos = jnp.where(live, positions + j, 0)
        page = jnp.take_along_axis(tables, (pos // page_size)[:, None], axis=1)[:, 0]
        md = llama.AttentionMetadata(pos, jnp.where(live, page * page_size + pos % page_size, 0),
                                     qsl, jnp.where(live, pos + 1, 0), tables)
        logits, k_cache, v_cache, carry = step(token_ids, md, k_cache, v_cache, carry)
        token_ids, q = sample_draft(logits, dataclasses.replace(sm, steps=sm.steps + j))
        drafts.append(token_ids)
        probs.append(q)
    return (jnp.stack(drafts, axis=1), jnp.stack(probs, axis=1).reshape(b * num_drafts, -1),
            k_cache, v_cache, carry)
