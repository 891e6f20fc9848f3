"""KV pool sizing arithmetic (docs/design.md section 3), kept free of JAX so it can be unit tested.

CPU: ``--kv-cache-gib`` is the pool size.

GPU: ``--gpu-memory-utilization F`` is, as in vLLM, the fraction of the device's *total* memory
that the engine may use for weights, activations and KV pages together. JAX's BFC allocator caps
its pool at ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the total (0.75 unless set, with or without
preallocation), so the engine sets that variable to F + 0.04 (at most 0.98) before JAX
initialises its GPU backend (``allocator_fraction_env``). The slack above F is for the
allocator, not for us: on the H200, a Llama-3.1-8B pool planned to end 1 GiB short of an
allocator limit of exactly F x total ran out of memory on the first step (BFC fragmentation of
the many pool-sized blocks, and XLA's own scratch). The pool gets

    budget = min(F x total, allocator limit) - headroom
    pool   = budget - bytes in use after loading the weights - bytes of the largest step

where the largest step's bytes come from XLA's memory analysis of the compiled largest token
bucket (its temporaries plus outputs that do not alias the donated KV pool, plus its code), and
the headroom (2% of the budget, at most 1 GiB) absorbs allocator fragmentation and whatever the
analysis does not see. The CUDA context itself lives outside the BFC pool and is not counted
(vLLM counts it; here it is a few hundred MiB on top of F).
"""

from dataclasses import dataclass

GIB = 2**30
HEADROOM_FRACTION = 0.02
HEADROOM_MAX_BYTES = 1 * GIB
DEFAULT_XLA_MEM_FRACTION = 0.75  # JAX's own default for XLA_PYTHON_CLIENT_MEM_FRACTION
ALLOCATOR_SLACK = 0.04  # allocator limit above --gpu-memory-utilization, for fragmentation
MAX_ALLOCATOR_FRACTION = 0.98


def kv_bytes_per_page(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                      itemsize: int, scale_bytes: int = 0) -> int:
    """K and V of one page across all layers, bytes; ``scale_bytes`` per stored row (token and
    KV head) for an FP8 pool's scales."""
    return 2 * num_layers * num_kv_heads * page_size * (head_dim * itemsize + scale_bytes)


def pages_per_seq(max_model_len: int, page_size: int) -> int:
    return -(-max_model_len // page_size)


def cpu_num_pages(kv_cache_gib: float, bytes_per_page: int) -> int:
    """Pages of the pool, the null page included."""
    return int(kv_cache_gib * GIB) // bytes_per_page


def step_bytes_from_memory_analysis(temp: int, output: int, alias: int, code: int = 0) -> int:
    """Device bytes one step needs beyond its (already resident) arguments: temporaries, outputs
    that are not written in place into donated inputs, and the executable's code."""
    return temp + max(0, output - alias) + code


def allocator_fraction_env(utilization: float, environ: dict) -> float:
    """Set XLA_PYTHON_CLIENT_MEM_FRACTION to the utilization plus ALLOCATOR_SLACK (at most
    0.98) unless the user set it; returns the fraction in effect. Call before JAX initialises
    its GPU backend."""
    if "XLA_PYTHON_CLIENT_MEM_FRACTION" not in environ:
        fraction = min(utilization + ALLOCATOR_SLACK, MAX_ALLOCATOR_FRACTION)
        environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.6f}"
    return float(environ["XLA_PYTHON_CLIENT_MEM_FRACTION"])


@dataclass
class GpuKVBudget:
    total_bytes: int
    budget_bytes: int  # min(utilization x total, allocator limit)
    headroom_bytes: int
    in_use_bytes: int  # weights and anything else resident before the pool
    step_bytes: int  # the largest step's temporaries
    pool_bytes: int  # what is left for KV pages (may be negative)

    def describe(self, utilization: float) -> str:
        g = lambda b: f"{b / GIB:.2f} GiB"
        return (f"GPU memory: {utilization:g} x {g(self.total_bytes)} total -> budget "
                f"{g(self.budget_bytes)}; weights and resident arrays {g(self.in_use_bytes)}, "
                f"largest step {g(self.step_bytes)}, headroom {g(self.headroom_bytes)}; "
                f"KV pool {g(max(self.pool_bytes, 0))}")


def gpu_kv_budget(*, utilization: float, allocator_limit_bytes: int, allocator_fraction: float,
                  in_use_bytes: int, step_bytes: int) -> GpuKVBudget:
    """Bytes left for the KV pool on a GPU.

    Args:
      utilization: --gpu-memory-utilization, a fraction of total device memory.
      allocator_limit_bytes: the BFC allocator's limit as JAX reports it
        (``device.memory_stats()["bytes_limit"]``) = allocator_fraction x total memory.
      allocator_fraction: XLA_PYTHON_CLIENT_MEM_FRACTION in effect when the backend started.
      in_use_bytes: device bytes in use after loading the weights, before the pool.
      step_bytes: the largest step's extra bytes (``step_bytes_from_memory_analysis``).
    """
    total = int(allocator_limit_bytes / allocator_fraction)
    budget = min(int(utilization * total), allocator_limit_bytes)
    headroom = min(int(HEADROOM_FRACTION * budget), HEADROOM_MAX_BYTES)
    pool = budget - headroom - in_use_bytes - step_bytes
    return GpuKVBudget(total, budget, headroom, in_use_bytes, step_bytes, pool)


def smallest_kv_budget(devices: list[tuple[int, int]], *, utilization: float,
                       allocator_fraction: float, step_bytes: int) -> GpuKVBudget:
    """The budget of the device with the least room for the pool, of ``devices`` given as
    (allocator limit, bytes in use) pairs: with tensor parallelism --gpu-memory-utilization
    applies to each device, and the pool has the same pages on all of them."""
    budgets = [gpu_kv_budget(utilization=utilization, allocator_limit_bytes=limit,
                             allocator_fraction=allocator_fraction, in_use_bytes=in_use,
                             step_bytes=step_bytes) for limit, in_use in devices]
    return min(budgets, key=lambda b: b.pool_bytes)


def num_pages_for_bytes(pool_bytes: int, bytes_per_page: int) -> int:
    """Pages that fit in pool_bytes, the null page included (0 when nothing fits)."""
    return max(pool_bytes, 0) // bytes_per_page


def check_pool_fits(num_pages: int, page_size: int, max_model_len: int, flag_hint: str) -> int:
    """How many max_model_len sequences fit in the pool's usable pages (page 0 is the null page).

    Raises:
      ValueError: not even one; the message names the flag to change (``flag_hint``, e.g.
        "raise --kv-cache-gib or lower --max-model-len").
    """
    usable = max(num_pages - 1, 0)
    per_seq = pages_per_seq(max_model_len, page_size)
    if usable < per_seq:
        raise ValueError(
            f"the KV cache has room for {usable} pages of {page_size} tokens "
            f"({usable * page_size} tokens), but one {max_model_len}-token sequence needs "
            f"{per_seq} pages: {flag_hint}"
        )
    return usable // per_seq
