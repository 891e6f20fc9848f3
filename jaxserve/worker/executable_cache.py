"""A disk cache of compiled step executables, so that a warm start skips tracing, lowering and
compiling (JAX's persistent compilation cache skips only the last of the three, and tracing the
unrolled layer loop is most of a warm start's time).

An entry is the executable serialized by ``jax.experimental.serialize_executable`` with its
argument and result tree structures, stored under a key that names everything the program
depends on: the caller's description of the step (model config, shapes, buckets, dtypes, ...),
the jax and jaxlib versions, the backend and device kind, and a hash of this package's and the
kernels' source code (so an edited model or kernel never loads a stale program). A missing,
unreadable or incompatible entry is compiled again and rewritten.

Entries live in ``$JAXSERVE_CACHE/executables`` (default ``~/.cache/jaxserve/executables``).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import pickle
from collections.abc import Callable

import jax
import jaxlib
from jax.experimental.serialize_executable import deserialize_and_load, serialize

_PACKAGES = ("jaxserve", "pallas_kernels")


def cache_dir() -> pathlib.Path:
    root = os.environ.get("JAXSERVE_CACHE", os.path.expanduser("~/.cache/jaxserve"))
    return pathlib.Path(root) / "executables"


def _source_hash() -> str:
    h = hashlib.sha256()
    root = pathlib.Path(__file__).resolve().parents[2]
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def cache_key(description: dict) -> str:
    """A hex digest naming one compiled program. ``description`` must be JSON-serializable
    (``default=str`` is applied) and hold everything of the caller's that shapes the program."""
    device = jax.devices()[0]
    full = {"description": description, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "platform": device.platform, "device_kind": device.device_kind,
            "source": _source_hash()}
    return hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()


def load_or_compile(key: str, compile_fn: Callable[[], jax.stages.Compiled]):
    """The executable stored under ``key``, or ``compile_fn()`` (then stored under ``key``).

    Returns:
      (executable, loaded): ``loaded`` is True when it came from the cache.
    """
    path = cache_dir() / f"{key}.bin"
    try:
        payload, in_tree, out_tree = pickle.loads(path.read_bytes())
        return deserialize_and_load(payload, in_tree, out_tree), True
    except FileNotFoundError:
        pass
    except Exception:  # noqa: BLE001 - a corrupt or incompatible entry is compiled again
        path.unlink(missing_ok=True)
    # JAX's own persistent cache must not serve this compile: an executable that JAX loaded
    # from it serializes without all its code (on the CPU, loading ours then fails at the first
    # call with "Function ... not found"), so the step is compiled afresh once, here.
    previous = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        compiled = compile_fn()
    finally:
        jax.config.update("jax_enable_compilation_cache", previous)
    try:
        data = pickle.dumps(serialize(compiled))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)  # atomic: a concurrent reader sees the old entry or the whole new one
    except Exception:  # noqa: BLE001 - a backend that cannot serialize still serves
        pass
    return compiled, False
