"""KV pool sizing arithmetic (docs/architecture.md, "Pool sizing"), kept free of JAX so it can be
unit tested.

CPU: ``--kv-cache-gib`` is the pool size.

GPU: ``--gpu-memory-utilization F`` is, as in vLLM, the fraction of the device's *total* memory
that the engine may use for weights, activations and KV pages together. JAX's BFC allocator caps
its pool at ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the total (0.75 unless set), so the engine sets
that variable to F + 0.04 (at most 0.98) before JAX initialises its GPU backend, and keeps JAX's
preallocation on (``configure_allocator``). The slack above F is for the allocator, not for us:
on the H200, a Llama-3.1-8B pool planned to end 1 GiB short of an allocator limit of exactly
F x total ran out of memory on the first step. Preallocation makes the allocator's memory one
region: grown on demand instead, it is a series of regions, and a pool of one layer's K (or V)
pages cannot span two of them, so up to one such array per region is stranded (the default
model's 2.07 GiB layers on the H200: 120.2 of 124.4 GiB allocated under a 131.4 GiB limit,
and the arrays that did not fit came back sharing another array's memory, with no error).
The pool gets

    budget = min(F x total, allocator limit) - headroom
    pool   = budget - bytes in use after loading the weights - peak bytes of the programs

where a program's bytes come from XLA's memory analysis (``program_bytes``) and the peak is
``peak_program_bytes`` over every program the engine runs, compiled against the pool it will
run with; the headroom (2% of the budget, at most 1 GiB) absorbs allocator fragmentation and
whatever the analysis does not see. The CUDA context itself lives outside the BFC pool and is
not counted (vLLM counts it; here it is a few hundred MiB on top of F).

LoRA (``--enable-lora``, docs/lora.md): the adapters' device pool is allocated with the weights,
so on a GPU it is part of the bytes in use above. Before it is allocated,
``lora_memory_problem`` checks that it fits (on a GPU, what the budget leaves after the weights;
on the CPU, host memory beside the ``--kv-cache-gib`` pool), and that the host cache of
``--max-cpu-loras`` adapters fits host memory: flags too large for the machine fail at start-up
naming the flags, not in an allocation that the kernel answers by killing the process.
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


def program_bytes(temp: int, output: int, alias: int, code: int = 0) -> tuple[int, int]:
    """(bytes a program needs while it runs beyond its resident arguments, bytes of its
    outputs that stay allocated after it) from XLA's memory analysis: temporaries and code,
    plus outputs that are not written in place into donated inputs (the KV pool is)."""
    held = max(0, output - alias)
    return temp + code + held, held


def peak_program_bytes(programs: list[tuple[int, int]]) -> int:
    """Device bytes the engine needs beyond its resident arrays, for ``program_bytes`` pairs of
    every program it runs: the largest program's, while the outputs of the step before it are
    still held (async scheduling runs a step while the previous one's logits wait for the
    sampler). 0 for no programs."""
    if not programs:
        return 0
    return max(run for run, _ in programs) + max(held for _, held in programs)


def configure_allocator(utilization: float, environ: dict) -> float:
    """Set XLA_PYTHON_CLIENT_MEM_FRACTION to the utilization plus ALLOCATOR_SLACK (at most
    0.98) and XLA_PYTHON_CLIENT_PREALLOCATE to true, each unless the user set it; returns the
    fraction in effect. Call before JAX initialises its GPU backend."""
    environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
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
    peak_bytes: int  # the programs' peak (peak_program_bytes)
    pool_bytes: int  # what is left for KV pages (may be negative)

    def describe(self, utilization: float) -> str:
        g = lambda b: f"{b / GIB:.2f} GiB"
        return (f"GPU memory: {utilization:g} x {g(self.total_bytes)} total -> budget "
                f"{g(self.budget_bytes)}; weights and resident arrays {g(self.in_use_bytes)}, "
                f"programs' peak {g(self.peak_bytes)}, headroom {g(self.headroom_bytes)}; "
                f"KV pool {g(max(self.pool_bytes, 0))}")


def gpu_kv_budget(*, utilization: float, allocator_limit_bytes: int, allocator_fraction: float,
                  in_use_bytes: int, peak_bytes: int) -> GpuKVBudget:
    """Bytes left for the KV pool on a GPU.

    Args:
      utilization: --gpu-memory-utilization, a fraction of total device memory.
      allocator_limit_bytes: the BFC allocator's limit as JAX reports it
        (``device.memory_stats()["bytes_limit"]``) = allocator_fraction x total memory.
      allocator_fraction: XLA_PYTHON_CLIENT_MEM_FRACTION in effect when the backend started.
      in_use_bytes: device bytes in use after loading the weights, before the pool.
      peak_bytes: the programs' peak bytes (``peak_program_bytes``).
    """
    total = int(allocator_limit_bytes / allocator_fraction)
    budget = min(int(utilization * total), allocator_limit_bytes)
    headroom = min(int(HEADROOM_FRACTION * budget), HEADROOM_MAX_BYTES)
    pool = budget - headroom - in_use_bytes - peak_bytes
    return GpuKVBudget(total, budget, headroom, in_use_bytes, peak_bytes, pool)


def smallest_kv_budget(devices: list[tuple[int, int]], *, utilization: float,
                       allocator_fraction: float, peak_bytes: int) -> GpuKVBudget:
    """The budget of the device with the least room for the pool, of ``devices`` given as
    (allocator limit, bytes in use) pairs: with tensor parallelism --gpu-memory-utilization
    applies to each device, and the pool has the same pages on all of them."""
    budgets = [gpu_kv_budget(utilization=utilization, allocator_limit_bytes=limit,
                             allocator_fraction=allocator_fraction, in_use_bytes=in_use,
                             peak_bytes=peak_bytes) for limit, in_use in devices]
    return min(budgets, key=lambda b: b.pool_bytes)


def peak_fit_problem(in_use: int, limit: int, peak_bytes: int) -> str | None:
    """What is wrong, if anything, once the pool is allocated on a device whose allocator holds
    ``in_use`` bytes under ``limit``: the programs' peak no longer fits. None when it does."""
    g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    if in_use + peak_bytes > limit:
        return (f"the KV pool leaves {g(limit - in_use)} under the allocator's limit, and the "
                f"programs need {g(peak_bytes)} at their peak")
    return None


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


def lora_memory_problem(*, max_loras: int, max_cpu_loras: int, max_lora_rank: int,
                        slot_bytes: int, device_slot_bytes: int, num_devices: int,
                        device_room: int | None, host_room: int | None) -> str | None:
    """What is wrong, if anything, with the memory LoRA's adapters take: the device pool,
    ``max_loras`` slots of ``device_slot_bytes`` on each of ``num_devices`` devices, and the
    host cache, up to ``max_cpu_loras`` adapters of ``slot_bytes`` (``layers.slot_bytes``).
    None when they fit.

    Args:
      device_room: bytes the pool may take on each device (a GPU's budget left after the
        weights, on the device with the least); None on the CPU, where the devices' memory is
        host memory and the pool counts against ``host_room``.
      host_room: host memory available to the engine, bytes (on the CPU, less the KV pool to
        come); None where unknown (no check).
    """
    g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    pool, cache = max_loras * device_slot_bytes, max_cpu_loras * slot_bytes
    rank = f"with --max-lora-rank {max_lora_rank}"
    if device_room is None:  # the CPU: the pool is host memory too
        on_host = pool * num_devices + cache
        what = (f"--max-loras {max_loras} and --max-cpu-loras {max_cpu_loras} {rank}: the LoRA "
                f"pool ({g(pool * num_devices)}) and host cache (up to {g(cache)}) can take "
                f"{g(on_host)}")
        beside, lower = " beside the --kv-cache-gib KV pool", "them"
    elif pool > device_room:
        return (f"--max-loras {max_loras} {rank}: the LoRA pool takes {g(pool)} of each "
                f"device's memory, where {g(device_room)} is left under "
                "--gpu-memory-utilization after the weights; lower --max-loras or "
                "--max-lora-rank")
    else:
        on_host = cache
        what = f"--max-cpu-loras {max_cpu_loras} {rank}: the LoRA host cache can take {g(cache)}"
        beside, lower = "", "--max-cpu-loras"
    if host_room is not None and on_host > host_room:
        return (f"{what} of host memory, where {g(host_room)} is available{beside}; lower "
                f"{lower} or --max-lora-rank")
    return None
