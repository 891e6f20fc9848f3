"""Compiled programs kept on disk whole, so that a later start neither traces, lowers nor
compiles them.

JAX's persistent compilation cache spares a later start XLA's compile only: it is keyed by the
lowered program, so every start still traces and lowers each program first (on the H200, 6.2 s
of an 18.3 s warm start for the 8B model's 19 programs, docs/performance.md). This cache is
keyed by what decides a program before it is traced:

- the source of the jaxserve and pallas_kernels packages, the jax and jaxlib versions, the
  devices, JAX's configuration and the ``JAX_*``/``XLA_*`` environment (``environment_key``);
- the jitted function with what it closes over (a ``functools.partial``'s arguments) and its
  jit settings, the tree structure and abstract values (shape, dtype, weak type, sharding) of
  the arguments, and the compiler options.

An entry (``$JAXSERVE_CACHE/executables/<environment>/<sha256>.jex``, one folder per
``environment_key``) holds the executable as
``jax.experimental.serialize_executable`` writes it, with its argument and output trees and
the ids of its devices (it is loaded onto those). Several processes serving one model (hosts)
keep nothing here. An
entry that does not load is compiled again and rewritten. Each version of the code writes a
folder of its own; only the ``KEEP_ENVIRONMENTS`` most recently used folders are kept (without
this the folder grew by ~80 MB a configuration for every commit tested: 3.1 GB in a day on the
development machine).

JAX's persistent cache keeps none of these programs: on the CPU (jax 0.10.2) an executable it
loaded failed at its first call with "Function ... not found", whether re-serialized here or
used as loaded (letting it keep and serve the runner programs broke the tiny models' tests in a
second run of the suite), so a program compiled here is never written to it, and one that it
served anyway (a cache shared with other code) is not saved here.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import math
import os
import pathlib
import pickle
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

import jax
import jaxlib
from jax._src import config as jax_config
from jax.experimental import serialize_executable

# Whether JAX's persistent cache served this thread's last compile (jax.monitoring's event).
_served_by_jax = threading.local()


def _on_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _served_by_jax.hit = True


jax.monitoring.register_event_listener(_on_event)

_SOURCE_PACKAGES = ("jaxserve", "pallas_kernels")
# Folders of entries (versions of the code x device sets x JAX settings) kept; older ones are
# deleted. One run of the test suite alone uses several (fake device counts, JAX_ variables).
KEEP_ENVIRONMENTS = 16


@functools.cache
def environment_key() -> str:
    """sha256 hex of what every program of this process depends on beyond its own arguments:
    the Python source of jaxserve and pallas_kernels, jax/jaxlib versions, the backend's
    platform version and devices, JAX's configuration (its cache settings aside) and the
    JAX_/XLA_ environment variables."""
    h = hashlib.sha256()
    for package in _SOURCE_PACKAGES:
        root = pathlib.Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    devices = jax.devices()
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_")))
    flags = sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k)
    h.update(repr((jax.__version__, jaxlib.__version__, devices[0].client.platform_version,
                   [(d.platform, d.device_kind, d.id, d.process_index) for d in devices],
                   env, flags)).encode())
    return h.hexdigest()


def _describe(value) -> str:
    """A stable text of a jitted function's static part: functions by qualified name (their
    repr holds an address), partials by function and arguments, other values by repr."""
    if isinstance(value, functools.partial):
        return (f"partial({_describe(value.func)}, "
                f"{[_describe(a) for a in value.args]}, "
                f"{ {k: _describe(v) for k, v in value.keywords.items()} })")
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)


def _abstract(leaf) -> tuple:
    return (tuple(getattr(leaf, "shape", ())), str(getattr(leaf, "dtype", type(leaf).__name__)),
            bool(getattr(leaf, "weak_type", False)), str(getattr(leaf, "sharding", None)))


def program_key(jitted: Callable, args: tuple, options: dict | None) -> str | None:
    """sha256 hex naming the executable ``jitted.lower(*args).compile(options)`` would make in
    this environment; None for a callable that does not show its jit settings, and in a
    process that is one of several hosts (the program is then compiled, not cached).

    Args:
      jitted: a ``jax.jit`` of a module-level function or of a ``functools.partial`` of one;
        its settings (donation, shardings, static arguments) are read from its ``_jit_info``
        (jax's PjitInfo, whose repr holds them all).
      args: the positional arguments (arrays, ShapeDtypeStructs, numpy values, pytrees).
      options: XLA compiler options, or None.
    """
    info, fn = getattr(jitted, "_jit_info", None), getattr(jitted, "__wrapped__", None)
    if info is None or fn is None or jax.process_count() > 1:
        return None  # several processes (hosts): each compiles its own part, never cached
    leaves, tree = jax.tree.flatten(args)
    text = repr((environment_key(), _describe(fn), repr(info), str(tree),
                 [_abstract(x) for x in leaves], sorted((options or {}).items())))
    return hashlib.sha256(text.encode()).hexdigest()


class ExecutableCache:
    """Compiled programs by ``program_key``, in ``directory`` (created when first written).

    Args:
      directory: where entries live, e.g. ``$JAXSERVE_CACHE/executables``; None: compile
        every program, keep none.
      log: where a failure to read or write an entry is reported (it never fails a compile).

    Attributes:
      hits: programs loaded from an entry so far.
    """

    def __init__(self, directory: str | os.PathLike | None, log: Callable[[str], None] = print):
        self.directory = None if directory is None else pathlib.Path(directory)
        self.log = log
        self.hits = 0
        self._lock = threading.Lock()

    def _path(self, jitted, args, options) -> pathlib.Path | None:
        key = None if self.directory is None else program_key(jitted, args, options)
        return None if key is None else self._folder / f"{key}.jex"

    @functools.cached_property
    def _folder(self) -> pathlib.Path:
        """This environment's folder of entries, marked as the latest used; the first call
        deletes the folders beyond the ``KEEP_ENVIRONMENTS`` most recently used."""
        folder = self.directory / environment_key()[:32]
        try:
            folder.mkdir(parents=True, exist_ok=True)
            os.utime(folder)
            # (entries of the first layout, directly in the directory, count as one each)
            others = sorted((p for p in self.directory.iterdir() if p != folder),
                            key=lambda p: p.stat().st_mtime, reverse=True)
            for old in others[KEEP_ENVIRONMENTS - 1:]:
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.unlink(missing_ok=True)
        except OSError as e:  # an unwritable cache: entries then fail to save, and say so
            self.log(f"executable cache: {self.directory} ({type(e).__name__}: {e})")
        return folder

    def compile(self, jitted: Callable, args: tuple = (), options: dict | None = None):
        """The ``jax.stages.Compiled`` of ``jitted`` for ``args``, on this thread: loaded from
        its entry when there is one, else compiled (and saved)."""
        path = self._path(jitted, args, options)
        if path is not None and path.exists():
            return self._load(path, jitted, args, options)
        return self._compile(path, jitted.lower(*args), options)

    def submit(self, pool: Executor, jitted: Callable, args: tuple,
               options: dict | None = None) -> Future:
        """``compile`` on ``pool``, but a program that is not in the cache is traced and
        lowered here first (tracing holds the GIL: done one after another on the caller's
        thread, it overlaps the compiles running on the pool)."""
        path = self._path(jitted, args, options)
        if path is not None and path.exists():
            return pool.submit(self._load, path, jitted, args, options)
        return pool.submit(self._compile, path, jitted.lower(*args), options)

    def _load(self, path: pathlib.Path, jitted, args, options):
        try:
            payload, in_tree, out_tree, device_ids = pickle.loads(path.read_bytes())
            by_id = {d.id: d for d in jax.devices()}
            # The program's own devices, in its order: loaded onto any other set (the default
            # is all of them) XLA aborts the process (a TP=2 program among 4 devices).
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
        except Exception as e:  # noqa: BLE001 - a bad entry is compiled again
            self.log(f"executable cache: {path.name} did not load ({type(e).__name__}: {e}); "
                     "compiling it again")
            return self._compile(path, jitted.lower(*args), options)
        with self._lock:
            self.hits += 1
        return compiled

    def _compile(self, path: pathlib.Path | None, lowered, options):
        _served_by_jax.hit = False
        # A thread-local setting: only this compile stays out of JAX's persistent cache.
        with jax_config.persistent_cache_min_compile_time_secs(math.inf):
            compiled = lowered.compile(options)
        if path is None or _served_by_jax.hit:
            return compiled
        tmp = None
        try:
            devices = [d.id for d in compiled.runtime_executable().local_devices()]
            entry = pickle.dumps((*serialize_executable.serialize(compiled), devices))
            path.parent.mkdir(parents=True, exist_ok=True)
            # Written whole then renamed: another process starting alongside never reads half.
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(entry)
            os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001 - caching is an optimisation
            self.log(f"executable cache: not saved ({type(e).__name__}: {e})")
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
        return compiled
