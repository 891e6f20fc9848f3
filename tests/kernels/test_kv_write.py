"""The Pallas KV write (``pallas_kernels.kv_write``) against XLA's scatter (``llama.write_kv``):
every row outside the null page equal bit for bit, bfloat16/float32 and FP8 pools, token counts
that are and are not multiples of the kernel's block, padding into the null page. Interpreted on
the CPU; compiled (Triton) where JAX sees a GPU, at the 8B's shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.llama import write_kv
from pallas_kernels import attention, get_kv_write_fn, kv_quant, kv_write, reference

on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


def _check(num_tokens, num_kv_heads, head_dim, dtype, fp8, num_pages=12, page_size=8,
           interpret=True):
    key = jax.random.PRNGKey(num_tokens)
    k = 3 * jax.random.normal(key, (num_tokens, num_kv_heads, head_dim), dtype)
    v = jax.random.normal(jax.random.fold_in(key, 1), (num_tokens, num_kv_heads, head_dim), dtype)
    k = k.at[0, 0].set(0)  # an all-zero row: scale 1 in an FP8 pool
    slots = np.random.default_rng(num_tokens).permutation(
        np.arange(page_size, num_pages * page_size))[:num_tokens].astype(np.int32)
    if num_tokens > 2:
        slots[-2:] = [0, 3]  # padding tokens: the null page
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    old = jax.random.normal(jax.random.fold_in(key, 2), shape)
    k_pages = kv_quant.quantize_pages(old) if fp8 else old.astype(dtype)
    v_pages = jax.tree.map(lambda a: -a if a.dtype != jnp.uint8 else a, k_pages)
    want = write_kv(k_pages, v_pages, k, v, jnp.asarray(slots))
    got = jax.jit(lambda *a: kv_write.write_kv(*a, interpret=interpret))(
        k_pages, v_pages, k, v, jnp.asarray(slots))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g)[:, 1:], np.asarray(w)[:, 1:])


@pytest.mark.parametrize("num_tokens", [1, 7, 40])
@pytest.mark.parametrize("dtype,fp8", [(jnp.bfloat16, False), (jnp.float32, False),
                                       (jnp.bfloat16, True)])
def test_kv_write_equals_xla_scatter(num_tokens, dtype, fp8):
    _check(num_tokens, 3, 32, dtype, fp8)


def test_block_tokens():
    assert [kv_write.block_tokens(t) for t in (1, 6, 16, 40, 8192)] == [1, 2, 16, 8, 16]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 256, 8192])
@pytest.mark.parametrize("fp8", [False, True])
def test_kv_write_gpu(num_tokens, fp8):
    _check(num_tokens, 8, 128, jnp.bfloat16, fp8, num_pages=600, page_size=16, interpret=False)


def test_the_kernel_writes_the_pallas_pools_at_prefill_sizes():
    """The Pallas attention's pools take the kernel past SCATTER_MAX_TOKENS (interpreted as the
    attention is); smaller steps and the reference's pools take XLA's scatter (None)."""
    big = kv_write.SCATTER_MAX_TOKENS + 16
    interpreted = functools.partial(functools.partial(attention, interpret=True), sm_scale=0.1)
    write = get_kv_write_fn(interpreted, big)
    assert write.func is kv_write.write_kv and write.keywords == {"interpret": True}
    assert get_kv_write_fn(attention, big).keywords == {"interpret": False}
    assert get_kv_write_fn(attention, kv_write.SCATTER_MAX_TOKENS) is None
    assert get_kv_write_fn(reference.attention, big) is None
