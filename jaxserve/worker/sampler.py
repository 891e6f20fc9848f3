"""Token sampling from a step's logits: greedy, temperature, top-k, top-p, min-p, penalties,
logit bias, min_tokens, per-request seeds, and log-probabilities (vLLM V1's sampler, on JAX).

Each row takes one of four paths, chosen from its own settings alone, so its token never depends
on what else is in the batch:
- greedy (temperature 0): argmax.
- plain (no top-k, top_p 1): Gumbel-max over the whole vocabulary (``jax.random.categorical``
  on logits / temperature), no sort.
- candidates (1 <= top_k <= K_MAX, with or without top-p): ``lax.top_k(K_MAX)`` gives the
  candidates already sorted, top-k and top-p are cut on them, and Gumbel-max picks among those
  kept.
- sort (top_k > K_MAX, or top-p without top-k): the full-vocabulary sort, of those rows alone
  when they are at most an eighth of the batch.

A constrained row (structured outputs) first has every token its grammar does not allow set to
-inf, from a bitmask the host fills (one bit per token, docs/structured_outputs.md); as in
vLLM V1, which masks the logits before its sampler, everything after that, log-probabilities
included, sees the masked logits.

Before a row is drawn, the logits processors of vLLM V1 run in its order: min_tokens (EOS and stop
token ids at -inf until enough tokens, unless the grammar's mask left nothing else), logit bias,
then the repetition, frequency and presence penalties (vLLM's definitions: repetition over prompt
and output tokens, the other two over output tokens); greedy takes the argmax of the result;
temperature, then min-p, then top-k / top-p apply to sampled rows. Log-probabilities are the log-
softmax of the raw logits (before all of that but the grammar's mask), vLLM V1's default; the
sampled token's rank counts the tokens more likely than it, plus one.

Penalties need each request's token counts: ``SamplingState`` keeps them on the device, one row
per InputBatch slot (output token counts, the prompt's tokens as a mask, and fixed-width tables
of the request's logit biases and stop token ids). ``write_state_row`` fills a row when a
request that needs it enters the batch (from its prompt and any tokens generated before a
preemption); ``sample_filtered`` adds each step's drawn token to the counts of the rows that
ask, so the counts are never rebuilt per step.

Two functions split the work so that the model step holds no control flow on the GPU: there an
XLA conditional copies its predicate to the host and blocks the dispatching thread until the
device reaches it, which would stall async scheduling (docs/performance.md). ``sample_unfiltered``
(greedy and plain; branch-free on the GPU, while on the CPU, where a conditional is cheap, it
skips the noise when every row is greedy) runs inside every step; ``sample_filtered`` (every
row that needs more: processors, min-p, candidates and sort, each costly path under a
``lax.cond`` so that it runs only when some row takes it; and the log-probabilities) is a
separate executable that the runner dispatches only in steps that hold such a row.
"""

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.spec_decode.rejection_sampler import emitted_rows, verify_distribution
from jaxserve.worker.sampling_fields import FilterMetadata, SamplingMetadata

# Covers the top_k values clients use in practice (20, 40, 50, 100). On CPU lax.top_k(256) is a
# partial sort (about 0.3 ms a 128,256-token row against 40 ms for the sort). On GPU, XLA has a
# top-k kernel for k <= 16 only and lowers larger k to a sort of (value, index) pairs, about as
# slow as the full sort (H200, 256 rows: 2.6 ms against 2.4): there this path saves only the
# full-vocabulary softmax, cumulative sum and noise of the sort path.
K_MAX = 256


@dataclass(frozen=True)
class SamplingState:
    """Per-slot sampling state that lives on the device across steps (one row per InputBatch
    slot; ``N`` = max_num_seqs, ``V`` = vocabulary).

    Attributes:
      output_counts: [N, V] int32, times each token was generated (penalized requests only).
      prompt_mask: [N, V] bool, tokens of the prompt (for the repetition penalty).
      bias_ids: [N, B] int32 token ids of the request's logit_bias; V pads (dropped).
      bias_values: [N, B] float32 their biases.
      stop_ids: [N, M] int32 the ids min_tokens holds back (EOS unless ignore_eos, and
        stop_token_ids); V pads.
    """

    output_counts: jax.Array
    prompt_mask: jax.Array
    bias_ids: jax.Array
    bias_values: jax.Array
    stop_ids: jax.Array


jax.tree_util.register_dataclass(
    SamplingState, data_fields=[f.name for f in dataclasses.fields(SamplingState)], meta_fields=[])


class Logprobs(NamedTuple):
    """Log-probabilities of R tokens (sampled ones, or prompt tokens) and of the NUM_LOGPROBS
    most likely tokens at their positions.

    Attributes:
      top_ids: [R, NUM_LOGPROBS] int32, most likely first.
      top_logprobs: [R, NUM_LOGPROBS] float32.
      token_logprobs: [R] float32, the token's own.
      token_ranks: [R] int32, 1 + the number of tokens more likely than it.
    """

    top_ids: jax.Array
    top_logprobs: jax.Array
    token_logprobs: jax.Array
    token_ranks: jax.Array


NUM_LOGPROBS = MAX_LOGPROBS  # computed on the device for every row that asks; the host trims


def init_state(num_slots: int, vocab: int, bias_width: int, stop_width: int) -> SamplingState:
    """A zeroed SamplingState on the device: [num_slots, vocab] counts and mask, tables of the
    given widths (MAX_LOGIT_BIAS; MAX_STOP_TOKEN_IDS plus the model's EOS ids)."""
    return SamplingState(
        output_counts=jnp.zeros((num_slots, vocab), jnp.int32),
        prompt_mask=jnp.zeros((num_slots, vocab), bool),
        bias_ids=jnp.full((num_slots, bias_width), vocab, jnp.int32),
        bias_values=jnp.zeros((num_slots, bias_width), jnp.float32),
        stop_ids=jnp.full((num_slots, stop_width), vocab, jnp.int32))


def write_state_row(state: SamplingState, slot, token_ids, num_prompt_tokens, num_tokens,
                    bias_ids, bias_values, stop_ids) -> SamplingState:
    """Fill one slot's row for a request entering the batch (donate ``state``).

    Args:
      state: the SamplingState.
      slot: int32 scalar, the row.
      token_ids: [L] int32 the request's known tokens, prompt first (L = max_model_len; entries
        from ``num_tokens`` on are ignored).
      num_prompt_tokens, num_tokens: int32 scalars.
      bias_ids, bias_values: [B] the request's logit_bias, padded with the vocabulary size.
      stop_ids: [M] its stop token ids, padded likewise.

    Returns:
      The state with that row's counts (tokens from the prompt's end up to num_tokens), prompt
      mask and tables replaced.
    """
    vocab = state.output_counts.shape[1]
    pos = jnp.arange(token_ids.shape[0])
    in_prompt = jnp.where(pos < num_prompt_tokens, token_ids, vocab)
    in_output = jnp.where((pos >= num_prompt_tokens) & (pos < num_tokens), token_ids, vocab)
    counts = jnp.zeros(vocab, jnp.int32).at[in_output].add(1, mode="drop")
    mask = jnp.zeros(vocab, bool).at[in_prompt].set(True, mode="drop")
    return SamplingState(
        output_counts=state.output_counts.at[slot].set(counts),
        prompt_mask=state.prompt_mask.at[slot].set(mask),
        bias_ids=state.bias_ids.at[slot].set(bias_ids),
        bias_values=state.bias_values.at[slot].set(bias_values),
        stop_ids=state.stop_ids.at[slot].set(stop_ids))


def _with_drafts(counts: jax.Array, fm: FilterMetadata, max_drafts: int) -> jax.Array:
    """[S, V] output counts of each row's slot plus the drafts before the row in its sequence
    (``fm.draft_ids`` of rows ``fm.seq_start`` up to it, at most max_drafts): the outputs the
    row's token follows if they are accepted (docs/spec_decode.md)."""
    s, vocab = counts.shape
    row = jnp.arange(s)[:, None]
    prior = row - 1 - jnp.arange(max_drafts)[None, :]  # [S, max_drafts]
    ids = fm.draft_ids[jnp.maximum(prior, 0)]
    ids = jnp.where((prior >= fm.seq_start[:, None]) & (ids >= 0), ids, vocab)
    return counts.at[row, ids].add(1, mode="drop")


def apply_processors(logits: jax.Array, fm: FilterMetadata, state: SamplingState,
                     max_drafts: int = 0) -> jax.Array:
    """vLLM V1's logits processors and penalties, in its order: min_tokens, logit bias, then
    repetition, frequency and presence penalties. [S, V] float32 -> [S, V] float32; rows whose
    settings are neutral come back unchanged. ``max_drafts``: the most drafts a sequence's rows
    carry (speculative decoding; 0: none), counted as outputs of the rows after them."""
    s, vocab = logits.shape
    row = jnp.arange(s)[:, None]
    stop_ids = jnp.where(fm.suppress_stop[:, None], state.stop_ids[fm.slots], vocab)
    held = logits.at[row, stop_ids].set(-jnp.inf, mode="drop")
    # A grammar that allows nothing but stop tokens is complete, and wins over min_tokens: the
    # row keeps them (the scheduler ends the request on one) rather than have no token left.
    logits = jnp.where(jnp.any(held > -jnp.inf, axis=-1, keepdims=True), held, logits)
    bias_ids = jnp.where(fm.logit_bias[:, None], state.bias_ids[fm.slots], vocab)
    logits = logits.at[row, bias_ids].add(state.bias_values[fm.slots], mode="drop")
    counts = state.output_counts[fm.slots]
    if max_drafts:
        counts = _with_drafts(counts, fm, max_drafts)
    seen = state.prompt_mask[fm.slots] | (counts > 0)
    rep = jnp.where(seen, fm.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    return (logits - fm.frequency_penalty[:, None] * counts
            - fm.presence_penalty[:, None] * (counts > 0))


def apply_grammar_bitmask(logits: jax.Array, bitmask: jax.Array, rows: jax.Array) -> jax.Array:
    """-inf at the tokens a row's grammar does not allow.

    Args:
      logits: [S, V] float32.
      bitmask: [S, ceil(V / 32)] int32; bit j of word i allows token 32 i + j (llguidance's
        layout). Bits past V are ignored.
      rows: [S] bool, the constrained rows (the others come back unchanged).
    """
    s, vocab = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    allowed = bits.reshape(s, -1)[:, :vocab] != 0
    return jnp.where(rows[:, None] & ~allowed, -jnp.inf, logits)


def compute_logprobs(logits: jax.Array, token_ids: jax.Array) -> Logprobs:
    """Log-softmax of ``logits`` ([R, V] float32, raw) at ``token_ids`` ([R] int32), with the
    NUM_LOGPROBS most likely tokens of each row and the token's rank."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, min(NUM_LOGPROBS, lp.shape[-1]))
    token_lp = jnp.take_along_axis(lp, token_ids[:, None], axis=-1)
    ranks = jnp.sum(lp > token_lp, axis=-1, dtype=jnp.int32) + 1
    return Logprobs(top_ids.astype(jnp.int32), top_lp, token_lp[:, 0], ranks)


def _top_p_keep(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-p mask over probabilities sorted in descending order.

    Args:
      probs: [S, N] float32, each row sorted in descending order.
      top_p: [S] float32.

    Returns:
      [S, N] bool: the shortest prefix whose mass reaches top_p (all of it where top_p is 1, so
      that rounding in the running sum never drops a tail token).
    """
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    return (top_p[:, None] >= 1) | (mass_before < top_p[:, None])


def _sample_top_k(
    scaled: jax.Array, k: jax.Array, top_p: jax.Array, keys: jax.Array, k_max: int
) -> jax.Array:
    """Top-k (then top-p) sampling among the k_max largest logits.

    Args:
      scaled: [S, V] float32 logits / temperature.
      k: [S] int32 top-k, in [1, k_max] for the rows whose tokens are used.
      top_p: [S] float32.
      keys: [S] per-row PRNG keys.
      k_max: static number of candidates, <= V.

    Returns:
      [S] int32 token ids.
    """
    vals, idx = jax.lax.top_k(scaled, k_max)  # [S, k_max], descending
    in_k = jnp.arange(k_max)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, vals, -jnp.inf), axis=-1)
    keep = in_k & _top_p_keep(probs, top_p)
    # Gumbel-max among the kept candidates; noise by rank, so it needs k_max draws, not V.
    noise = jax.vmap(lambda key: jax.random.gumbel(key, (k_max,)))(keys)
    pick = jnp.argmax(jnp.where(keep, vals + noise, -jnp.inf), axis=-1)
    return jnp.take_along_axis(idx, pick[:, None], axis=-1)[:, 0]


def _sample_sorted(scaled: jax.Array, k: jax.Array, top_p: jax.Array, keys: jax.Array) -> jax.Array:
    """Top-k then top-p over the whole vocabulary, through a full sort of each row.

    Args:
      scaled: [S, V] float32 logits / temperature.
      k: [S] int32 top-k, 0 when off.
      top_p: [S] float32.
      keys: [S] per-row PRNG keys.

    Returns:
      [S] int32 token ids.
    """
    masked = _top_k_top_p_masked(scaled, k, top_p)
    return jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)


def _top_k_top_p_masked(scaled: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """[S, V] ``scaled`` with -inf outside each row's top-k, then top-p, set; k: [S] int32, 0
    when off; top_p: [S] float32. When every row's cut lies among the K_MAX largest logits
    (1 <= k <= K_MAX, or neither top-k nor top-p), the threshold comes from ``lax.top_k``'s
    candidates, as ``_sample_top_k`` draws; else from a full sort of each row (on the CPU
    ~100x the time: a draft model's sampled drafts and their verification run it every step)."""
    vocab = scaled.shape[-1]
    k_max = min(K_MAX, vocab)

    def threshold(ranked: jax.Array) -> jax.Array:
        """[S, 1] the smallest kept logit, from each row's largest logits in descending order
        ([S, N], N >= every k used)."""
        n = ranked.shape[-1]
        kk = jnp.where(k > 0, jnp.minimum(k, n), n)
        kth = jnp.take_along_axis(ranked, (kk - 1)[:, None], axis=-1)
        probs = jax.nn.softmax(jnp.where(ranked >= kth, ranked, -jnp.inf), axis=-1)
        num_keep = jnp.maximum(jnp.sum(_top_p_keep(probs, top_p), axis=-1), 1)
        cut = jnp.take_along_axis(ranked, (num_keep - 1)[:, None], axis=-1)
        return jnp.maximum(cut, kth)

    def from_candidates():
        cut = threshold(jax.lax.top_k(scaled, k_max)[0])
        return jnp.where((k > 0)[:, None], cut, -jnp.inf)  # rows with neither: no cut

    fits = jnp.all(((k >= 1) & (k <= k_max)) | ((k == 0) & (top_p >= 1)))
    cut = jax.lax.cond(fits, from_candidates,
                       lambda: threshold(jnp.sort(scaled, axis=-1)[:, ::-1]))
    return jnp.where(scaled >= cut, scaled, -jnp.inf)


def _sample_sorted_rows(
    scaled: jax.Array, k: jax.Array, top_p: jax.Array, keys: jax.Array, rows: jax.Array
) -> jax.Array:
    """``_sample_sorted`` for the rows marked; when they are at most an eighth of the batch,
    only those rows are sorted (a sort's cost grows with its rows).

    Args:
      scaled, k, top_p, keys: as ``_sample_sorted``, [S, V] and [S].
      rows: [S] bool, the rows whose tokens are used.

    Returns:
      [S] int32 token ids, meaningless outside ``rows``.
    """
    cap = scaled.shape[0] // 8
    if cap == 0:
        return _sample_sorted(scaled, k, top_p, keys)

    def few():
        # Padding entries repeat row 0, so a duplicate index always writes row 0's own token.
        (sel,) = jnp.nonzero(rows, size=cap, fill_value=0)
        tokens = _sample_sorted(scaled[sel], k[sel], top_p[sel], keys[sel])
        return jnp.zeros_like(k).at[sel].set(tokens)

    return jax.lax.cond(jnp.sum(rows) <= cap, few, lambda: _sample_sorted(scaled, k, top_p, keys))


def filtered_rows(sm: SamplingMetadata, vocab: int):
    """[S] bool: rows that sample with top-k or top-p (the ``sample_filtered`` paths). Works on
    numpy arrays (the runner's check) and jax arrays alike. top_k >= vocab keeps everything,
    the same as no top-k."""
    return (sm.temperature > 0) & (((sm.top_k > 0) & (sm.top_k < vocab)) | (sm.top_p < 1))


def _scaled_and_keys(logits: jax.Array, sm: SamplingMetadata):
    """logits / temperature (greedy rows divided by 1) and each row's PRNG key."""
    temp = jnp.where(sm.temperature > 0, sm.temperature, 1.0)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(sm.seeds, sm.steps)
    return logits / temp[:, None], keys


def sample_unfiltered(logits: jax.Array, sm: SamplingMetadata, *,
                      branch_free: bool) -> jax.Array:
    """Greedy and plain rows: [S, V] float32 -> [S] int32. The tokens of ``filtered_rows`` are
    meaningless here (``sample_filtered`` replaces them).

    ``branch_free`` (the GPU): the noise for every row is drawn even when all rows are greedy
    (H200, 256 rows: +0.4 ms a step). Otherwise (the CPU, where a conditional costs nothing
    extra but the noise does: 32 rows of 49,152 took 57 ms against 6 for the argmax on a loaded
    2-core machine) the draw runs only when some row samples."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = sm.temperature > 0

    def with_draws():
        scaled, keys = _scaled_and_keys(logits, sm)
        drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        return jnp.where(sampled, drawn, greedy)

    if branch_free:
        return with_draws()
    return jax.lax.cond(jnp.any(sampled), with_draws, lambda: greedy)


def sample_draft(logits: jax.Array, sm: SamplingMetadata) -> tuple[jax.Array, jax.Array]:
    """A draft model's draw (speculative decoding, ``spec_decode/draft_model.py``): greedy rows
    take the argmax; the others draw from q, the draft's logits under the row's temperature,
    top-k and top-p, with a key of their own (the row's key folded once more, so that the
    target's draws stay independent of it).

    Args:
      logits: [S, V] float32, the draft model's.
      sm: the rows' settings (``steps``: the output index of the token drafted).

    Returns:
      (tokens [S] int32, q [S, V] float32: the distribution of sampled rows' tokens).
    """
    vocab = logits.shape[-1]
    scaled, keys = _scaled_and_keys(logits, sm)
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, 1)
    k = jnp.where((sm.top_k > 0) & (sm.top_k < vocab), sm.top_k, 0)
    masked = jax.lax.cond(jnp.any(filtered_rows(sm, vocab)),
                          lambda: _top_k_top_p_masked(scaled, k, sm.top_p), lambda: scaled)
    drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jnp.where(sm.temperature > 0, drawn, greedy), jax.nn.softmax(masked, axis=-1)


def sample_filtered(logits: jax.Array, tokens: jax.Array, sm: SamplingMetadata,
                    fm: FilterMetadata, state: SamplingState | None = None,
                    bitmask: jax.Array | None = None, max_drafts: int = 0,
                    draft_probs: jax.Array | None = None):
    """``tokens`` ([S] int32, from ``sample_unfiltered``) with ``fm.rows`` drawn again after the
    grammar's mask, the logits processors, min-p, top-k and top-p.

    Args:
      logits: [S, V] float32, the step's raw logits.
      tokens: [S] int32.
      sm, fm: the rows' settings.
      state: the SamplingState (donate it); None when no row has penalties, a logit bias or
        min_tokens (then nothing is read or counted).
      bitmask: [S, ceil(V / 32)] int32, the allowed tokens of the ``fm.structured`` rows
        (``apply_grammar_bitmask``); None when no row is constrained.
      max_drafts: the most draft tokens a sequence's rows verify (speculative decoding: a row
        is drawn with the drafts before it counted, and only emitted rows' tokens are counted,
        ``rejection_sampler.emitted_rows``); 0: none.
      draft_probs: [N, V] float32, the q of drafts a draft model sampled (``sample_draft``);
        a sampled row with ``fm.draft_prob_rows`` >= 0 verifies its draft against that row of
        it: it draws from ``rejection_sampler.verify_distribution`` of its processed
        distribution (min-p, top-k and top-p: ``_top_k_top_p_masked``). None: no such rows.

    Returns:
      (tokens [S] int32, the state with the drawn tokens counted (or None), Logprobs of the
      final tokens (zeros unless some row has ``fm.logprobs``)).
    """
    vocab = logits.shape[-1]
    if bitmask is not None:
        logits = jax.lax.cond(jnp.any(fm.structured),
                              lambda: apply_grammar_bitmask(logits, bitmask, fm.structured),
                              lambda: logits)
    processed = logits if state is None else apply_processors(logits, fm, state, max_drafts)
    scaled, keys = _scaled_and_keys(processed, sm)
    # min-p on the tempered distribution: p < min_p * p_max  <=>  scaled < max + log(min_p).
    floor = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(fm.min_p)[:, None]
    scaled = jnp.where((fm.min_p[:, None] > 0) & (scaled < floor), -jnp.inf, scaled)
    k = jnp.where((sm.top_k > 0) & (sm.top_k < vocab), sm.top_k, 0)
    sampled = fm.rows & (sm.temperature > 0)
    verify = None
    drawn = sampled  # rows drawn from p itself
    if draft_probs is not None:
        verify = sampled & (fm.draft_prob_rows >= 0)
        drawn = sampled & ~verify
    candidates = drawn & (k > 0) & (k <= K_MAX)
    sort = drawn & ~candidates & ((k > 0) | (sm.top_p < 1))
    plain = drawn & ~candidates & ~sort
    zeros = jnp.zeros(logits.shape[:1], jnp.int32)

    def run_if(rows, fn):
        return jax.lax.cond(jnp.any(rows), fn, lambda: zeros)

    tokens = jnp.where(fm.rows & ~sampled, jnp.argmax(processed, axis=-1).astype(jnp.int32),
                       tokens)
    tokens = jnp.where(plain, run_if(plain, lambda: jax.vmap(jax.random.categorical)(
        keys, scaled).astype(jnp.int32)), tokens)
    tokens = jnp.where(
        candidates,
        run_if(candidates, lambda: _sample_top_k(scaled, k, sm.top_p, keys, min(K_MAX, vocab))),
        tokens,
    )
    tokens = jnp.where(
        sort, run_if(sort, lambda: _sample_sorted_rows(scaled, k, sm.top_p, keys, sort)), tokens)
    if verify is not None:
        def with_q():
            p = jax.nn.softmax(_top_k_top_p_masked(scaled, k, sm.top_p), axis=-1)
            r = verify_distribution(p, draft_probs[jnp.maximum(fm.draft_prob_rows, 0)],
                                    jnp.maximum(fm.draft_ids, 0))
            return jax.vmap(jax.random.categorical)(keys, jnp.log(r)).astype(jnp.int32)

        tokens = jnp.where(verify, run_if(verify, with_q), tokens)
    if state is not None:
        count = fm.count & emitted_rows(tokens, fm.draft_ids, fm.seq_start)
        counts = state.output_counts.at[fm.slots, tokens].add(count.astype(jnp.int32))
        state = SamplingState(counts, state.prompt_mask, state.bias_ids, state.bias_values,
                              state.stop_ids)
    k_lp = min(NUM_LOGPROBS, vocab)
    no_logprobs = Logprobs(jnp.zeros((len(tokens), k_lp), jnp.int32),
                           jnp.zeros((len(tokens), k_lp), jnp.float32),
                           jnp.zeros(len(tokens), jnp.float32), jnp.zeros(len(tokens), jnp.int32))
    logprobs = jax.lax.cond(jnp.any(fm.logprobs), lambda: compute_logprobs(logits, tokens),
                            lambda: no_logprobs)
    return tokens, state, logprobs
