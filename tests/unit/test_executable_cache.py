"""ExecutableCache: a program compiled once is loaded whole by a later cache (another start),
with its donation, and equals a fresh compile; the key follows shapes, static arguments, jit
settings and compiler options; an entry that is corrupt, of other versions, of another program
or not this user's is dropped and compiled again; the off switch keeps nothing."""

import json
import logging
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import pytest
from jax.experimental.compilation_cache import compilation_cache

from jaxserve.worker import executable_cache
from jaxserve.worker.executable_cache import ExecutableCache, KeyedJit, program_key


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
    return KeyedJit(partial(_scale, factor), donate_argnums=(0,))


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


def _entry(tmp_path):
    (entry,) = tmp_path.glob("*/*.jex")
    return entry


def _header_and_payload(entry):
    first, payload = entry.read_bytes().split(b"\n", 1)
    return json.loads(first), payload


def _dropped_and_compiled_again(tmp_path, caplog, reason):
    """A new cache finds the one entry bad: one WARNING naming reason, a fresh compile that
    works and is saved, so that the next cache loads it."""
    args = (jnp.zeros((2, 3)), jnp.arange(3.0))
    cache = ExecutableCache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="jaxserve.engine"):
        compiled = _compile(cache, _jitted(2.0), args)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert cache.hits == 0 and len(warnings) == 1, warnings
    assert "dropped" in warnings[0].getMessage() and reason in warnings[0].getMessage()
    assert float(compiled(jnp.zeros((2, 3)), jnp.arange(3.0))[1]) == 6.0
    later = ExecutableCache(tmp_path)
    _compile(later, _jitted(2.0), args)
    assert later.hits == 1


def _count_unpickles(monkeypatch) -> list:
    """Payloads unpickled from now on (one item each)."""
    calls, loads = [], executable_cache.pickle.loads
    monkeypatch.setattr(executable_cache.pickle, "loads",
                        lambda data: calls.append(1) or loads(data))
    return calls


def _saved(tmp_path):
    _compile(ExecutableCache(tmp_path), _jitted(2.0), (jnp.zeros((2, 3)), jnp.arange(3.0)))
    return _entry(tmp_path)


def test_a_corrupt_entry_is_dropped_and_compiled_again(tmp_path, caplog):
    _saved(tmp_path).write_bytes(b"not an entry")
    _dropped_and_compiled_again(tmp_path, caplog, "no header line")


def test_a_changed_payload_is_dropped_before_it_is_unpickled(tmp_path, caplog, monkeypatch):
    entry = _saved(tmp_path)
    header, payload = _header_and_payload(entry)
    entry.write_bytes(json.dumps(header).encode() + b"\n" + payload[:-1] + b"x")
    unpickled = _count_unpickles(monkeypatch)
    _dropped_and_compiled_again(tmp_path, caplog, "hash")
    assert len(unpickled) == 1  # the later cache's, of the entry written again


@pytest.mark.parametrize("field,value", [("jax", "0.0.1"), ("jaxlib", "0.0.1"), ("format", 0),
                                         ("donated", [False, False]),
                                         ("in_avals", ["float32[4, 3]", "float32[3]"])])
def test_an_entry_of_other_versions_or_another_program_is_dropped(tmp_path, caplog, field,
                                                                  value):
    entry = _saved(tmp_path)
    header, payload = _header_and_payload(entry)
    entry.write_bytes(json.dumps({**header, field: value}).encode() + b"\n" + payload)
    _dropped_and_compiled_again(tmp_path, caplog, field)


def test_a_loaded_program_that_differs_from_its_header_is_dropped(tmp_path, caplog):
    entry = _saved(tmp_path)
    header, payload = _header_and_payload(entry)
    header["out_avals"][0] = "float32[9, 9]" + header["out_avals"][0].split("]", 1)[1]
    entry.write_bytes(json.dumps(header).encode() + b"\n" + payload)
    _dropped_and_compiled_again(tmp_path, caplog, "out_avals")


def test_an_entry_others_may_write_is_not_unpickled(tmp_path, caplog, monkeypatch):
    _saved(tmp_path).chmod(0o666)
    unpickled = _count_unpickles(monkeypatch)
    _dropped_and_compiled_again(tmp_path, caplog, "own entries")
    assert len(unpickled) == 1  # the later cache's, of the entry written again


def test_an_entry_of_another_user_is_not_unpickled(tmp_path, caplog, monkeypatch):
    _saved(tmp_path)
    unpickled = _count_unpickles(monkeypatch)
    monkeypatch.setattr(executable_cache.os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    cache = ExecutableCache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="jaxserve.engine"):
        _compile(cache, _jitted(2.0), (jnp.zeros((2, 3)), jnp.arange(3.0)))
    assert cache.hits == 0 and unpickled == []
    assert "only this user's" in caplog.records[0].getMessage()


def test_folders_and_entries_are_private(tmp_path):
    entry = _saved(tmp_path / "executables")
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    assert stat.S_IMODE(entry.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "executables").stat().st_mode) == 0o700


def test_a_loaded_program_equals_a_fresh_compile(tmp_path):
    args = (jnp.zeros((2, 3)), jnp.arange(3.0))
    _compile(ExecutableCache(tmp_path), _jitted(2.0), args)
    later = ExecutableCache(tmp_path)
    loaded = _compile(later, _jitted(2.0), args)
    fresh = _jitted(2.0).lower(*args).compile()
    assert later.hits == 1
    assert loaded.in_avals == fresh.in_avals and str(loaded.in_tree) == str(fresh.in_tree)
    assert loaded.out_info == fresh.out_info
    assert ([a.donated for a in jax.tree.leaves(loaded.args_info)]
            == [a.donated for a in jax.tree.leaves(fresh.args_info)] == [True, False])
    assert loaded.input_shardings == fresh.input_shardings
    outs = [c(jnp.ones((2, 3)), jnp.arange(3.0)) for c in (loaded, fresh)]
    for a, b in zip(*map(jax.tree.leaves, outs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _first_of(pages, unused, x):
    return pages.at[0].set(x["used"]), x["used"].sum()


def test_a_program_with_unused_arguments_loads(tmp_path, caplog):
    # JAX prunes unused arguments: they have no sharding, and the entry's trial call must
    # still give them zeros (the sampler's programs leave fields of their metadata unused)
    args = (jnp.zeros((2, 3)), jnp.zeros(4), {"unused": jnp.zeros(5), "used": jnp.arange(3.0)})
    program = KeyedJit(_first_of, donate_argnums=(0,))
    _compile(ExecutableCache(tmp_path), program, args)
    later = ExecutableCache(tmp_path)
    with caplog.at_level(logging.WARNING):
        compiled = _compile(later, program, args)
    assert later.hits == 1 and "dropped" not in caplog.text
    assert float(compiled(jnp.zeros((2, 3)), *args[1:])[1]) == 3.0


def test_numpy_and_struct_arguments_of_64_bit_types_load(tmp_path):
    # without x64 JAX takes them as 32-bit: the entry's abstract values are the canonical ones
    args = (jnp.zeros((2, 3)), np.arange(3), jax.ShapeDtypeStruct((), np.float64))
    program = KeyedJit(partial(_add_scaled, 2.0), donate_argnums=(0,))
    _compile(ExecutableCache(tmp_path), program, args)
    later = ExecutableCache(tmp_path)
    compiled = _compile(later, program, args)
    assert later.hits == 1
    assert float(compiled(jnp.zeros((2, 3)), np.arange(3), np.float64(1.0))[1]) == 9.0


def _add_scaled(factor, pages, x, y):
    return pages.at[0].set(x * factor + y), (x * factor + y).sum()


def test_the_off_switch_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_DISABLE_EXECUTABLE_CACHE", "1")
    cache = ExecutableCache(tmp_path)
    for _ in range(2):
        compiled = _compile(cache, _jitted(2.0), (jnp.zeros((2, 3)), jnp.arange(3.0)))
        assert float(compiled(jnp.zeros((2, 3)), jnp.arange(3.0))[1]) == 6.0
    assert cache.hits == 0 and list(tmp_path.iterdir()) == []


def test_without_a_directory_nothing_is_kept():
    cache = ExecutableCache(None)
    for _ in range(2):  # the second compile finds nothing kept from the first
        compiled = _compile(cache, _jitted(2.0), (jnp.zeros((2, 3)), jnp.arange(3.0)))
        assert float(compiled(jnp.zeros((2, 3)), jnp.arange(3.0))[1]) == 6.0
    assert cache.hits == 0


def test_the_key_follows_the_jit_settings():
    args = (jnp.zeros((2, 3)), jnp.arange(3.0))
    assert (program_key(_jitted(2.0), args, None)
            != program_key(KeyedJit(partial(_scale, 2.0)), args, None))  # no donation


_WITH_JAX_CACHE = """
import json, pathlib, sys
import jax, jax.numpy as jnp
sys.path.insert(0, {tests!r})
from test_executable_cache import _jitted
from jaxserve.worker.executable_cache import ExecutableCache, KeyedJit
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
from jaxserve.worker.executable_cache import ExecutableCache, KeyedJit
devices = jax.devices()  # 4 fake CPU devices
mesh = NamedSharding(Mesh(np.array(devices[1:3]), ("tp",)), P("tp"))
programs = {{
    "two devices": KeyedJit(partial(_scale, 2.0), donate_argnums=(0,), out_shardings=(mesh, None)),
    "one device": KeyedJit(partial(_scale, 3.0), donate_argnums=(0,)),
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
