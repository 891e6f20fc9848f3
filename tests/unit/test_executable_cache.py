"""The compiled-step disk cache: a second load skips compiling and gives the same program; a
different description is a different entry; a corrupt entry is compiled again."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.worker import executable_cache as EC


def test_round_trip_keys_and_corrupt_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    x = jnp.arange(8, dtype=jnp.float32)
    calls = []

    def compile_fn():
        calls.append(1)
        return jax.jit(lambda a, b: (a * 2 + b, a.sum()), donate_argnums=(1,)).lower(x, x).compile()

    key = EC.cache_key({"model": "m", "tokens": 8})
    first, hit = EC.load_or_compile(key, compile_fn)
    assert not hit and len(calls) == 1 and (tmp_path / "executables" / f"{key}.bin").exists()
    second, hit = EC.load_or_compile(key, compile_fn)
    assert hit and len(calls) == 1
    a, b = np.arange(8, dtype=np.float32), np.ones(8, np.float32)
    for got, want in zip(second(a, b), first(a, b)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    assert EC.cache_key({"model": "m", "tokens": 16}) != key
    (tmp_path / "executables" / f"{key}.bin").write_bytes(b"not an executable")
    third, hit = EC.load_or_compile(key, compile_fn)
    assert not hit and len(calls) == 2
    np.testing.assert_array_equal(np.asarray(third(a, b)[0]), np.asarray(first(a, b)[0]))
