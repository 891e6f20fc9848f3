"""Token sampling from a step's logits: greedy, temperature, top-k, top-p, per-request seeds.

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

Two functions split the work so that the model step holds no control flow on the GPU: there an
XLA conditional copies its predicate to the host and blocks the dispatching thread until the
device reaches it, which stalled async scheduling (docs/performance.md). ``sample_unfiltered``
(greedy and plain; branch-free on the GPU, while on the CPU, where a conditional is cheap, it
skips the noise when every row is greedy) runs inside every step; ``sample_filtered`` (candidates and
sort, each under a ``lax.cond`` so that it runs only when some row takes it) is a separate
executable that the runner dispatches only in steps where ``filtered_rows`` marks a row.
``sample`` is the two in a row.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp

# Covers the top_k values clients use in practice (20, 40, 50, 100). On CPU lax.top_k(256) is a
# partial sort (about 0.3 ms a 128,256-token row against 40 ms for the sort). On GPU, XLA has a
# top-k kernel for k <= 16 only and lowers larger k to a sort of (value, index) pairs, about as
# slow as the full sort (H200, 256 rows: 2.6 ms against 2.4): there this path saves only the
# full-vocabulary softmax, cumulative sum and noise of the sort path.
K_MAX = 256


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-sequence sampling settings of one step, padded to the step's S.

    Attributes:
      temperature: [S] float32; 0 means greedy.
      top_k: [S] int32; 0 disables.
      top_p: [S] float32 in (0, 1].
      seeds: [S] uint32 per-request seed.
      steps: [S] int32 tokens the request has generated so far; folded into its seed so a
        request's draws do not depend on what else is in the batch.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seeds: jax.Array
    steps: jax.Array


jax.tree_util.register_dataclass(
    SamplingMetadata, data_fields=["temperature", "top_k", "top_p", "seeds", "steps"], meta_fields=[]
)


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
    vocab = scaled.shape[-1]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    kth = jnp.take_along_axis(sorted_logits, (jnp.where(k > 0, k, vocab) - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(jnp.where(sorted_logits >= kth, sorted_logits, -jnp.inf), axis=-1)
    num_keep = jnp.maximum(jnp.sum(_top_p_keep(probs, top_p), axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_logits, (num_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(threshold, kth)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    return jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)


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


def sample_filtered(logits: jax.Array, tokens: jax.Array, sm: SamplingMetadata) -> jax.Array:
    """``tokens`` ([S] int32, from ``sample_unfiltered``) with the top-k and top-p rows'
    tokens drawn: [S, V] float32 logits -> [S] int32."""
    vocab = logits.shape[-1]
    scaled, keys = _scaled_and_keys(logits, sm)
    k = jnp.where((sm.top_k > 0) & (sm.top_k < vocab), sm.top_k, 0)
    filtered = filtered_rows(sm, vocab)
    candidates = filtered & (k > 0) & (k <= K_MAX)
    sort = filtered & ~candidates
    zeros = jnp.zeros(logits.shape[:1], jnp.int32)

    def run_if(rows, fn):
        return jax.lax.cond(jnp.any(rows), fn, lambda: zeros)

    tokens = jnp.where(
        candidates,
        run_if(candidates, lambda: _sample_top_k(scaled, k, sm.top_p, keys, min(K_MAX, vocab))),
        tokens,
    )
    return jnp.where(
        sort, run_if(sort, lambda: _sample_sorted_rows(scaled, k, sm.top_p, keys, sort)), tokens
    )


def sample(logits: jax.Array, sm: SamplingMetadata) -> jax.Array:
    """Pick one token per row (``sample_unfiltered`` then ``sample_filtered``).

    Args:
      logits: [S, V] float32.
      sm: the rows' sampling settings.

    Returns:
      [S] int32 token ids. Greedy rows take the argmax. A row's token depends only on its own
      logits, settings, seed and step.
    """
    return sample_filtered(logits, sample_unfiltered(logits, sm, branch_free=False), sm)
