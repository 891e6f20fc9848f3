"""The sampler on hand-made logits: greedy, top-k, top-p, temperature and per-request seeds."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.worker.sampler import SamplingMetadata, sample

sample = jax.jit(sample)


def meta(n, temperature=1.0, top_k=0, top_p=1.0, seed=0, step=0):
    return SamplingMetadata(
        temperature=jnp.full(n, temperature, jnp.float32), top_k=jnp.full(n, top_k, jnp.int32),
        top_p=jnp.full(n, top_p, jnp.float32), seeds=jnp.arange(n, dtype=jnp.uint32) + seed,
        steps=jnp.full(n, step, jnp.int32),
    )


LOGITS = np.log(np.array([0.05, 0.5, 0.3, 0.1, 0.05], np.float32))


def draws(n, **kw):
    return np.asarray(sample(jnp.tile(LOGITS, (n, 1)), meta(n, **kw)))


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).standard_normal((7, 50)).astype(np.float32)
    assert (np.asarray(sample(logits, meta(7, temperature=0.0))) == logits.argmax(-1)).all()


def test_top_k_and_top_p_restrict_the_support():
    assert set(draws(400, top_k=2)) == {1, 2}
    assert set(draws(400, top_p=0.7)) == {1, 2}  # 0.5 + 0.3 reaches 0.7
    assert set(draws(400, top_p=0.01)) == {1}
    assert set(draws(400)) == {0, 1, 2, 3, 4}


def test_temperature_one_follows_the_distribution():
    counts = np.bincount(draws(4000), minlength=5) / 4000
    np.testing.assert_allclose(counts, np.exp(LOGITS), atol=0.03)


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
