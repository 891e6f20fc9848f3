"""The Pallas grouped matmul compiled for the GPU (Triton) against ``jax.lax.ragged_dot``, at
the expert GEMMs of Qwen3-30B-A3B and Mixtral-8x7B.

Marked ``gpu`` and skipped where JAX sees no GPU. Routing is random (the seed is in the
failure message), some experts get no rows, and rows past the groups must come out as 0.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import GmmTuning, grouped_matmul
from pallas_kernels.testing import rel_err, tolerance
from tests.kernels.test_gpu_lowering import MOE_SHAPES, moe_gemm_avals

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]


@pytest.mark.parametrize("projection", ["gate_up", "down"])
@pytest.mark.parametrize("num_tokens", [16, 256, 2048])
@pytest.mark.parametrize("shape", MOE_SHAPES)
@pytest.mark.parametrize("tuning", [None, GmmTuning(block_m=64, block_n=64, block_k=32)])
def test_grouped_matmul_gpu(shape, num_tokens, projection, tuning):
    seed = int(np.random.SeedSequence().entropy % (2**32))
    rng = np.random.default_rng(seed)
    lhs_aval, rhs_aval, sizes_aval = moe_gemm_avals(shape, num_tokens, projection)
    rows, num_groups = lhs_aval.shape[0], sizes_aval.shape[0]
    # Routing with some experts idle; the last 5 rows belong to no expert.
    used = rng.choice(num_groups, max(1, num_groups * 3 // 4), replace=False)
    sizes = np.bincount(rng.choice(used, rows - 5), minlength=num_groups).astype(np.int32)
    k1, k2 = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(k1, lhs_aval.shape, lhs_aval.dtype)
    rhs = (0.02 * jax.random.normal(k2, rhs_aval.shape)).astype(rhs_aval.dtype)
    group_sizes = jnp.asarray(sizes)
    out = grouped_matmul(lhs, rhs, group_sizes, tuning=tuning)
    ref = jax.lax.ragged_dot(lhs, rhs, group_sizes)
    assert bool(jnp.isfinite(out).all()), f"seed {seed}"
    err = rel_err(out, ref)
    assert err <= tolerance(lhs.dtype), f"seed {seed}: rel err {err}"
    assert bool((out[rows - 5:] == 0).all()), f"seed {seed}"
