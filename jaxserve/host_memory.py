"""The engine process's host memory: how much it holds, and handing back what start-up freed.

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
