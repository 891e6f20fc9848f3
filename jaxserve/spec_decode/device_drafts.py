"""The n-gram method's drafts, made inside the step that verifies them (docs/spec_decode.md).

The host schedules k_i draft slots for a speculating sequence i without knowing their tokens,
and, under async scheduling, before it knows what the sequence's step in flight emitted. Its
bookkeeping is optimistic: it counts every draft of the step in flight as accepted (the most
that step can emit), so the positions it sends may run ahead of the true ones, and the pages it
allocates cover them. The step settles the difference first:

1. The previous step's outcome: for each input token the host does not know (``prev_rows``:
   the previous step's last logits row of its sequence, which verified ``prev_drafts`` drafts),
   the rows its sequence emitted (``rejection_sampler.emitted_rows``' rule: the drafts up to the
   first miss, then that row's token), the token it feeds (the last emitted) and the drafts
   rejected there.
2. Each such sequence's positions, slot mapping, context length and its rows' output indices
   (``steps``, the sampling keys) move back by its rejected drafts.
3. The token history (``history`` [max_num_seqs, max_model_len] int32, one row a slot, on the
   device) takes the step's input tokens at their positions; ``propose_on_device`` looks the
   drafts up in it, for the sequences ``spec_seqs`` (their newest token is their first input);
   the draft slots (``draft_at``) take them, and slots past a sequence's match take FILLER,
   verified against the vocabulary size (no token), so they are never accepted.

Returned with the step's tokens: each logits row's draft (the token its row verifies; -1:
none; V: a filler), for the next step's settling, the host's reading of the step and the
filtered sampler.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.spec_decode.ngram_proposer import propose_on_device

FILLER = 0  # the input token of a draft slot without a draft (its row's token is discarded)


@dataclasses.dataclass(frozen=True)
class NgramDrafting:
    """The step's static settings for the n-gram method.

    Attributes:
      k: the most drafts a sequence verifies (``num_speculative_tokens``).
      min_n, max_n: ``prompt_lookup_min`` / ``prompt_lookup_max``.
      page_size: tokens per KV page (the slot mapping of moved positions).
      vocab_size: V, the verified id of a filler slot.
    """

    k: int
    min_n: int
    max_n: int
    page_size: int
    vocab_size: int


def settle_and_draft(cfg: NgramDrafting, x: dict, prev_sampled: jax.Array,
                     prev_drafts: jax.Array, history: jax.Array, block_table: jax.Array):
    """Steps 1-3 of the module docstring.

    Args:
      cfg: the settings.
      x: the step's unpacked inputs (``StepLayout.unpack``: T tokens, S sequences, L rows).
      prev_sampled, prev_drafts: [M] int32, the previous step's tokens and its rows' drafts.
      history: [N, max_model_len] int32, the token history (donated by the step).
      block_table: [N, P] int32, with this step's writes applied.

    Returns:
      (x with ``positions``, ``slot_mapping``, ``seq_lens`` and ``steps`` settled, token_ids
      [T] int32, row_drafts [L] int32, history).
    """
    k, ps = cfg.k, cfg.page_size
    prev_rows, kp = x["prev_rows"], x["prev_drafts"]
    n_prev = prev_sampled.shape[0]
    j = jnp.arange(k)[None, :]
    at = jnp.clip((prev_rows - kp)[:, None] + j, 0, n_prev - 1)
    hits = (prev_sampled[at] == prev_drafts[at]) & (j < kp[:, None])
    accepted = jnp.cumprod(hits.astype(jnp.int32), axis=1).sum(axis=1)
    known = prev_rows < 0
    fed = prev_sampled[jnp.clip(prev_rows - kp + accepted, 0, n_prev - 1)]
    tokens = jnp.where(known, x["token_ids"], fed)
    rejected = jnp.where(known, 0, kp - accepted)

    qsl = x["query_start_loc"]
    n_tok, n_seqs, n_slots = qsl[-1], x["seq_lens"].shape[0], history.shape[0]
    t = jnp.arange(tokens.shape[0])
    real = t < n_tok
    # each token's sequence: the sequence ends at or before it (no search: no loop on the GPU)
    ends = jnp.zeros(tokens.shape[0] + 1, jnp.int32).at[qsl[1:]].add(1)
    seq = jnp.minimum(jnp.cumsum(ends)[:-1], n_seqs - 1)
    back = jnp.zeros(n_seqs, jnp.int32).at[seq].add(jnp.where(real, rejected, 0))
    moved = jnp.where(real, back[seq], 0)
    positions = x["positions"] - moved
    slots = x["seq_slots"][seq]
    slot_mapping = jnp.where(
        moved > 0, block_table[slots, positions // ps] * ps + positions % ps, x["slot_mapping"])
    seq_lens = jnp.where(x["seq_lens"] > 0, x["seq_lens"] - back, 0)
    steps = x["steps"] - back[seq[x["logits_indices"]]]

    draft_at = x["draft_at"]
    is_draft = draft_at >= 0
    history = history.at[jnp.where(real & ~is_draft, slots, n_slots), positions].set(
        tokens, mode="drop")
    spec = x["spec_seqs"]
    used = spec >= 0
    spec = jnp.clip(spec, 0, n_seqs - 1)
    lengths = jnp.where(used, positions[jnp.clip(qsl[spec], 0, tokens.shape[0] - 1)] + 1, 0)
    drafts, counts = propose_on_device(history[x["seq_slots"][spec]], lengths, k, cfg.min_n,
                                       cfg.max_n)
    r, i = jnp.maximum(draft_at, 0) // k, jnp.maximum(draft_at, 0) % k
    proposed = is_draft & (i < counts[r])
    tokens = jnp.where(is_draft, jnp.where(proposed, drafts[r, i], FILLER), tokens)
    history = history.at[jnp.where(real & is_draft, slots, n_slots), positions].set(
        tokens, mode="drop")

    after = x["logits_indices"] + 1  # the token a row verifies, when it is a draft
    a = jnp.clip(after, 0, tokens.shape[0] - 1)
    row_drafts = jnp.where((after < n_tok) & is_draft[a],
                           jnp.where(proposed[a], tokens[a], cfg.vocab_size), -1)
    x = dict(x, positions=positions, slot_mapping=slot_mapping, seq_lens=seq_lens, steps=steps)
    return x, tokens, row_drafts.astype(jnp.int32), history
