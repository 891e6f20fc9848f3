"""The MoE block's expert GEMMs: the Pallas grouped matmul (interpret mode) gives what
``jax.lax.ragged_dot`` gives inside ``moe.sparse_mlp``, and the platforms name one."""

import jax
import jax.numpy as jnp
import pytest

from jaxserve.models import moe
from jaxserve.platforms import PLATFORMS


def _params(key, hidden=32, inter=16, experts=6, shared=0):
    k = jax.random.split(key, 6)
    p = {"router": jax.random.normal(k[0], (hidden, experts)),
         "experts_gate_up": 0.2 * jax.random.normal(k[1], (experts, hidden, 2 * inter)),
         "experts_down": 0.2 * jax.random.normal(k[2], (experts, inter, hidden))}
    if shared:
        p |= {"shared_gate_up": 0.2 * jax.random.normal(k[3], (hidden, 2 * shared)),
              "shared_down": 0.2 * jax.random.normal(k[4], (shared, hidden)),
              "shared_expert_gate": jax.random.normal(k[5], (hidden, 1))}
    return p


@pytest.mark.parametrize("tokens,top_k,shared", [(5, 2, 0), (19, 3, 24)])
def test_sparse_mlp_pallas_equals_ragged_dot(tokens, top_k, shared):
    """A tiny MoE block (6 experts, some idle at 5 tokens; a shared expert): the same output."""
    p = _params(jax.random.key(tokens), shared=shared)
    x = jax.random.normal(jax.random.key(1), (tokens, 32))
    pallas = moe.get_grouped_gemm("pallas", interpret=True)
    ref = moe.sparse_mlp(x, p, top_k, True, 1)
    out = jax.jit(lambda x, p: moe.sparse_mlp(x, p, top_k, True, 1, grouped_gemm=pallas))(x, p)
    assert float(jnp.abs(out - ref).max()) <= 1e-5 * float(jnp.abs(ref).max())


def test_get_grouped_gemm():
    assert moe.get_grouped_gemm("ragged_dot") is jax.lax.ragged_dot
    with pytest.raises(ValueError, match="unknown MoE grouped GEMM 'cutlass'"):
        moe.get_grouped_gemm("cutlass")
    for platform in PLATFORMS.values():
        assert platform.moe_grouped_gemm in moe.GROUPED_GEMMS
