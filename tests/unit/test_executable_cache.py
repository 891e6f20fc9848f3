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


def test_an_entry_written_where_jax_s_own_cache_holds_the_program_runs(tmp_path, monkeypatch):
    """The failure this guards against: JAX's persistent compilation cache serves the compile
    (a program compiled in an earlier process), the executable is serialized from that, and the
    stored entry then fails at its first call ("Function ... not found")."""
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    saved = {k: getattr(jax.config, k) for k in (
        "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes")}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    try:
        table = np.random.default_rng(0).random((1000, 64), np.float32)
        idx = np.arange(0, 1000, 7, dtype=np.int32)
        f = jax.jit(lambda t, i: (jnp.tanh(t[i] @ t[:64]).sum(-1), jnp.take(t, i[::-1], 0).mean()))
        want = f(table, idx)  # compiled and written to JAX's persistent cache
        jax.clear_caches()  # the next compile of f is served from that cache
        key = EC.cache_key({"test": "persistent-cache"})
        EC.load_or_compile(key, lambda: f.lower(table, idx).compile())
        loaded, hit = EC.load_or_compile(key, lambda: None)
        assert hit
        got = loaded(table, idx)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)
