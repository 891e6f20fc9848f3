"""RejectionSampler's acceptance rule for point-mass drafts (vLLM V1's
``v1/sample/rejection_sampler.py``; Leviathan et al. 2023, Chen et al. 2023).

A verified sequence has k draft tokens d_0..d_{k-1} and k + 1 logits rows: row j scores the token
after d_0..d_{j-1}. Speculative sampling accepts d_j with probability min(1, p_j(d_j) / q_j(d_j))
and, on rejection, draws from norm(max(p_j - q_j, 0)); after k acceptances it draws a bonus token
from p_k. The n-gram method's draft distribution q_j is a point mass at d_j, so acceptance has
probability p_j(d_j) and the residual is p_j with d_j zeroed. Drawing x_j ~ p_j with the plain
sampler and accepting d_j iff x_j == d_j realizes exactly that: P(accept) = p_j(d_j), and a
rejected row emits x_j, which is p_j conditioned on x_j != d_j, the residual. So every row is
sampled by the sampler's own code (temperature, top-k/top-p, min-p, penalties, logit bias,
min_tokens), each row with the key of the output index it would have without speculation, and
the rows whose tokens are emitted are those after an unbroken run of matches: the first
mismatching row's token and, if none mismatches, the bonus row's. Greedy rows take the argmax, so
they accept while the argmax equals the draft.

A draft model's sampled drafts have a real q_j (``verify_distribution``): a row that verifies
one draws from r_j = a_j onehot(d_j) + (1 - a_j) norm(max(p_j - q_j, 0)), a_j = min(1,
p_j(d_j) / q_j(d_j)), by the same rule (accept iff x_j == d_j). The residual is 0 at d_j whenever
a_j < 1, so P(x_j = d_j) = a_j and a rejected row's token follows the residual: speculative
sampling exactly. With q_j a point mass, r_j = p_j, the rule above.
"""

import jax.numpy as jnp


def emitted_rows(tokens, draft_ids, seq_start):
    """Which logits rows' tokens a step emits. Works on numpy and jax arrays alike (the host reads
    the tokens with it; the filtered sampler counts the emitted tokens of penalized rows).

    Args:
      tokens: [R] int32, each row's sampled token x_j.
      draft_ids: [R] int32, the draft token the row verifies (-1: none, the bonus row or a row
        without drafts).
      seq_start: [R] int32, the first row of the row's sequence.

    Returns:
      [R] bool: every earlier row of its sequence that verifies a draft drew it (x_i == d_i),
      so the row's token is emitted (all rows, when none verifies a draft).
    """
    miss = ((draft_ids >= 0) & (tokens != draft_ids)).astype(tokens.dtype)
    before = miss.cumsum() - miss  # mismatches in the rows before this one
    return before == before[seq_start]


def verify_distribution(p, q, draft_ids):
    """The distribution a row verifying a draft drawn from q draws from (module docstring).

    Args:
      p: [R, V] float32, the target's processed distribution of each row.
      q: [R, V] float32, the distribution the row's draft was drawn from.
      draft_ids: [R] int32, the drafts d (each with q(d) > 0).

    Returns:
      [R, V] float32 r = a onehot(d) + (1 - a) norm(max(p - q, 0)), a = min(1, p(d) / q(d));
      where p - q has no positive part (then a = 1), r = onehot(d).
    """
    d = draft_ids[:, None]
    p_d = jnp.take_along_axis(p, d, axis=-1)
    q_d = jnp.take_along_axis(q, d, axis=-1)
    a = jnp.minimum(1.0, p_d / jnp.maximum(q_d, jnp.finfo(q.dtype).tiny))
    residual = jnp.maximum(p - q, 0.0)
    z = residual.sum(axis=-1, keepdims=True)
    residual = jnp.where(z > 0, residual / jnp.where(z > 0, z, 1.0), 0.0)
    onehot = jnp.arange(p.shape[-1])[None, :] == d
    return jnp.where(onehot, a, 0.0) + (1.0 - a) * residual
