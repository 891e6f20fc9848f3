"""The Pallas grouped matmul in interpret mode (CPU) against ``jax.lax.ragged_dot`` and a
float64 numpy reference.

Fresh random inputs each run (the seed is in the failure message). Interpret mode starts every
Pallas output as NaN, so "all finite" proves that every row was written, the zero rows past
the groups included.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import GmmTuning, grouped_matmul, tile_schedule
from pallas_kernels.testing import rel_err


def _rng():
    seed = int(np.random.SeedSequence().entropy % (2**32))
    return np.random.default_rng(seed), seed


def _tol(dtype):
    # Interpret mode multiplies in float32 either way: bfloat16 differs by its output rounding.
    return 1e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-2


def _reference(lhs, rhs, sizes):
    """float64 numpy: row r of group g is lhs[r] @ rhs[g]; rows past the groups are 0."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, n in enumerate(sizes):
        out[start:start + n] = lhs[start:start + n] @ rhs[g]
        start += n
    return out


def _random_sizes(rng, num_rows, num_groups):
    """Random sizes summing to num_rows, some groups empty."""
    cuts = np.sort(rng.integers(0, num_rows + 1, num_groups - 1))
    return list(np.diff(np.concatenate([[0], cuts, [num_rows]])))


CASES = [
    # rows M, K, N, group sizes (None: random over M), tuning
    (48, 32, 48, None, None),
    (40, 24, 40, [0, 1, 17, 0, 19, 3], GmmTuning(block_n=16, block_k=16)),  # K, N short
    (64, 64, 32, [64], GmmTuning(block_k=16)),  # all rows in one group
    (50, 32, 32, [5, 0, 12, 1], GmmTuning(block_m=32)),  # sum < M: zero rows after
    (37, 16, 64, [0, 0, 0], None),  # no rows in any group
    (96, 32, 32, [16, 32, 16, 32], GmmTuning(block_m=16, block_n=32, block_k=32)),  # aligned
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows,k,n,sizes,tuning", CASES)
def test_grouped_matmul_matches_ragged_dot(rows, k, n, sizes, tuning, dtype):
    rng, seed = _rng()
    sizes = sizes if sizes is not None else _random_sizes(rng, rows, 5)
    lhs = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)), dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    out = grouped_matmul(lhs, rhs, group_sizes, tuning=tuning, interpret=True)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert bool(jnp.isfinite(out).all()), f"unwritten output (seed {seed}, sizes {sizes})"
    ref = _reference(lhs, rhs, sizes)
    assert rel_err(out, ref) <= _tol(dtype), f"seed {seed}, sizes {sizes}"
    ragged = jax.lax.ragged_dot(lhs, rhs, group_sizes)
    assert rel_err(out, ragged) <= _tol(dtype), f"seed {seed}, sizes {sizes}"
    assert bool((out[sum(sizes):] == 0).all()), f"seed {seed}, sizes {sizes}"


def test_tile_schedule_covers_each_row_once():
    """Every row lies in exactly one tile in use, of its own group; the bound on tiles holds
    when every group (the pseudo-group of rows past them too) ends in a short tile."""
    block_m = 16
    for sizes, rows in [([1, 15, 17, 31, 0], 80), ([16, 16], 32), ([0, 5], 5), ([3] * 8, 31)]:
        info = np.asarray(tile_schedule(jnp.asarray(sizes, jnp.int32), rows, block_m, 4))
        info = info.reshape(-1, 4)
        assert len(info) == -(-rows // block_m) + len(sizes)
        group_of = np.repeat(np.arange(len(sizes) + 1), sizes + [rows - sum(sizes)])
        seen = np.zeros(rows, int)
        for g, first, end, k_steps in info:
            tile_rows = np.arange(first, min(first + block_m, end))
            seen[tile_rows] += 1
            if len(tile_rows):
                pseudo = group_of[first] == len(sizes)
                assert pseudo or (group_of[tile_rows] == g).all()
                assert k_steps == (0 if pseudo else 4)
        assert (seen == 1).all(), (sizes, seen)


def test_grouped_matmul_rejects_bad_shapes():
    lhs = jnp.zeros((8, 16))
    with pytest.raises(ValueError, match="rhs"):
        grouped_matmul(lhs, jnp.zeros((2, 8, 16)), jnp.zeros(2, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(lhs, jnp.zeros((2, 16, 16)), jnp.zeros(3, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="dtype"):
        grouped_matmul(lhs, jnp.zeros((2, 16, 16), jnp.bfloat16), jnp.zeros(2, jnp.int32),
                       interpret=True)
