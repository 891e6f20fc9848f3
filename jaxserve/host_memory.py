"""The engine process's host memory: how much it holds, how much more it can have, and handing
back what start-up freed.

Start-up (loading a checkpoint, compiling or loading a dozen programs) allocates and frees a
few GiB in small blocks; glibc's allocator keeps freed heap pages mapped, so the process's RSS
stays at start-up's peak. ``release_freed`` asks it to return them (``malloc_trim``): the
default model's CPU engine drops from 4.7 to 4.0 GiB RSS (docs/performance.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

GIB = 2**30


def rss_bytes() -> int | None:
    """Resident set size of this process, bytes (Linux ``/proc``); None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _read_int(path: str) -> int | None:
    """The integer in a file of one (a cgroup's limit or usage); None if unreadable or
    unlimited ("max")."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _stat(path: str, key: str) -> int:
    """A cgroup memory.stat's entry ``key``, bytes (0 if absent)."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def available_bytes(root: str = "/sys/fs/cgroup", meminfo: str = "/proc/meminfo") -> int | None:
    """Host memory this process can still allocate, bytes (Linux): the kernel's MemAvailable,
    or less where the process's cgroup (v2 ``memory.max``, or v1 ``memory.limit_in_bytes``,
    under ``root``) allows less: its limit minus its usage, reclaimable file pages (the
    inactive ones) not counted as used. None where none of these can be read."""
    found = []
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage, stat, inactive in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
             "memory/memory.stat", "total_inactive_file")):
        cap, used = _read_int(f"{root}/{limit}"), _read_int(f"{root}/{usage}")
        if cap is not None and used is not None and cap < 2**62:  # v1's "no limit" is ~2**63
            found.append(max(cap - used + _stat(f"{root}/{stat}", inactive), 0))
    return min(found, default=None)


def release_freed() -> None:
    """Return freed heap pages to the OS where the C library is glibc; a no-op elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to trim
        return
    trim(0)


def describe(weights_bytes: int, kv_pool_bytes: int) -> str | None:
    """One start-up log line: the RSS and how it divides (weights and KV pool in host memory,
    the rest: compiled programs, the JAX runtime, the tokenizer, Python); None without an RSS."""
    rss = rss_bytes()
    if rss is None:
        return None
    g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    return (f"host memory: RSS {g(rss)}: weights {g(weights_bytes)}, KV pool "
            f"{g(kv_pool_bytes)}, the rest (compiled programs, runtime, tokenizer) "
            f"{g(max(rss - weights_bytes - kv_pool_bytes, 0))}")
