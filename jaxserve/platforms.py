"""What depends on the JAX backend, in one place (vLLM's ``vllm/platforms``).

``current_platform()`` is the Platform of the backend JAX runs on; the engine reads the device
defaults (scheduler limits, dtype, attention backend, token buckets, how the KV pool is sized)
from it, and EngineConfig's help texts state them from ``CPU`` and ``GPU``. Imports no JAX at
module level, so the CLI can read the defaults without starting a backend.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Platform:
    """The defaults and capabilities of one JAX backend.

    Attributes:
      name: the backend's name, as ``jax.default_backend()`` returns it.
      max_num_seqs: --max-num-seqs left unset.
      max_num_batched_tokens: --max-num-batched-tokens left unset.
      max_model_len: cap on --max-model-len left unset (tokens); None: the model's
        max_position_embeddings.
      dtype: --dtype auto (the weights'; the KV pool's with --kv-cache-dtype auto).
      attention_backend: --attention-backend auto ("pallas" or "reference").
      interpret_pallas: the Pallas kernels run in interpret mode (slow; for tests).
      moe_grouped_gemm: the MoE layers' expert GEMMs (``moe.GROUPED_GEMMS``): "ragged_dot"
        (XLA's ``jax.lax.ragged_dot``) or "pallas" (``pallas_kernels.grouped_matmul``).
      min_token_bucket: smallest token bucket the model runner compiles (tokens).
      branch_free_step: the step is compiled without control flow (an XLA conditional on a GPU
        blocks the dispatching thread).
      op_by_op_min_tokens: token buckets from this size compile without XLA command buffers
        (``ModelRunner._compiler_options``); None: the backend has none.
      fp8_step_options: XLA options (name, value) of a step whose linear weights are FP8
        (``--quantization fp8``).
      decode_steps: the small token buckets get a second step for steps of one-token decodes
        only (``compilation.decode_buckets``), whose attention skips the ragged-prefill
        kernel's launch (``decode_only``): 0.25 ms of a 4.2 ms step at batch 1 on the H200;
        the CPU's reference attention launches nothing to skip.
      stacked_kv_pool: the KV pool is one array stacked by layer, and the step runs the layers
        as a loop over it (one layer's kernels in the program instead of L: host memory and
        compile time on the CPU; docs/architecture.md, "The layer loop"), where the step may
        branch and its attention is the reference; False: a pool per layer and the layers
        unrolled.
      device_memory: arrays live in the device's own memory, which --gpu-memory-utilization
        budgets (the KV pool is sized from it, against the programs' profiled peak); False:
        in host memory, and --kv-cache-gib sizes the pool.
    """

    name: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    dtype: str
    attention_backend: str
    interpret_pallas: bool
    moe_grouped_gemm: str
    min_token_bucket: int
    branch_free_step: bool
    op_by_op_min_tokens: int | None
    device_memory: bool
    stacked_kv_pool: bool
    fp8_step_options: tuple[tuple[str, object], ...] = ()
    decode_steps: bool = False

    def default_max_model_len(self, max_position_embeddings: int) -> int:
        """--max-model-len left unset, for a model of ``max_position_embeddings`` (tokens)."""
        if self.max_model_len is None:
            return max_position_embeddings
        return min(max_position_embeddings, self.max_model_len)


CPU = Platform(
    name="cpu", max_num_seqs=32, max_num_batched_tokens=512, max_model_len=4096,
    dtype="float32", attention_backend="reference", interpret_pallas=True,
    moe_grouped_gemm="ragged_dot", min_token_bucket=1,
    branch_free_step=False, op_by_op_min_tokens=None, device_memory=False,
    stacked_kv_pool=True)

# Scheduler limits measured on the H200 with the 8B shape (docs/performance.md): 256 sequences
# kept decode near its best without preempting at e2e-1k1k scale (512 was no faster and
# preempted), and a larger token budget shortens the prefill phase. A step of 1-8 tokens costs
# what a step of 16 does (matmul and attention tiles have at least 16 rows; a step reads the
# weights once either way), so smaller buckets would only add programs to compile at start-up.
# FP8 dots: XLA autotunes Triton GEMM fusions for them against cuBLASLt and picks cuBLASLt's
# FP8 GEMM anyway; the autotuning took 181 s to compile four 8B layers at 8,192 tokens, without
# Triton GEMMs 0.5 s, and the program ran as fast (13.8 vs 13.7 ms; H200, 2026-12-04).
# MoE grouped GEMMs: the Pallas kernel beats XLA's ragged_dot at every step size of
# scripts/bench_moe.py on the H200 (1.0-4.4x at Mixtral's shapes, 1.8-33x at Qwen3-30B-A3B's).
GPU = Platform(
    name="gpu", max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=None,
    dtype="bfloat16", attention_backend="pallas", interpret_pallas=False,
    moe_grouped_gemm="pallas", min_token_bucket=16,
    branch_free_step=True, op_by_op_min_tokens=512, device_memory=True, stacked_kv_pool=False,
    fp8_step_options=(("xla_gpu_enable_triton_gemm", False),), decode_steps=True)

PLATFORMS = {p.name: p for p in (CPU, GPU)}


def current_platform() -> Platform:
    """The Platform of JAX's default backend (starts it).

    Raises:
      RuntimeError: a backend other than cpu and gpu.
    """
    import jax  # here, so that reading CPU and GPU never starts a backend

    name = jax.default_backend()
    if name not in PLATFORMS:
        raise RuntimeError(f"unsupported JAX backend {name!r} (supported: {', '.join(PLATFORMS)})")
    return PLATFORMS[name]
