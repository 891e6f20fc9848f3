"""The sampler on hand-made logits: greedy, top-k, top-p, temperature and per-request seeds.

Each sampling path (plain Gumbel-max, top-k candidates, full sort) is checked against the exact
target distribution with a chi-square test on 20,000 draws.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.worker.sampler import K_MAX, SamplingMetadata, sample

sample = jax.jit(sample)


def meta(n, temperature=1.0, top_k=0, top_p=1.0, seed=0, step=0):
    return SamplingMetadata(
        temperature=jnp.full(n, temperature, jnp.float32), top_k=jnp.full(n, top_k, jnp.int32),
        top_p=jnp.full(n, top_p, jnp.float32), seeds=jnp.arange(n, dtype=jnp.uint32) + seed,
        steps=jnp.full(n, step, jnp.int32),
    )


LOGITS = np.log(np.array([0.05, 0.5, 0.3, 0.1, 0.05], np.float32))
# Eight tokens, most likely not first, so that a wrong index mapping shows.
NARROW = np.log(np.array([0.1, 0.04, 0.3, 0.06, 0.15, 0.2, 0.03, 0.12], np.float32))
_rng = np.random.default_rng(1)
# Wider than K_MAX: at temperature 0.7 the top-0.8 nucleus of FLAT holds more than K_MAX tokens.
FLAT = (_rng.standard_normal(2 * K_MAX) * 0.3).astype(np.float32)
PEAKED = (_rng.standard_normal(2 * K_MAX) * 1.5).astype(np.float32)
N_DRAWS = 20_000


def draws(n, logits=LOGITS, **kw):
    return np.asarray(sample(jnp.tile(logits, (n, 1)), meta(n, **kw)))


def target(logits, temperature, top_k=0, top_p=1.0):
    """The exact distribution: top-k, then top-p on the renormalized top-k set (float64)."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    if 0 < top_k < len(z):
        order = order[:top_k]
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    if top_p < 1:
        n = np.sum(np.cumsum(p) - p < top_p)
        order, p = order[:n], p[:n] / p[:n].sum()
    out = np.zeros(len(z))
    out[order] = p
    return out


def assert_follows(tokens, p):
    """No draw outside the support, and a chi-square test at a one-sided level of about 1e-6."""
    counts = np.bincount(tokens, minlength=len(p))
    support = p > 0
    assert counts[~support].sum() == 0
    df = support.sum() - 1
    if df == 0:
        return
    expected = len(tokens) * p[support]
    stat = np.sum((counts[support] - expected) ** 2 / expected)
    # Wilson-Hilferty approximation of the chi-square quantile, z = 4.75.
    critical = df * (1 - 2 / (9 * df) + 4.75 * np.sqrt(2 / (9 * df))) ** 3
    assert stat < critical, (stat, critical, df)


@pytest.mark.parametrize(
    "logits,top_k,top_p",
    [
        (NARROW, 0, 1.0),  # plain Gumbel-max
        (NARROW, 3, 1.0),  # top-k candidates
        (NARROW, 3, 0.8),  # top-k then top-p, on the candidates
        (NARROW, 0, 0.8),  # top-p alone: sort
        (PEAKED, 50, 1.0),
        (PEAKED, 50, 0.8),
        (FLAT, K_MAX, 1.0),  # the most candidates there are
        (FLAT, K_MAX + 44, 1.0),  # top_k > K_MAX: sort
        (FLAT, K_MAX + 44, 0.95),
        (FLAT, 0, 0.8),  # a nucleus wider than K_MAX
    ],
)
def test_each_path_follows_the_target_distribution(logits, top_k, top_p):
    p = target(logits, 0.7, top_k, top_p)
    assert_follows(draws(N_DRAWS, logits, temperature=0.7, top_k=top_k, top_p=top_p), p)


def test_top_k_just_above_k_max_keeps_every_token():
    logits = np.full(2 * K_MAX, -50.0, np.float32)
    logits[:K_MAX] = 0.0
    logits[K_MAX] = -0.01  # the (K_MAX + 1)-th largest
    assert set(draws(8000, logits, top_k=K_MAX + 1)) == set(range(K_MAX + 1))
    assert set(draws(8000, logits, top_k=K_MAX)) == set(range(K_MAX))


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).standard_normal((7, 50)).astype(np.float32)
    assert (np.asarray(sample(logits, meta(7, temperature=0.0))) == logits.argmax(-1)).all()


def test_top_k_and_top_p_restrict_the_support():
    assert set(draws(400, top_k=2)) == {1, 2}
    assert set(draws(400, top_p=0.7)) == {1, 2}  # 0.5 + 0.3 reaches 0.7
    assert set(draws(400, top_p=0.01)) == {1}
    assert set(draws(400)) == {0, 1, 2, 3, 4}
    assert set(draws(400, top_k=7)) == {0, 1, 2, 3, 4}  # top_k >= vocabulary: no top-k


def test_low_temperature_sharpens():
    assert (draws(400, temperature=0.05) == 1).mean() > 0.95


def test_mixed_batch_greedy_rows_stay_greedy():
    logits = jnp.tile(LOGITS, (4, 1))
    m = meta(4)
    m = SamplingMetadata(jnp.array([0.0, 1.0, 0.0, 1.0]), m.top_k, m.top_p, m.seeds, m.steps)
    out = np.asarray(sample(logits, m))
    assert out[0] == 1 and out[2] == 1


def test_seed_and_step_make_draws_reproducible():
    a = draws(64, seed=5, step=3)
    assert (draws(64, seed=5, step=3) == a).all()
    assert (draws(64, seed=5, step=4) != a).any()


# One row per path: (logits, temperature, top_k, top_p).
ROWS = [
    (PEAKED, 0.0, 0, 1.0),  # greedy
    (FLAT, 1.0, 0, 1.0),  # plain
    (PEAKED, 0.0, 5, 0.5),  # greedy despite top-k / top-p
    (PEAKED, 1.0, 5, 1.0),  # candidates
    (PEAKED, 0.7, 20, 0.8),  # candidates, top-p on them
    (FLAT, 0.7, 0, 0.8),  # sort (top-p alone)
    (FLAT, 1.0, K_MAX + 1, 1.0),  # sort (top_k > K_MAX)
    (FLAT, 1.0, 2 * K_MAX, 1.0),  # top_k = vocabulary: plain
]
# With these the two sort rows are an eighth of the batch: only they are sorted.
MORE_ROWS = [(PEAKED, 0.5 + 0.1 * i, 5 + i, 1.0) for i in range(8)]


def sample_rows(rows, seeds, steps):
    logits = jnp.stack([r[0] for r in rows])
    sm = SamplingMetadata(
        temperature=jnp.array([r[1] for r in rows], jnp.float32),
        top_k=jnp.array([r[2] for r in rows], jnp.int32),
        top_p=jnp.array([r[3] for r in rows], jnp.float32),
        seeds=jnp.array(seeds, jnp.uint32), steps=jnp.array(steps, jnp.int32),
    )
    return np.asarray(sample(logits, sm)).tolist()


def test_a_rows_token_does_not_depend_on_the_rest_of_the_batch():
    rows = ROWS + MORE_ROWS
    seeds, steps = list(range(100, 100 + len(rows))), list(range(len(rows)))
    alone = [sample_rows([r], [s], [n])[0] for r, s, n in zip(rows, seeds, steps)]
    assert sample_rows(rows, seeds, steps) == alone
    assert sample_rows(ROWS, seeds[:8], steps[:8]) == alone[:8]  # every row sorted
    # A sort row first: the compacted sort pads with row 0.
    def rotate(x):
        return x[5:] + x[:5]

    assert sample_rows(rotate(rows), rotate(seeds), rotate(steps)) == rotate(alone)
    assert alone[0] == alone[2] == PEAKED.argmax()
    # Seeds matter: other seeds move at least one of the sampled rows.
    assert sample_rows(rows, [s + 1 for s in seeds], steps) != alone


@pytest.mark.parametrize("temperatures", [(0.0, 0.0, 0.0), (0.0, 0.7, 1.3)])
def test_branch_free_draws_equal_the_branching_ones(temperatures):
    # The GPU's step (branch_free) and the CPU's must give the same tokens.
    from jaxserve.worker.sampler import sample_unfiltered

    n = len(temperatures)
    m = meta(n, seed=3, step=5)
    m = SamplingMetadata(jnp.asarray(temperatures, jnp.float32), m.top_k, m.top_p, m.seeds, m.steps)
    logits = jnp.tile(LOGITS, (n, 1))
    a = sample_unfiltered(logits, m, branch_free=True)
    b = sample_unfiltered(logits, m, branch_free=False)
    assert np.asarray(a).tolist() == np.asarray(b).tolist()
