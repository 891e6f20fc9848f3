"""ModelRunner: applies a SchedulerOutput to its persistent InputBatch, builds the step's padded
inputs with vectorized numpy, and dispatches the compiled step.

One step = one call of a compiled executable, without control flow on the GPU (an XLA
conditional there blocks the dispatching thread): model forward over the ragged batch, KV write into the
donated pool, and greedy or plain-temperature sampling; in steps with top-k/top-p rows a second
executable (one per sequence count S) draws those rows. ``execute`` only dispatches;
``get_output`` waits for the sampled tokens. Between the two the host is free (async scheduling schedules and dispatches the next
step there): a token the host does not know yet is read by the next step straight from the
previous step's sampled array on the device. Token counts T come from a fixed list of buckets (powers of two
up to max_num_batched_tokens, from 16 on a GPU); the sequence count is S = min(T, max_num_seqs), and the block
table always has the width P of a max_model_len sequence. Attention reads pages only as far as
each sequence's length reaches, so its cost follows the real contexts, not P; that keeps the
number of compiled shapes to the token buckets alone (docs/design.md section 3; P buckets were
tried and multiplied start-up compilation). Every program is compiled ahead of time by
``compile_buckets``; ``execute`` never compiles (it raises if asked to).
"""

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.config import ModelConfig
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.models import llama, sharding
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.sampler import (
    SamplingMetadata,
    filtered_rows,
    sample_filtered,
    sample_unfiltered,
)
from pallas_kernels import kv_quant


def powers_of_two_up_to(limit: int, start: int = 1) -> list[int]:
    """[start, 2 start, 4 start, ...] below limit, then limit itself."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


# Smallest token bucket off the CPU. On a GPU a step of 1-8 tokens costs what a step of 16
# does (matmul and attention tiles have at least 16 rows; a step reads the weights once either
# way), so smaller buckets would only add programs to compile at start-up (docs/performance.md).
MIN_GPU_TOKEN_BUCKET = 16


def _bucket(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def _step(config, attention_fn, mesh, max_num_seqs, branch_free, params, token_ids, prev_rows,
          prev_sampled, md, k_cache, v_cache, logits_indices, sm):
    """prev_rows[T]: for each input token, the row of ``prev_sampled`` (the previous step's
    sampled tokens) that holds it, or -1 to take ``token_ids``. Returns the greedy and plain
    rows' tokens padded to [max_num_seqs] (so that the next step's prev_sampled has one shape
    in every bucket), the logits [S, V] for ``_filter`` and the updated KV pool.
    ``branch_free``: no control flow (the GPU; see the sampler's module docstring). ``mesh``:
    the tensor-parallel mesh (None: one device)."""
    token_ids = jnp.where(prev_rows >= 0, prev_sampled[jnp.maximum(prev_rows, 0)], token_ids)
    logits, k_cache, v_cache = llama.forward(
        config, params, token_ids, md, k_cache, v_cache, logits_indices, attention_fn=attention_fn,
        mesh=mesh)
    sampled = sample_unfiltered(logits, sm, branch_free=branch_free)
    return jnp.pad(sampled, (0, max_num_seqs - sampled.shape[0])), logits, k_cache, v_cache


def _filter(logits, sampled, sm):
    """The step's tokens ([max_num_seqs]) with its top-k / top-p rows drawn (a step's S rows
    come first)."""
    s = logits.shape[0]
    return sampled.at[:s].set(sample_filtered(logits, sampled[:s], sm))


@dataclass
class StepHandle:
    """A dispatched step: its counter, its sampled tokens (on the device until ``get_output``),
    and which rows hold a request's next token."""

    step: int
    sampled: jax.Array
    rows: np.ndarray
    req_ids: list[str]


class ModelRunner:
    """Owns the parameters, the KV pool and the compiled step of each bucket.

    Args:
      config: model shapes.
      params: the model's params, one dict per layer (``jaxserve.models.llama``), on the device,
        or split over ``mesh``.
      page_size: tokens per page.
      max_num_seqs, max_num_batched_tokens, max_model_len: scheduler limits (tokens/sequences).
      kv_dtype: dtype of the KV pool (float8_e4m3fn: ``pallas_kernels.kv_quant``'s FP8 pool).
      attention_fn: pallas_kernels attention entry point.
      branch_free: compile the step without control flow; default: on any backend but the CPU
        (a GPU conditional blocks the dispatching thread; the module docstring says more).
      mesh: the tensor-parallel mesh (``jaxserve.models.sharding``) that params are split over;
        the KV pool is split by KV head over it, the step's other inputs and outputs are
        replicated. None: one device, the default.
    """

    def __init__(
        self,
        config: ModelConfig,
        params: dict,
        *,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        kv_dtype,
        attention_fn: Callable,
        branch_free: bool | None = None,
        mesh: Mesh | None = None,
    ):
        self.config = config
        self.mesh = mesh
        self.layout = sharding.Layout.of(config, sharding.mesh_size(mesh))
        self.params = params
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        on_cpu = jax.default_backend() == "cpu"
        self.token_buckets = powers_of_two_up_to(
            max_num_batched_tokens, 1 if on_cpu else MIN_GPU_TOKEN_BUCKET)
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.kv_dtype = kv_dtype
        self.k_cache = self.v_cache = None  # allocate_kv_cache, once the pool is sized
        self.input_batch = InputBatch(max_num_seqs, max_model_len, self.max_pages_per_seq)
        if branch_free is None:
            branch_free = not on_cpu
        step = partial(_step, config, attention_fn, mesh, max_num_seqs, branch_free)
        # Everything but the params and the pool is replicated over the mesh (None: one device).
        self._replicated = None if mesh is None else sharding.replicated(mesh)
        if mesh is None:
            self._jitted = jax.jit(step, donate_argnums=(5, 6))
            self._filter_jitted = jax.jit(_filter)
        else:
            # Params as split by the Megatron layout, the pool by KV head.
            rep, kv = self._replicated, sharding.kv_sharding(mesh)
            self._jitted = jax.jit(
                step, donate_argnums=(5, 6),
                in_shardings=(sharding.param_shardings(params, mesh), rep, rep, rep, rep, kv, kv,
                              rep, rep),
                out_shardings=(rep, rep, kv, kv))
            self._filter_jitted = jax.jit(_filter, in_shardings=rep, out_shardings=rep)
        self._prev_sampled = jnp.zeros(max_num_seqs, jnp.int32, device=self._replicated)
        self._compiled: dict[int, Callable] = {}
        self._filter_compiled: dict[int, Callable] = {}  # by S
        self._step_count = 0

    def _kv_pool(self, num_pages: int):
        """(shape [KV, num_pages, page_size, D] of one layer's K (or V) pool, KV the layout's,
        and its sharding: split over the mesh by KV head, None on one device)."""
        c = self.config
        shape = (self.layout.num_kv_heads, num_pages, self.page_size, c.head_dim)
        return shape, None if self.mesh is None else sharding.kv_sharding(self.mesh)

    def allocate_kv_cache(self, num_pages: int) -> None:
        """Allocate the (zeroed) K and V pools of num_pages pages, page 0 included; on a mesh
        each device allocates only its KV heads."""
        shape, where = self._kv_pool(num_pages)
        layers = range(self.config.num_layers)
        self.k_cache = [kv_quant.pool_zeros(shape, self.kv_dtype, where) for _ in layers]
        self.v_cache = [kv_quant.pool_zeros(shape, self.kv_dtype, where) for _ in layers]

    def profile_step_bytes(self, num_pages: int) -> int:
        """Device bytes the largest token bucket's step needs beyond its arguments, from XLA's
        memory analysis of that bucket compiled against a pool of num_pages pages (described
        by shapes only: nothing is allocated). On a mesh, the bytes of one device (XLA analyses
        the partitioned program). 0 if the backend gives no analysis."""
        from jaxserve.engine.kv_sizing import step_bytes_from_memory_analysis

        shape, where = self._kv_pool(num_pages)
        kv = [kv_quant.pool_struct(shape, self.kv_dtype, where)] * self.config.num_layers
        inputs = self._dummy_inputs(self.token_buckets[-1])
        compiled = self._jitted.lower(self.params, *inputs[:4], kv, kv, *inputs[4:]).compile()
        ma = compiled.memory_analysis()
        if ma is None:
            return 0
        return step_bytes_from_memory_analysis(
            ma.temp_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes,
            getattr(ma, "generated_code_size_in_bytes", 0),
        )

    def num_seqs_for(self, num_tokens_bucket: int) -> int:
        return min(num_tokens_bucket, self.max_num_seqs)

    def _dummy_inputs(self, t: int):
        s, p = self.num_seqs_for(t), self.max_pages_per_seq
        zeros_t = np.zeros(t, np.int32)
        md = llama.AttentionMetadata(
            positions=zeros_t, slot_mapping=zeros_t,
            query_start_loc=np.zeros(s + 1, np.int32), seq_lens=np.zeros(s, np.int32),
            block_tables=np.zeros((s, p), np.int32),
        )
        sm = SamplingMetadata(
            temperature=np.zeros(s, np.float32), top_k=np.zeros(s, np.int32),
            top_p=np.ones(s, np.float32), seeds=np.zeros(s, np.uint32), steps=np.zeros(s, np.int32),
        )
        return (zeros_t, np.full(t, -1, np.int32), np.zeros(self.max_num_seqs, np.int32), md,
                np.zeros(s, np.int32), sm)

    def compile_buckets(self, log: Callable[[str], None] = print) -> None:
        """Compile the step for every token bucket and the top-k/top-p sampler for every
        sequence count, with a progress line each. Tracing and lowering (Python) go one program
        after another on this thread; each lowered program is compiled at once by a pool of a
        thread per core (XLA's compiler runs outside the GIL), so compiling overlaps the
        lowering of the next. JAX's persistent compilation cache serves the compiles of a later
        start."""
        start = time.perf_counter()
        vocab = self.config.vocab_size
        seq_counts = sorted({self.num_seqs_for(t) for t in self.token_buckets})
        total = len(self.token_buckets) + len(seq_counts)
        with ThreadPoolExecutor(min(total, os.cpu_count() or 1)) as pool:
            futures = {}
            for t in self.token_buckets:
                inputs = self._dummy_inputs(t)
                lowered = self._jitted.lower(
                    self.params, *inputs[:4], self.k_cache, self.v_cache, *inputs[4:])
                futures[pool.submit(lowered.compile)] = ("step", t)
            for s in seq_counts:
                logits = jax.ShapeDtypeStruct((s, vocab), jnp.float32, sharding=self._replicated)
                lowered = self._filter_jitted.lower(logits, self._prev_sampled,
                                                    self._dummy_inputs(s)[5])
                futures[pool.submit(lowered.compile)] = ("filter", s)
            log(f"traced and lowered {total} programs ({len(self.token_buckets)} token buckets, "
                f"{len(seq_counts)} samplers) in {time.perf_counter() - start:.1f}s")
            for i, done in enumerate(as_completed(futures), 1):
                kind, n = futures[done]
                (self._compiled if kind == "step" else self._filter_compiled)[n] = done.result()
                log(f"compiling (or loading from the cache): {i}/{total} "
                    f"({kind} {'tokens' if kind == 'step' else 'seqs'}={n}) "
                    f"{time.perf_counter() - start:.1f}s")

    def execute(self, sched: SchedulerOutput) -> StepHandle | None:
        """Apply the step's changes to the InputBatch and dispatch the step (no wait). None if
        nothing is scheduled.

        Raises:
          RuntimeError: the step's token bucket was not compiled at start-up, or a token the
            host does not know is not the previous step's (a scheduling bug).
        """
        b = self.input_batch
        b.update_states(sched)
        n_tok = sched.total_num_scheduled_tokens
        if n_tok == 0:
            return None
        req_ids = list(sched.num_scheduled_tokens)
        n_seq = len(req_ids)
        t = _bucket(self.token_buckets, n_tok)
        s = self.num_seqs_for(t)
        ps = self.page_size
        slots = np.fromiter((b.req_index[r] for r in req_ids), np.int32, n_seq)
        counts = np.fromiter(sched.num_scheduled_tokens.values(), np.int32, n_seq)
        computed = b.num_computed_tokens[slots]
        ends = np.cumsum(counts, dtype=np.int32)
        seq_of_tok = np.repeat(np.arange(n_seq, dtype=np.int32), counts)
        tok_slot = slots[seq_of_tok]
        pos = computed[seq_of_tok] + np.arange(n_tok, dtype=np.int32) - (ends - counts)[seq_of_tok]
        unknown = pos >= b.num_tokens[tok_slot]
        if unknown.any() and (b.in_flight_step[tok_slot[unknown]] != self._step_count - 1).any():
            raise RuntimeError("a scheduled token is neither known nor sampled by the last step")

        token_ids = np.zeros(t, np.int32)
        token_ids[:n_tok] = np.where(unknown, 0, b.token_ids[tok_slot, pos])
        prev_rows = np.full(t, -1, np.int32)
        prev_rows[:n_tok] = np.where(unknown, b.in_flight_row[tok_slot], -1)
        positions = np.zeros(t, np.int32)
        positions[:n_tok] = pos
        slot_mapping = np.zeros(t, np.int32)  # padding writes to the null page
        slot_mapping[:n_tok] = b.block_table[tok_slot, pos // ps] * ps + pos % ps
        qsl = np.full(s + 1, n_tok, np.int32)
        qsl[0] = 0
        qsl[1 : n_seq + 1] = ends
        seq_lens = np.zeros(s, np.int32)
        seq_lens[:n_seq] = computed + counts
        block_tables = np.zeros((s, self.max_pages_per_seq), np.int32)
        block_tables[:n_seq] = b.block_table[slots]
        logits_indices = np.zeros(s, np.int32)
        logits_indices[:n_seq] = ends - 1

        def per_seq(values, fill, dtype):
            out = np.full(s, fill, dtype)
            out[:n_seq] = values
            return out

        sm = SamplingMetadata(
            temperature=per_seq(b.temperature[slots], 0, np.float32),
            top_k=per_seq(b.top_k[slots], 0, np.int32),
            top_p=per_seq(b.top_p[slots], 1, np.float32),
            seeds=per_seq(b.seeds[slots], 0, np.uint32),
            # tokens generated before the one sampled now: its position minus the prompt
            steps=per_seq(seq_lens[:n_seq] - b.num_prompt_tokens[slots], 0, np.int32),
        )
        md = llama.AttentionMetadata(positions, slot_mapping, qsl, seq_lens, block_tables)
        step = self._compiled.get(t)
        if step is None:
            raise RuntimeError(f"bucket tokens={t} was not compiled at start-up")
        sampled, logits, self.k_cache, self.v_cache = step(
            self.params, token_ids, prev_rows, self._prev_sampled, md, self.k_cache, self.v_cache,
            logits_indices, sm)
        if filtered_rows(sm, self.config.vocab_size).any():
            sampled = self._filter_compiled[s](logits, sampled, sm)
        self._prev_sampled = sampled
        self._step_count += 1
        b.num_computed_tokens[slots] = seq_lens[:n_seq]
        samples = np.fromiter((sched.samples[r] for r in req_ids), bool, n_seq)
        rows = np.flatnonzero(samples).astype(np.int32)
        b.in_flight_row[slots[rows]] = rows
        b.in_flight_step[slots[rows]] = self._step_count - 1
        return StepHandle(self._step_count - 1, sampled, rows, [req_ids[i] for i in rows])

    def get_output(self, handle: StepHandle) -> dict[str, int]:
        """Wait for a dispatched step; returns req_id -> its newly sampled token, for the
        requests whose step ended at their last token (prompt chunks sample nothing)."""
        # This process's copy (with a mesh over several hosts, the others are not addressable).
        tokens = np.asarray(handle.sampled.addressable_data(0))[handle.rows]
        self.input_batch.record_sampled(handle.step, handle.rows, handle.req_ids, tokens)
        return dict(zip(handle.req_ids, tokens.tolist()))
