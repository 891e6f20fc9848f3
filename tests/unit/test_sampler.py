"""The sampler on hand-made logits: greedy, top-k, top-p, temperature and per-request seeds.

Each sampling path (plain Gumbel-max, top-k candidates, full sort) is checked against the exact
target distribution with a chi-square test on 20,000 draws.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.worker.sampler import K_MAX, filtered_rows, sample_filtered, sample_unfiltered
from jaxserve.worker.sampling_fields import FilterMetadata, SamplingMetadata, neutral


def plain_filter_metadata(sm: SamplingMetadata, vocab: int) -> FilterMetadata:
    """FilterMetadata that draws the top-k / top-p rows of ``sm`` and nothing else."""
    return neutral(FilterMetadata, sm.temperature.shape[0], rows=filtered_rows(sm, vocab))


def draw_tokens(logits, sm, fm=None, state=None, bitmask=None):
    """One token per row as a step draws it: ``sample_unfiltered`` then ``sample_filtered``.
    With ``fm`` None the top-k / top-p rows alone are drawn again and the [S] int32 tokens
    returned; else ``sample_filtered``'s (tokens, state, Logprobs)."""
    tokens = sample_unfiltered(logits, sm, branch_free=False)
    if fm is None:
        return sample_filtered(logits, tokens, sm, plain_filter_metadata(sm, logits.shape[-1]))[0]
    return sample_filtered(logits, tokens, sm, fm, state, bitmask)


sample = jax.jit(draw_tokens)


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
    n = len(temperatures)
    m = meta(n, seed=3, step=5)
    m = SamplingMetadata(jnp.asarray(temperatures, jnp.float32), m.top_k, m.top_p, m.seeds, m.steps)
    logits = jnp.tile(LOGITS, (n, 1))
    a = sample_unfiltered(logits, m, branch_free=True)
    b = sample_unfiltered(logits, m, branch_free=False)
    assert np.asarray(a).tolist() == np.asarray(b).tolist()


# -- logits processors, penalties, min-p, logprobs (the filtered executable) -------------------

from jaxserve.worker.sampler import (  # noqa: E402
    apply_processors, compute_logprobs, init_state, write_state_row)

V = 12


def fmeta(n, **kw):
    """FilterMetadata for n rows, rows i using slot i, everything off unless given."""
    base = neutral(FilterMetadata, n, rows=np.ones(n, bool), slots=np.arange(n, dtype=np.int32))
    return dataclasses.replace(base, **{k: np.asarray(v, getattr(base, k).dtype)
                                        for k, v in kw.items()})


def state_with(rows):
    """A SamplingState whose slot i holds rows[i] = (tokens, num_prompt, bias dict, stop ids)."""
    st = init_state(len(rows), V, 4, 3)
    for i, (tokens, num_prompt, bias, stops) in enumerate(rows):
        t = np.zeros(16, np.int32)
        t[: len(tokens)] = tokens
        bias_ids = np.full(4, V, np.int32)
        bias_ids[: len(bias)] = list(bias)
        bias_vals = np.zeros(4, np.float32)
        bias_vals[: len(bias)] = list(bias.values())
        stop_ids = np.full(3, V, np.int32)
        stop_ids[: len(stops)] = stops
        st = write_state_row(st, np.int32(i), t, np.int32(num_prompt), np.int32(len(tokens)),
                             bias_ids, bias_vals, stop_ids)
    return st


def test_state_rows_count_outputs_and_mark_the_prompt():
    st = state_with([([3, 4, 5, 5, 7, 5], 3, {}, [])])
    assert np.asarray(st.output_counts[0]).tolist() == [0, 0, 0, 0, 0, 2, 0, 1, 0, 0, 0, 0]
    assert np.flatnonzero(np.asarray(st.prompt_mask[0])).tolist() == [3, 4, 5]


def test_penalties_bias_and_min_tokens_follow_vllms_definitions():
    """Row 0: repetition 2 over prompt + output, frequency 0.5 and presence 1 over the output;
    row 1: a logit bias and min_tokens holding its stop ids back; row 2: all neutral."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((3, V)).astype(np.float32) * 3
    st = state_with([([1, 2, 5, 5, 6], 2, {}, []), ([1], 1, {4: 2.5, 9: -100.0}, [2, 7]),
                     ([1], 1, {0: 50.0}, [3])])
    fm = fmeta(3, repetition_penalty=[2, 1, 1], frequency_penalty=[0.5, 0, 0],
               presence_penalty=[1, 0, 0], logit_bias=[False, True, False],
               suppress_stop=[False, True, False])
    out = np.asarray(apply_processors(jnp.asarray(logits), fm, st))
    want = logits.copy()
    counts = np.bincount([5, 5, 6], minlength=V)
    seen = np.isin(np.arange(V), [1, 2, 5, 6])
    r = want[0]
    r[seen] = np.where(r[seen] > 0, r[seen] / 2, r[seen] * 2)
    want[0] = r - 0.5 * counts - 1.0 * (counts > 0)
    want[1, 4] += 2.5
    want[1, 9] -= 100
    want[1, [2, 7]] = -np.inf
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_min_tokens_gives_way_to_a_grammar_that_allows_only_stops():
    """Row 0's grammar allows only its stop tokens: min_tokens leaves them (the grammar is
    complete); row 1's allows another token too: min_tokens holds the stops back."""
    logits = np.full((2, V), -np.inf, np.float32)
    logits[:, [2, 7]] = [1.0, 0.5]
    logits[1, 4] = -3.0
    st = state_with([([1], 1, {}, [2, 7]), ([1], 1, {}, [2, 7])])
    out = np.asarray(apply_processors(jnp.asarray(logits), fmeta(2, suppress_stop=[True, True]),
                                      st))
    np.testing.assert_array_equal(out[0], logits[0])
    assert np.flatnonzero(out[1] > -np.inf).tolist() == [4]


def test_min_p_keeps_tokens_within_its_share_of_the_best():
    """min_p after temperature: the support is the tokens with p >= min_p * p_max, drawn in
    proportion (chi-square); min_p 1 is greedy."""
    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], np.float32))
    n = N_DRAWS
    sm = meta(n, temperature=1.0)
    fm = fmeta(n, min_p=np.full(n, 0.3))
    tokens = np.asarray(sample(jnp.tile(logits, (n, 1)), sm, fm, None)[0])
    p = np.array([0.4, 0.3, 0.15, 0, 0])  # 0.1 < 0.3 * 0.4: out
    assert_follows(tokens, p / p.sum())
    fm1 = fmeta(8, min_p=np.ones(8))
    assert set(np.asarray(sample(jnp.tile(logits, (8, 1)), meta(8, temperature=2.0),
                                 fm1, None)[0])) == {0}


def test_logprobs_are_the_raw_log_softmax_with_ranks():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((4, 300)).astype(np.float32) * 4
    tokens = np.array([0, 5, int(logits[2].argmax()), 299], np.int32)
    lp = compute_logprobs(jnp.asarray(logits), jnp.asarray(tokens))
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(lp.token_logprobs), ref[np.arange(4), tokens], atol=1e-5)
    top = np.asarray(lp.top_logprobs)
    assert (np.diff(top, axis=-1) <= 0).all()
    np.testing.assert_allclose(top, -np.sort(-ref, axis=-1)[:, : top.shape[1]], atol=1e-5)
    ranks = 1 + (ref > ref[np.arange(4), tokens][:, None]).sum(-1)
    assert np.asarray(lp.token_ranks).tolist() == ranks.tolist() and ranks[2] == 1


def test_filtered_rows_count_their_tokens_and_greedy_takes_the_processed_argmax():
    """A greedy row with a penalty takes the argmax after the penalty; the count flag adds the
    drawn token to that slot only; rows not marked keep their token."""
    logits = np.zeros((3, V), np.float32)
    logits[:, 5] = 3.0
    logits[:, 6] = 2.5
    st = state_with([([1, 5], 1, {}, []), ([1], 1, {}, []), ([1], 1, {}, [])])
    sm = meta(3, temperature=0.0)
    fm = fmeta(3, rows=[True, True, False], frequency_penalty=[1.0, 0, 0],
               count=[True, True, False], logprobs=[True, False, False])
    tokens, st2, lp = sample(jnp.asarray(logits), sm, fm, st)
    assert np.asarray(tokens).tolist() == [6, 5, 5]  # row 0: 3.0 - 1 < 2.5
    counts = np.asarray(st2.output_counts)
    assert counts[0, 6] == 1 and counts[0, 5] == 1 and counts[1, 5] == 1 and counts[2].sum() == 0
    # Log-probabilities are of the raw logits, whatever the penalty did.
    assert float(lp.token_logprobs[0]) == pytest.approx(2.5 - np.log(np.exp(logits[0]).sum()), abs=1e-5)


def _kept_numpy(row: np.ndarray, k: int, top_p: float) -> np.ndarray:
    """The tokens top-k (0: off) then top-p keep, by definition: the k largest (ties at the
    k-th kept), then the shortest prefix of their distribution reaching top_p (ties kept)."""
    desc = np.sort(row)[::-1]
    kth = desc[(k or len(row)) - 1]
    kept = desc[desc >= kth].astype(np.float64)
    probs = np.exp(kept - kept.max()) / np.exp(kept - kept.max()).sum()
    mass_before = np.cumsum(probs) - probs
    n = max(int(np.sum((top_p >= 1) | (mass_before < top_p))), 1)
    return row >= max(kept[n - 1], kth)


@pytest.mark.parametrize("ks, ps", [
    ([40, 1, K_MAX, 3, 0], [0.4, 1.0, 0.9, 0.5, 1.0]),  # every cut among the candidates
    ([40, K_MAX + 1, 3, 0, 0], [0.4, 1.0, 0.5, 0.9, 1.0]),  # a row past them: the full sort
])
def test_top_k_top_p_mask_equals_the_definition(ks, ps):
    # The mask a draft's q and its verification use: from lax.top_k's candidates when they
    # hold every row's cut, else from a full sort; both give the definition's set.
    from jaxserve.worker.sampler import _top_k_top_p_masked

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(len(ks), 3000)).astype(np.float32)
    logits[:, :20] = logits.max() + 0.5  # a tie across the top of every row
    got = np.isfinite(np.asarray(_top_k_top_p_masked(
        jnp.asarray(logits), jnp.asarray(ks, jnp.int32), jnp.asarray(ps, jnp.float32))))
    for i, (k, p) in enumerate(zip(ks, ps)):
        np.testing.assert_array_equal(got[i], _kept_numpy(logits[i], k, p), err_msg=f"row {i}")
