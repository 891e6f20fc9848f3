"""KV pool sizing arithmetic (jaxserve/engine/kv_sizing.py), CPU and GPU paths; the LoRA pool and
host cache checked against the memory, and the host memory available that it reads."""

import pytest

from jaxserve.engine import kv_sizing as K

GIB = 2**30


def test_bytes_per_page_smollm_and_llama8b():
    # SmolLM2-135M float32: 30 layers, 3 KV heads, head_dim 64, page 16.
    assert K.kv_bytes_per_page(30, 3, 64, 16, 4) == 2 * 30 * 3 * 16 * 64 * 4 == 737_280
    # Llama-3.1-8B bf16: 32 layers, 8 KV heads, head_dim 128: 128 KiB per token.
    assert K.kv_bytes_per_page(32, 8, 128, 16, 2) == 16 * 128 * 1024


def test_cpu_pages_and_fit():
    per_page = K.kv_bytes_per_page(30, 3, 64, 16, 4)
    n = K.cpu_num_pages(0.25, per_page)
    assert n == (GIB // 4) // per_page == 364
    assert K.check_pool_fits(n, 16, 512, "raise --kv-cache-gib") == 363 // 32
    with pytest.raises(ValueError, match="--kv-cache-gib"):
        K.check_pool_fits(32, 16, 512, "raise --kv-cache-gib")  # 31 usable < 32 needed
    assert K.check_pool_fits(33, 16, 512, "x") == 1


def test_program_bytes_counts_only_unaliased_outputs():
    # KV pool outputs alias the donated inputs: only the sampled tokens count, and stay held.
    assert K.program_bytes(temp=500, output=10_000 + 64, alias=10_000, code=7) == (571, 64)
    assert K.program_bytes(temp=500, output=64, alias=0) == (564, 64)
    assert K.program_bytes(temp=0, output=10, alias=20) == (0, 0)


def test_peak_is_the_largest_program_while_the_previous_step_outputs_are_held():
    step, sampler, copy = (900, 300), (1_200, 10), (400, 0)
    # The sampler runs while a step's 300 bytes of logits wait: 1,200 + 300, not 900 + 300.
    assert K.peak_program_bytes([step, sampler, copy]) == 1_500
    assert K.peak_program_bytes([step]) == 1_200
    assert K.peak_program_bytes([]) == 0


def test_configure_allocator_respects_a_user_setting():
    env = {}
    assert K.configure_allocator(0.9, env) == 0.94 and env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.940000"
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"  # one allocator region (kv_sizing)
    assert K.configure_allocator(0.97, {}) == 0.98
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert K.configure_allocator(0.9, env) == 0.5 and env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


def test_peak_fit_problem_names_what_went_wrong():
    # The pool is in, but a program's peak no longer fits under the limit.
    problem = K.peak_fit_problem(125 * GIB, 126 * GIB, 2 * GIB)
    assert problem and "leaves 1.00 GiB" in problem and "programs need 2.00 GiB" in problem
    assert K.peak_fit_problem(125 * GIB, 128 * GIB, 2 * GIB) is None


def test_gpu_budget_h200_llama8b():
    total = 140 * GIB
    b = K.gpu_kv_budget(utilization=0.9, allocator_limit_bytes=int(0.9 * total), allocator_fraction=0.9,
                        in_use_bytes=15 * GIB, peak_bytes=3 * GIB)
    assert abs(b.total_bytes - total) <= 2
    assert abs(b.budget_bytes - int(0.9 * total)) <= 2
    assert b.headroom_bytes == GIB  # 2% of 126 GiB is over the 1 GiB cap
    assert abs(b.pool_bytes - (126 - 1 - 15 - 3) * GIB) <= 2
    per_page = K.kv_bytes_per_page(32, 8, 128, 16, 2)
    pages = K.num_pages_for_bytes(b.pool_bytes, per_page)
    assert pages == b.pool_bytes // per_page
    assert K.check_pool_fits(pages, 16, 131072, "x") == (pages - 1) // 8192
    assert "KV pool" in b.describe(0.9)


def test_gpu_budget_capped_by_allocator_limit():
    # The backend started with JAX's default 0.75 cap before the engine could raise it.
    total = 80 * GIB
    b = K.gpu_kv_budget(utilization=0.9, allocator_limit_bytes=int(0.75 * total), allocator_fraction=0.75,
                        in_use_bytes=GIB, peak_bytes=GIB)
    assert abs(b.total_bytes - total) <= 2 and b.budget_bytes == int(0.75 * total)
    assert b.headroom_bytes == K.HEADROOM_MAX_BYTES  # 2% of 60 GiB is over the cap
    # Lower utilization than the cap: utilization wins.
    b = K.gpu_kv_budget(utilization=0.5, allocator_limit_bytes=int(0.75 * total), allocator_fraction=0.75,
                        in_use_bytes=GIB, peak_bytes=GIB)
    assert abs(b.budget_bytes - 40 * GIB) <= 2


def test_gpu_small_device_headroom_is_two_percent():
    b = K.gpu_kv_budget(utilization=0.9, allocator_limit_bytes=int(0.9 * 16 * GIB), allocator_fraction=0.9,
                        in_use_bytes=GIB, peak_bytes=GIB)
    assert b.headroom_bytes == int(0.02 * b.budget_bytes) < K.HEADROOM_MAX_BYTES


def test_gpu_weights_too_big_leave_no_pages():
    b = K.gpu_kv_budget(utilization=0.3, allocator_limit_bytes=24 * GIB, allocator_fraction=0.3,
                        in_use_bytes=20 * GIB, peak_bytes=4 * GIB)
    assert b.pool_bytes < 0 and K.num_pages_for_bytes(b.pool_bytes, 4096) == 0
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        K.check_pool_fits(0, 16, 4096, "raise --gpu-memory-utilization or lower --max-model-len")


def test_fp8_page_counts_its_scales():
    # Llama-3-8B in FP8: 128 one-byte values and a 4-byte scale per token and KV head.
    assert K.kv_bytes_per_page(32, 8, 128, 16, 1, 4) == 2 * 32 * 8 * 16 * 132


def test_tensor_parallel_pool_is_what_the_fullest_device_can_hold():
    # 70B in bf16 over 2 H200s: each holds half the weights (~66 GiB); device 1 also holds
    # something else (2 GiB more in use). --gpu-memory-utilization applies to each device.
    limit = int(0.94 * 140 * GIB)
    b = K.smallest_kv_budget([(limit, 66 * GIB), (limit, 68 * GIB)], utilization=0.9,
                             allocator_fraction=0.94, peak_bytes=4 * GIB)
    assert b.in_use_bytes == 68 * GIB
    assert abs(b.pool_bytes - (int(0.9 * 140 * GIB) - GIB - 68 * GIB - 4 * GIB)) <= 2
    # Its pages, per device: Llama-3.1-70B's 8 KV heads split in two.
    per_page = K.kv_bytes_per_page(80, 8 // 2, 128, 16, 2)
    assert per_page == 2 * 80 * 4 * 16 * 128 * 2 == 2.5 * 2**20


# One LoRA slot of rank 16 on SmolLM2-135M in float32 (``lora.layers.slot_bytes``): per layer
# q/k/v 576 x 48 + 48 x 960, o 576 x 16 + 16 x 576, gate/up 576 x 32 + 32 x 3072, down
# 1536 x 16 + 16 x 576 values, 30 layers.
SLOT = 30 * (576 * 48 + 48 * 960 + 2 * 576 * 16 + 576 * 32 + 32 * 3072 + 1536 * 16 + 16 * 576) * 4


def test_lora_pool_and_host_cache_must_fit_the_memory():
    """--max-loras 100000 on the default model (an OOM kill before the check): refused naming
    the flags and the GiB; on the CPU the pool and the host cache share host memory, on a GPU
    the pool (a device's part of it) counts against the device's room, the cache the host's."""
    lora = dict(max_lora_rank=16, slot_bytes=SLOT)
    assert SLOT == 29_122_560
    assert K.lora_memory_problem(
        max_loras=100_000, max_cpu_loras=100_000, device_slot_bytes=SLOT, num_devices=1,
        device_room=None, host_room=16 * GIB, **lora) == (
        "--max-loras 100000 and --max-cpu-loras 100000 with --max-lora-rank 16: the LoRA pool "
        "(2712.25 GiB) and host cache (up to 2712.25 GiB) can take 5424.50 GiB of host memory, "
        "where 16.00 GiB is available beside the --kv-cache-gib KV pool; lower them or "
        "--max-lora-rank")
    assert K.lora_memory_problem(
        max_loras=100_000, max_cpu_loras=100_000, device_slot_bytes=SLOT // 2, num_devices=2,
        device_room=60 * GIB, host_room=100 * GIB, **lora) == (
        "--max-loras 100000 with --max-lora-rank 16: the LoRA pool takes 1356.12 GiB of each "
        "device's memory, where 60.00 GiB is left under --gpu-memory-utilization after the "
        "weights; lower --max-loras or --max-lora-rank")
    assert K.lora_memory_problem(
        max_loras=8, max_cpu_loras=100_000, device_slot_bytes=SLOT // 2, num_devices=2,
        device_room=60 * GIB, host_room=100 * GIB, **lora) == (
        "--max-cpu-loras 100000 with --max-lora-rank 16: the LoRA host cache can take "
        "2712.25 GiB of host memory, where 100.00 GiB is available; lower --max-cpu-loras or "
        "--max-lora-rank")
    # The edge of what fits (8 slots and 8 adapters on the host), and a host memory that
    # cannot be read (no check).
    cpu = dict(device_slot_bytes=SLOT, num_devices=1, device_room=None, **lora)
    assert K.lora_memory_problem(max_loras=8, max_cpu_loras=8, host_room=16 * SLOT, **cpu) is None
    assert K.lora_memory_problem(max_loras=8, max_cpu_loras=8, host_room=16 * SLOT - 1,
                                 **cpu) is not None
    assert K.lora_memory_problem(max_loras=10**6, max_cpu_loras=10**6, host_room=None,
                                 **cpu) is None


def test_host_memory_available_is_the_smaller_of_the_kernels_and_the_cgroups(tmp_path):
    """``host_memory.available_bytes`` (the host room of the LoRA check): MemAvailable, or a
    cgroup's limit less its usage (inactive file pages reclaimable) where that is less; v1's
    "no limit" and v2's "max" are no limit; nothing readable: None."""
    from jaxserve.host_memory import available_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   20000000 kB\n")
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    v2.mkdir()
    assert available_bytes(str(v2), str(meminfo)) == 20_000_000 * 1024
    (v2 / "memory.max").write_text("max\n")
    (v2 / "memory.current").write_text("1000\n")
    assert available_bytes(str(v2), str(meminfo)) == 20_000_000 * 1024
    (v2 / "memory.max").write_text(f"{4 * GIB}\n")
    (v2 / "memory.current").write_text(f"{3 * GIB}\n")
    (v2 / "memory.stat").write_text(f"anon 100\ninactive_file {GIB // 2}\n")
    assert available_bytes(str(v2), str(meminfo)) == GIB + GIB // 2
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    assert available_bytes(str(v1), str(meminfo)) == 20_000_000 * 1024
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    assert available_bytes(str(v1), str(meminfo)) == GIB
    assert available_bytes(str(tmp_path / "none"), str(tmp_path / "none")) is None
