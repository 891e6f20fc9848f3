"""Compiled programs kept on disk whole, so that a later start neither traces, lowers nor
compiles them.

JAX's persistent compilation cache spares a later start XLA's compile only: it is keyed by the
lowered program, so every start still traces and lowers each program first (on the H200, 6.2 s
of an 18.3 s warm start for the 8B model's 19 programs, docs/performance.md). This cache is
keyed by what decides a program before it is traced, all of it our own inputs to JAX:

- the source of the jaxserve and pallas_kernels packages, the jax and jaxlib versions, the
  backend's platform version and devices, JAX's configuration and the ``JAX_*``/``XLA_*``
  environment (``environment_key``);
- the function (qualified name and source hash; a ``functools.partial``'s arguments) and the
  jit settings it was given (``KeyedJit``), the tree structure and abstract values (shape,
  dtype, weak type, sharding) of the arguments, and the compiler options.

An entry (``$JAXSERVE_CACHE/executables/<environment>/<sha256>.jex``, one folder per
``environment_key``, folders 0700 and files 0600) is one JSON header line (``Header``: the key,
the versions, the devices, the abstract values of the arguments, their donation and the
outputs, the payload's sha256) followed by the payload: the executable as
``jax.experimental.serialize_executable`` writes it, with its argument and output trees. The
payload is a pickle, so an entry is read only from a file this user owns that no one else can
write. Before a loaded program is used, the header must match the program asked for and the
loaded program must take and give what the header says (and a small one must run once on
zeros); an entry that fails any check is deleted and the program compiled again (one
WARNING). Several processes serving one model (hosts) keep nothing here. Each version of the
code writes a folder of its own; only the ``KEEP_ENVIRONMENTS`` most recently used folders are
kept (without this the folder grew by ~80 MB a configuration for every commit tested: 3.1 GB
in a day on the development machine).

``JAXSERVE_DISABLE_EXECUTABLE_CACHE=1`` turns the cache off: every program is compiled at
every start and nothing is read or written here.

JAX's persistent cache keeps none of these programs: on the CPU (jax 0.10.2) an executable it
loaded failed at its first call with "Function ... not found", whether re-serialized here or
used as loaded. While a program is compiled here, JAX's persistent cache writes nothing
(``jax_persistent_cache_min_compile_time_secs`` is a process-wide setting, so a compile of
other code on another thread meanwhile is not written either), and a program that it served
anyway (a cache shared with other code) is not saved here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import logging
import math
import os
import pathlib
import pickle
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.experimental import serialize_executable

logger = logging.getLogger("jaxserve.engine")

DISABLE_ENV = "JAXSERVE_DISABLE_EXECUTABLE_CACHE"
FORMAT = 1
_SOURCE_PACKAGES = ("jaxserve", "pallas_kernels")
# Folders of entries (versions of the code x device sets x JAX settings) kept; older ones are
# deleted. One run of the test suite alone uses several (fake device counts, JAX_ variables).
KEEP_ENVIRONMENTS = 16
# A loaded program whose arguments and results take at most this many bytes runs once on
# zeros before it is used (larger ones would need memory the engine has not planned for).
TRIAL_CALL_MAX_BYTES = 1 << 20

# Whether JAX's persistent cache served this thread's last compile (jax.monitoring's event).
_served_by_jax = threading.local()


def _on_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _served_by_jax.hit = True


jax.monitoring.register_event_listener(_on_event)

_MIN_COMPILE_TIME = "jax_persistent_cache_min_compile_time_secs"
_writes_off_lock = threading.Lock()
_writes_off_depth = 0
_writes_off_saved = 0.0


@contextlib.contextmanager
def _jax_cache_writes_off():
    """JAX's persistent cache writes no compile while any thread is inside (the setting is
    process-wide; the first to enter saves it, the last to leave restores it)."""
    global _writes_off_depth, _writes_off_saved
    with _writes_off_lock:
        if _writes_off_depth == 0:
            _writes_off_saved = getattr(jax.config, _MIN_COMPILE_TIME)
            jax.config.update(_MIN_COMPILE_TIME, math.inf)
        _writes_off_depth += 1
    try:
        yield
    finally:
        with _writes_off_lock:
            _writes_off_depth -= 1
            if _writes_off_depth == 0:
                jax.config.update(_MIN_COMPILE_TIME, _writes_off_saved)


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
    """A stable text of a value a program depends on: functions by qualified name and source
    hash (their repr holds an address), partials by function and arguments, meshes and
    shardings with their device ids (their repr has none), containers item by item, other
    values by repr."""
    if isinstance(value, functools.partial):
        return (f"partial({_describe(value.func)}, {_describe(value.args)}, "
                f"{_describe(value.keywords)})")
    if isinstance(value, jax.sharding.Mesh):
        return f"Mesh({dict(value.shape)}, {value.device_ids.tolist()})"
    if isinstance(value, jax.sharding.NamedSharding):
        return f"NamedSharding({_describe(value.mesh)}, {value.spec}, {value.memory_kind})"
    if isinstance(value, jax.sharding.Sharding):
        return f"{value!r} on {sorted(d.id for d in value.device_set)}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}({', '.join(_describe(v) for v in value)})"
    if callable(value) and hasattr(value, "__qualname__"):
        try:
            source = hashlib.sha256(inspect.getsource(value).encode()).hexdigest()[:16]
        except (OSError, TypeError):  # no Python source (a builtin)
            source = "-"
        return f"{value.__module__}.{value.__qualname__}@{source}"
    return repr(value)


def _aval(a) -> str:
    """'float32[2, 3]' for an abstract value (``jax.typeof`` of an argument, whose dtype is
    canonical: int64 is int32 without x64); '~' marks a weak type."""
    return f"{'~' if a.weak_type else ''}{a.dtype}{list(a.shape)}"


def _out_aval(info) -> str:
    """An output (``Compiled.out_info``'s ShapeDtypeStruct) with its sharding."""
    return f"{info.dtype}{list(info.shape)} {_describe(info.sharding)}"


class KeyedJit:
    """``jax.jit(fun, **settings)`` that keeps its settings, so that ``ExecutableCache`` keys
    a program by them rather than by the jit's internals.

    Args:
      fun: a module-level function, or a ``functools.partial`` of one whose arguments have a
        stable repr (dataclasses, numbers, dtypes, meshes, functions).
      settings: ``jax.jit``'s keyword arguments; static arguments go into ``fun`` as a
        partial, not as ``static_argnums``.

    Raises:
      TypeError: a setting that changes which arguments are leaves (static_arg*,
        donate_argnames).
    """

    def __init__(self, fun: Callable, **settings):
        if {"static_argnums", "static_argnames", "donate_argnames"} & settings.keys():
            raise TypeError("KeyedJit takes static arguments as a partial, and donate_argnums")
        self.fun, self.settings = fun, settings
        self.jitted = jax.jit(fun, **settings)

    def lower(self, *args) -> jax.stages.Lowered:
        return self.jitted.lower(*args)

    def donated(self, args: tuple) -> list[bool]:
        """Whether each leaf of args is donated (``donate_argnums``), in jax.tree order."""
        donate = self.settings.get("donate_argnums", ())
        donate = {donate} if isinstance(donate, int) else set(donate)
        return [i in donate for i, a in enumerate(args) for _ in jax.tree.leaves(a)]


def program_key(program: KeyedJit, args: tuple, options: dict | None) -> str | None:
    """sha256 hex naming the executable ``program.lower(*args).compile(options)`` would make in
    this environment; None in a process that is one of several hosts (the program is then
    compiled, not cached).

    Args:
      program: the jitted function with its settings.
      args: the positional arguments (arrays, ShapeDtypeStructs, numpy values, pytrees).
      options: XLA compiler options, or None.
    """
    if jax.process_count() > 1:
        return None  # several processes (hosts): each compiles its own part, never cached
    leaves, tree = jax.tree.flatten(args)
    avals = [(_aval(jax.typeof(x)), _describe(getattr(x, "sharding", None))) for x in leaves]
    text = repr((environment_key(), _describe(program.fun), _describe(program.settings),
                 str(tree), avals, sorted((options or {}).items())))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclasses.dataclass
class Header:
    """An entry's first line (JSON): what the payload must be to serve for ``key``."""

    format: int
    key: str
    jax: str
    jaxlib: str
    devices: list[int]  # the program's devices by id, in its order
    in_tree: str  # str of the argument tree, (args, kwargs)
    in_avals: list[str]  # _aval of each argument leaf
    donated: list[bool]
    out_avals: list[str]  # _out_aval of each output leaf
    payload_sha256: str

    @classmethod
    def expected(cls, key: str, program: KeyedJit, args: tuple) -> dict:
        """The fields an entry for these arguments must have, known before tracing."""
        return dict(format=FORMAT, key=key, jax=jax.__version__, jaxlib=jaxlib.__version__,
                    in_avals=[_aval(jax.typeof(x)) for x in jax.tree.leaves(args)],
                    donated=program.donated(args))


class BadEntry(Exception):
    """An entry that must not be served; the message says why."""


class ExecutableCache:
    """Compiled programs by ``program_key``, in ``directory`` (created when first written).

    Args:
      directory: where entries live, e.g. ``$JAXSERVE_CACHE/executables``; None, or the
        environment variable ``JAXSERVE_DISABLE_EXECUTABLE_CACHE=1``: compile every program,
        keep none.

    Attributes:
      hits: programs loaded from an entry so far.
    """

    def __init__(self, directory: str | os.PathLike | None):
        off = directory is None or os.environ.get(DISABLE_ENV) == "1"
        self.directory = None if off else pathlib.Path(directory)
        self.hits = 0
        self._lock = threading.Lock()

    def _path(self, program: KeyedJit, args, options) -> tuple[str, pathlib.Path] | None:
        key = None if self.directory is None else program_key(program, args, options)
        return None if key is None else (key, self._folder / f"{key}.jex")

    @functools.cached_property
    def _folder(self) -> pathlib.Path:
        """This environment's folder of entries (0700), marked as the latest used; the first
        call deletes the folders beyond the ``KEEP_ENVIRONMENTS`` most recently used."""
        folder = self.directory / environment_key()[:32]
        try:
            for d in (self.directory, folder):
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(d, 0o700)  # also a folder made before, or under another umask
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
            logger.warning("executable cache: %s (%s: %s)", self.directory, type(e).__name__, e)
        return folder

    def compile(self, program: KeyedJit, args: tuple = (), options: dict | None = None):
        """The ``jax.stages.Compiled`` of ``program`` for ``args``, on this thread: loaded
        from its entry when there is a good one, else compiled (and saved)."""
        entry = self._path(program, args, options)
        if entry is not None and entry[1].exists():
            return self._load(entry, program, args, options)
        return self._compile(entry, program, args, program.lower(*args), options)

    def submit(self, pool: Executor, program: KeyedJit, args: tuple,
               options: dict | None = None) -> Future:
        """``compile`` on ``pool``, but a program that is not in the cache is traced and
        lowered here first (tracing holds the GIL: done one after another on the caller's
        thread, it overlaps the compiles running on the pool)."""
        entry = self._path(program, args, options)
        if entry is not None and entry[1].exists():
            return pool.submit(self._load, entry, program, args, options)
        return pool.submit(self._compile, entry, program, args, program.lower(*args), options)

    def _load(self, entry: tuple[str, pathlib.Path], program: KeyedJit, args, options):
        key, path = entry
        try:
            compiled = _read(path, Header.expected(key, program, args))
        except Exception as e:  # noqa: BLE001 - a bad entry is compiled again
            logger.warning("executable cache: dropped %s (%s: %s); compiling it again",
                           path.name, type(e).__name__, e)
            path.unlink(missing_ok=True)
            return self._compile(entry, program, args, program.lower(*args), options)
        with self._lock:
            self.hits += 1
        return compiled

    def _compile(self, entry: tuple[str, pathlib.Path] | None, program: KeyedJit, args,
                 lowered: jax.stages.Lowered, options):
        _served_by_jax.hit = False
        with _jax_cache_writes_off():
            compiled = lowered.compile(options)
        if entry is None or _served_by_jax.hit:
            return compiled
        key, path = entry
        tmp = None
        try:
            payload = pickle.dumps(serialize_executable.serialize(compiled))
            header = Header(
                **Header.expected(key, program, args),
                devices=[d.id for d in compiled.runtime_executable().local_devices()],
                in_tree=str(compiled.in_tree),
                out_avals=[_out_aval(o) for o in jax.tree.leaves(compiled.out_info)],
                payload_sha256=hashlib.sha256(payload).hexdigest())
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Written whole (mkstemp: mode 0600) then renamed: another process starting
            # alongside never reads half.
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(dataclasses.asdict(header)).encode() + b"\n" + payload)
            os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001 - caching is an optimisation
            logger.warning("executable cache: not saved (%s: %s)", type(e).__name__, e)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
        return compiled


def _read(path: pathlib.Path, expected: dict) -> jax.stages.Compiled:
    """The program of the entry at path, checked against ``expected`` (``Header.expected``).

    Raises:
      BadEntry: the file is not this user's or others may write it, its header differs from
        ``expected``, its payload from the header's hash, or the loaded program from the
        header; or a small program failed its trial call.
      Exception: whatever JSON, pickle or JAX raise on a malformed entry.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise BadEntry(f"owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}; "
                           f"only this user's (uid {os.getuid()}) own entries are read")
        first, newline, payload = f.read().partition(b"\n")
    if not newline:
        raise BadEntry("no header line")
    header = Header(**json.loads(first))
    differ = [k for k, v in expected.items() if getattr(header, k) != v]
    if differ:
        raise BadEntry(f"header differs from the program asked for in {differ}")
    if hashlib.sha256(payload).hexdigest() != header.payload_sha256:
        raise BadEntry("payload does not match its hash")
    serialized, in_tree, out_tree = pickle.loads(payload)
    by_id = {d.id: d for d in jax.devices()}
    # The program's own devices, in its order: loaded onto any other set (the default is all
    # of them) XLA aborts the process (a TP=2 program among 4 devices).
    compiled = serialize_executable.deserialize_and_load(
        serialized, in_tree, out_tree, execution_devices=[by_id[i] for i in header.devices])
    loaded = dict(in_tree=str(compiled.in_tree),
                  in_avals=[_aval(a) for a in jax.tree.leaves(compiled.in_avals)],
                  donated=[a.donated for a in jax.tree.leaves(compiled.args_info)],
                  out_avals=[_out_aval(o) for o in jax.tree.leaves(compiled.out_info)])
    differ = [k for k, v in loaded.items() if getattr(header, k) != v]
    if differ:
        raise BadEntry(f"loaded program differs from its header in {differ}")
    _trial_call(compiled)
    return compiled


def _trial_call(compiled: jax.stages.Compiled) -> None:
    """Run a small program (``TRIAL_CALL_MAX_BYTES``) once on zeros: a program that loads but
    cannot run fails here, not while serving. Programs with weak-typed arguments are skipped
    (zeros of theirs would not match)."""
    ins, tree = jax.tree.flatten(compiled.in_avals[0])
    outs = jax.tree.leaves(compiled.out_info)
    size = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in [*ins, *outs])
    if size > TRIAL_CALL_MAX_BYTES or any(a.weak_type for a in ins):
        return
    # An argument the program does not use has no sharding (None): its zeros go anywhere.
    shardings = jax.tree.leaves(compiled.input_shardings[0], is_leaf=lambda s: s is None)
    zeros = [jnp.zeros(a.shape, a.dtype, device=s) for a, s in zip(ins, shardings)]
    try:
        jax.block_until_ready(compiled(*jax.tree.unflatten(tree, zeros)))
    except Exception as e:  # noqa: BLE001 - any failure to run makes the entry bad
        raise BadEntry(f"trial call failed ({type(e).__name__}: {e})") from e
