"""ExecutableCache: a program compiled once is loaded whole by a later cache (another start),
with its donation; the key follows shapes, static arguments and compiler options; a bad entry
is compiled again."""

from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import pytest
from jax.experimental.compilation_cache import compilation_cache

from jaxserve.worker.executable_cache import ExecutableCache, program_key


@pytest.fixture(autouse=True)
def _without_jax_persistent_cache():
    """These tests count the executable cache's entries, and a program JAX's persistent cache
    serves is not saved there: off while they run (an engine started earlier in this process,
    or an earlier run, may have left these programs in it)."""
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


def _scale(factor, pages, x):
    """pages is donated and updated in place; returns it with x * factor."""
    return pages.at[0].set(x * factor), (x * factor).sum()


def _jitted(factor):
    return jax.jit(partial(_scale, factor), donate_argnums=(0,))


def _compile(cache, jitted, args, options=None):
    with ThreadPoolExecutor(1) as pool:
        return cache.submit(pool, jitted, args, options).result()


def test_a_later_cache_loads_the_program_and_keeps_its_donation(tmp_path):
    args = (jnp.zeros((2, 3)), jnp.arange(3.0))
    first = ExecutableCache(tmp_path)
    _compile(first, _jitted(2.0), args)
    assert first.hits == 0 and len(list(tmp_path.glob("*/*.jex"))) == 1

    later = ExecutableCache(tmp_path)  # as a new process would: a new jit, a new cache object
    compiled = _compile(later, _jitted(2.0), args)
    assert later.hits == 1
    pages = jnp.zeros((2, 3))
    new_pages, total = compiled(pages, jnp.arange(3.0))
    np.testing.assert_array_equal(np.asarray(new_pages[0]), [0.0, 2.0, 4.0])
    assert float(total) == 6.0
    assert pages.is_deleted()  # donated, as the jit asked


def test_the_key_follows_shapes_static_arguments_and_options():
    args = (jnp.zeros((2, 3)), jnp.arange(3.0))
    key = program_key(_jitted(2.0), args, None)
    assert key == program_key(_jitted(2.0), args, None)  # no object addresses in it
    assert key != program_key(_jitted(3.0), args, None)
    assert key != program_key(_jitted(2.0), (jnp.zeros((4, 3)), jnp.arange(3.0)), None)
    assert key != program_key(_jitted(2.0), (jnp.zeros((2, 3), jnp.bfloat16),
                                             jnp.arange(3.0)), None)
    assert key != program_key(_jitted(2.0), args, {"xla_cpu_enable_fast_math": True})
    # abstract values stand for arrays: a ShapeDtypeStruct of the same type gives the same key
    struct = jax.ShapeDtypeStruct((3,), jnp.float32, sharding=args[1].sharding)
    assert key == program_key(_jitted(2.0), (args[0], struct), None)


def test_a_bad_entry_is_compiled_again_and_rewritten(tmp_path):
    args = (jnp.zeros((2, 3)), jnp.arange(3.0))
    _compile(ExecutableCache(tmp_path), _jitted(2.0), args)
    (entry,) = tmp_path.glob("*/*.jex")
    entry.write_bytes(b"not a pickle")
    logged = []
    cache = ExecutableCache(tmp_path, log=logged.append)
    compiled = _compile(cache, _jitted(2.0), args)
    assert cache.hits == 0 and "did not load" in logged[0]
    assert float(compiled(jnp.zeros((2, 3)), jnp.arange(3.0))[1]) == 6.0
    later = ExecutableCache(tmp_path)
    _compile(later, _jitted(2.0), args)
    assert later.hits == 1


def test_without_a_directory_nothing_is_kept():
    cache = ExecutableCache(None)
    for _ in range(2):  # the second compile finds nothing kept from the first
        compiled = _compile(cache, _jitted(2.0), (jnp.zeros((2, 3)), jnp.arange(3.0)))
        assert float(compiled(jnp.zeros((2, 3)), jnp.arange(3.0))[1]) == 6.0
    assert cache.hits == 0


def test_the_key_follows_the_jit_settings():
    args = (jnp.zeros((2, 3)), jnp.arange(3.0))
    assert (program_key(_jitted(2.0), args, None)
            != program_key(jax.jit(partial(_scale, 2.0)), args, None))  # no donation


_WITH_JAX_CACHE = """
import json, pathlib, sys
import jax, jax.numpy as jnp
sys.path.insert(0, {tests!r})
from test_executable_cache import _jitted
from jaxserve.worker.executable_cache import ExecutableCache
tmp = pathlib.Path({tmp!r})
jax.config.update("jax_compilation_cache_dir", str(tmp / "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
args = (jnp.zeros((2, 3)), jnp.arange(3.0))
count = lambda d: len([p for p in (tmp / d).rglob("*") if p.is_file() and "atime" not in p.name])
_jitted(2.0).lower(*args).compile()  # JAX's cache now holds this one
before = count("jax")
cache = ExecutableCache(tmp / "ours")
cache.compile(_jitted(2.0), args)  # served by JAX's cache: not re-serialized
served = count("ours")
cache.compile(_jitted(3.0), args)  # compiled here: saved here only
print(json.dumps(dict(before=before, served=served, ours=count("ours"), jax=count("jax"))))
"""


def test_jax_persistent_cache_neither_keeps_nor_feeds_the_cached_programs(tmp_path):
    import json
    import pathlib
    import subprocess
    import sys

    script = _WITH_JAX_CACHE.format(tests=str(pathlib.Path(__file__).parent), tmp=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    counts = json.loads(out.strip().splitlines()[-1])
    # nothing was saved from JAX's copy, and the program compiled here is not in JAX's cache
    assert counts["before"] >= 1 and counts["served"] == 0, counts
    assert counts["ours"] == 1 and counts["jax"] == counts["before"], counts
    later = ExecutableCache(tmp_path / "ours")
    compiled = _compile(later, _jitted(3.0), (jnp.zeros((2, 3)), jnp.arange(3.0)))
    assert later.hits == 1
    assert float(compiled(jnp.zeros((2, 3)), jnp.arange(3.0))[1]) == 9.0


_ON_A_MESH = """
import json, pathlib, sys
import jax, jax.numpy as jnp, numpy as np
from functools import partial
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
sys.path.insert(0, {tests!r})
from test_executable_cache import _scale
from jaxserve.worker.executable_cache import ExecutableCache
devices = jax.devices()  # 4 fake CPU devices
mesh = NamedSharding(Mesh(np.array(devices[1:3]), ("tp",)), P("tp"))
programs = {{
    "two devices": jax.jit(partial(_scale, 2.0), donate_argnums=(0,), out_shardings=(mesh, None)),
    "one device": jax.jit(partial(_scale, 3.0), donate_argnums=(0,)),
}}
inputs = {{"two devices": jax.device_put(jnp.zeros((2, 4)), mesh), "one device": jnp.zeros((2, 4))}}
cache = ExecutableCache(pathlib.Path({tmp!r}))
out = {{}}
for name, jitted in programs.items():
    compiled = cache.compile(jitted, (inputs[name], jnp.arange(4.0)))
    pages = inputs[name].copy()
    out[name] = [float(compiled(pages, jnp.arange(4.0))[1]), len(compiled(inputs[name].copy(),
                 jnp.arange(4.0))[0].sharding.device_set)]
out["hits"] = cache.hits
print(json.dumps(out))
"""


def test_a_program_loads_onto_its_own_devices(tmp_path):
    # Loaded onto all devices, a program of fewer aborts the process; a later process (the
    # second run) must load each onto the devices it was compiled for.
    import json
    import os
    import pathlib
    import subprocess
    import sys

    script = _ON_A_MESH.format(tests=str(pathlib.Path(__file__).parent), tmp=str(tmp_path))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu"}
    runs = [json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True,
                                      text=True, timeout=120, env=env, check=True)
                       .stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert runs[0]["hits"] == 0 and runs[1]["hits"] == 2
    for run in runs:
        assert run["two devices"] == [12.0, 2] and run["one device"] == [18.0, 1], run


def test_only_the_latest_environments_are_kept(tmp_path, monkeypatch):
    import os

    from jaxserve.worker import executable_cache

    monkeypatch.setattr(executable_cache, "KEEP_ENVIRONMENTS", 3)
    for age, name in enumerate(["b", "a", "c", "d"]):  # "d" the least recently used
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.jex").write_bytes(b"")
        os.utime(tmp_path / name, (1e9 - age, 1e9 - age))
    (tmp_path / "flat.jex").write_bytes(b"")  # the first layout's entry, older still
    os.utime(tmp_path / "flat.jex", (1.0, 1.0))
    cache = ExecutableCache(tmp_path)
    _compile(cache, _jitted(2.0), (jnp.zeros((2, 3)), jnp.arange(3.0)))
    current = executable_cache.environment_key()[:32]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a", "b", current])
    assert len(list((tmp_path / current).glob("*.jex"))) == 1
