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
    for j < n. One comparison of every window end e with every j < J = min(max_n, L) (an
    [R, J, L] array, no loop: the program's operations, and so its compile time, do not grow
    with max_n; its work and, where XLA does not fuse the comparison into its reduction, its
    temporary memory of 4 bytes an entry do) gives each e's run, the first j whose tokens
    differ; a window of n tokens matches where the run, e + 1 (the window inside the row) and
    length - 1 (the suffix not the whole sequence) are all >= n. The windows lie in
    history[:length - 1] (the suffix itself is not a match), the longest n with a match wins
    and, for it, the first window.

    Args:
      history: [R, L] int32, row r's tokens in its first lengths[r] entries (the rest any value).
      lengths: [R] int32, each row's token count (0 for an unused row).
      k: drafts wanted per row (static). min_n, max_n: the suffix lengths tried, in tokens
        (static, any max_n >= min_n >= 1: no suffix is longer than L - 1 tokens).

    Returns:
      drafts [R, k] int32, the up to k tokens after the match (entries past a row's count are
      -1), and counts [R] int32 (0..k; 0 without a match).
    """
    width = history.shape[1]
    span = min(max_n, width)  # J
    j = jnp.arange(span)
    end = jnp.arange(width)[None, :]  # the window's last index e
    last = lengths[:, None] - 1
    suffix = jnp.take_along_axis(history, jnp.clip(last - j[None, :], 0, width - 1), axis=1)
    window = history[:, jnp.clip(end - j[:, None], 0, width - 1)]  # [R, J, L]: history[e - j]
    run = jnp.where(window == suffix[:, :, None], span, j[:, None]).min(axis=1)
    n = jnp.where(end <= last - 1, jnp.minimum(jnp.minimum(run, end + 1), last), 0)
    longest = n.max(axis=1)
    start = jnp.where(longest >= min_n,
                      jnp.argmax(n == longest[:, None], axis=1).astype(jnp.int32) + 1, -1)
    counts = jnp.where(start >= 0, jnp.clip(lengths - start, 0, k), 0).astype(jnp.int32)
    idx = jnp.clip(start[:, None] + jnp.arange(k)[None, :], 0, width - 1)
    drafts = jnp.where(jnp.arange(k)[None, :] < counts[:, None],
                       jnp.take_along_axis(history, idx, axis=1), -1)
    return drafts.astype(jnp.int32), counts
