"""Drafts by prompt lookup, vLLM V1's n-gram method (``v1/spec_decode/ngram_proposer.py``): find
the longest suffix of the sequence, between prompt_lookup_max and prompt_lookup_min tokens, that
occurs earlier in it (prompt and output alike), and propose the tokens that followed its first
occurrence. In JAX, for the sequences of a step at once, inside the step
(``device_drafts``)."""

import jax
import jax.numpy as jnp


def propose_on_device(history: jax.Array, lengths: jax.Array, k: int, min_n: int,
                      max_n: int) -> tuple[jax.Array, jax.Array]:
    """The n-gram drafts of R sequences (module docstring).

    A window ending at e matches the last n tokens when history[e - j] == history[length - 1 - j]
    for j < n; the matches of every n come from one pass over j (O(max_n) comparisons of the
    history, not O(max_n ** 2)). The windows lie in history[:length - 1] (the suffix itself is
    not a match), the longest n with a match wins and, for it, the first window.

    Args:
      history: [R, L] int32, row r's tokens in its first lengths[r] entries (the rest any value).
      lengths: [R] int32, each row's token count (0 for an unused row).
      k: drafts wanted per row (static). min_n, max_n: the suffix lengths tried (static).

    Returns:
      drafts [R, k] int32, the up to k tokens after the match (entries past a row's count are
      -1), and counts [R] int32 (0..k; 0 without a match).
    """
    rows, width = history.shape
    end = jnp.arange(width)[None, :]  # the window's last index e
    last = lengths[:, None] - 1
    start = jnp.full((rows,), -1, jnp.int32)  # the first draft's index in the row; -1: none
    match = jnp.ones((rows, width), bool)
    for j in range(max_n):
        n = j + 1
        suffix_token = jnp.take_along_axis(history, jnp.clip(last - j, 0, width - 1), axis=1)
        match &= jnp.roll(history, j, axis=1) == suffix_token
        if n >= min_n:  # windows inside history[:length - 1], the suffix not past the start
            hit = match & (end >= j) & (end <= last - 1) & (last - j >= 1)
            found = hit.any(axis=1)
            start = jnp.where(found, jnp.argmax(hit, axis=1).astype(jnp.int32) + 1, start)
    counts = jnp.where(start >= 0, jnp.clip(lengths - start, 0, k), 0).astype(jnp.int32)
    idx = jnp.clip(start[:, None] + jnp.arange(k)[None, :], 0, width - 1)
    drafts = jnp.where(jnp.arange(k)[None, :] < counts[:, None],
                       jnp.take_along_axis(history, idx, axis=1), -1)
    return drafts.astype(jnp.int32), counts
