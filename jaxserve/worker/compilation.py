"""Compilation of the step's programs ahead of time: the token buckets, the compile (or load
from the executable cache) of every program on a thread pool, and the memory peaks that size
the KV pool (``kv_sizing``).
"""

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed

from jaxserve.engine.kv_sizing import peak_program_bytes, program_bytes
from jaxserve.worker.executable_cache import ExecutableCache
from jaxserve.worker.programs import Programs


def powers_of_two_up_to(limit: int, start: int = 1) -> list[int]:
    """[start, 2 start, 4 start, ...] below limit, then limit itself."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


def decode_buckets(token_buckets: list[int], max_num_seqs: int) -> tuple[int, ...]:
    """The token buckets a step of only one-token decodes can take: each up to the first that
    holds max_num_seqs tokens (such a step has one token a sequence)."""
    limit = next((t for t in token_buckets if t >= max_num_seqs), token_buckets[-1])
    return tuple(t for t in token_buckets if t <= limit)


def memory_of(compiled) -> tuple[int, int]:
    """``kv_sizing.program_bytes`` of a compiled program; (0, 0) where the backend gives no
    memory analysis."""
    ma = compiled.memory_analysis()
    if ma is None:
        return 0, 0
    return program_bytes(ma.temp_size_in_bytes, ma.output_size_in_bytes,
                         ma.alias_size_in_bytes, getattr(ma, "generated_code_size_in_bytes", 0))


def profile_peak_bytes(executables: ExecutableCache, jitted: Programs, args: Programs,
                       step_options: Callable[[int], dict | None]) -> int:
    """``kv_sizing.peak_program_bytes`` of the programs that can need the most (the largest
    token bucket's step, the sampler of the most sequences, the page copy and the prompt
    log-probabilities), each compiled with its placeholder arguments ``args``."""
    t, s = max(jitted.step), max(jitted.filter)
    programs = [(jitted.step[t], args.step[t], step_options(t)),
                (jitted.filter[s], args.filter[s], None),
                (jitted.page_copy, args.page_copy, None),
                (jitted.prompt_logprobs, args.prompt_logprobs, None)]
    return peak_program_bytes([memory_of(executables.compile(*p)) for p in programs])


def compile_programs(executables: ExecutableCache, jitted: Programs, args: Programs,
                     step_options: Callable[[int], dict | None],
                     log: Callable[[str], None]) -> Programs:
    """Every program of ``jitted`` compiled with its placeholder arguments ``args`` (the steps
    with ``step_options(T)``), with a progress line each. A program in the executable cache is
    loaded from it on a pool of a thread per core; the others are traced and lowered one after
    another on this thread, and each lowered program is compiled (and saved to the cache) at
    once on that pool (XLA's compiler runs outside the GIL), so compiling overlaps the lowering
    of the next."""
    start = time.perf_counter()
    programs = {(field, n): (fn, args.get(field, n),
                             step_options(n) if field in ("step", "decode_step") else None)
                for field, n, fn in jitted.entries()}
    total, hits = len(programs), executables.hits
    num_steps, num_samplers = len(jitted.step) + len(jitted.decode_step), len(jitted.filter)
    compiled = []
    with ThreadPoolExecutor(min(total, os.cpu_count() or 1)) as pool:
        futures = {executables.submit(pool, *program): label
                   for label, program in programs.items()}
        log(f"{total} programs ({len(jitted.step)} token buckets, {len(jitted.decode_step)} "
            f"decode-only, {num_samplers} samplers, "
            f"{total - num_steps - num_samplers} others) traced, or found in the executable "
            f"cache, in {time.perf_counter() - start:.1f}s")
        for i, done in enumerate(as_completed(futures), 1):
            field, n = futures[done]
            compiled.append((field, n, done.result()))
            what = field if n is None else f"{field} {'tokens' if field.endswith('step') else 'seqs'}={n}"
            log(f"compiling (or loading from a cache): {i}/{total} ({what}) "
                f"{time.perf_counter() - start:.1f}s")
    log(f"{executables.hits - hits} of {total} programs came from the executable cache")
    # in the table's order, whatever order they finished in
    order = {label: i for i, label in enumerate(programs)}
    return Programs.of_entries(sorted(compiled, key=lambda e: order[e[0], e[1]]))
