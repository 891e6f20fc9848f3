"""ModelRunner: applies a SchedulerOutput to its persistent InputBatch, builds the step's padded
inputs with vectorized numpy, and dispatches the compiled step.

One step = one call of a compiled executable, without control flow on the GPU (an XLA
conditional there blocks the dispatching thread): model forward over the ragged batch, KV write into the
donated pool, and greedy or plain-temperature sampling; in steps with top-k/top-p rows (or
penalties, log-probabilities, a grammar's bitmask: structured outputs) a second executable (one
per sequence count S) draws those rows. ``execute`` only dispatches;
``get_output`` waits for the sampled tokens. Between the two the host is free (async scheduling schedules and dispatches the next
step there): a token the host does not know yet is read by the next step straight from the
previous step's sampled array on the device. Token counts T come from a fixed list of buckets (powers of two
up to max_num_batched_tokens, from Platform.min_token_bucket); the sequence count is S = min(T, max_num_seqs), and the block
table always has the width P of a max_model_len sequence. Attention reads pages only as far as
each sequence's length reaches, so its cost follows the real contexts, not P; that keeps the
number of compiled shapes to the token buckets alone (docs/design.md section 3; P buckets were
tried and multiplied start-up compilation). Every program is compiled ahead of time by
``compile_buckets``; ``execute`` never compiles (it raises if asked to).
"""

import dataclasses
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
from jaxserve.core.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from jaxserve.engine import LogprobsLists
from jaxserve.engine.kv_sizing import peak_program_bytes, program_bytes
from jaxserve.models import llama, sharding
from jaxserve.platforms import current_platform
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from jaxserve.structured_output.manager import bitmask_width
from jaxserve.worker.executable_cache import ExecutableCache, KeyedJit
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.step_inputs import StepLayout
from jaxserve.worker.sampler import (
    FilterMetadata,
    Logprobs,
    SamplingMetadata,
    compute_logprobs,
    filtered_rows,
    init_state,
    sample_filtered,
    sample_unfiltered,
    write_state_row,
)
from pallas_kernels import kv_quant

# Prompt positions whose log-probabilities one step computes (the scheduler caps the prompt
# chunks of such requests to it): the step returns this many hidden rows, and a separate
# executable turns them into [rows, V] logits, so full-vocabulary logits never exist for more
# than this many prompt positions at once.
PROMPT_LOGPROB_ROWS = 128


def powers_of_two_up_to(limit: int, start: int = 1) -> list[int]:
    """[start, 2 start, 4 start, ...] below limit, then limit itself."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


# Block table entries a step writes to the device copy before it runs (_block_table_writes):
# a decode or chunked-prefill step's new pages (at most its tokens / page size + one per
# sequence) fit; a new request's prefix-cache hits, or the stale row of a reused slot, can
# take more, and those go first by the "block table write" program, as many at a time.
BLOCK_TABLE_WRITES = 1024


def _bucket(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def _step(config, attention_fn, mesh, max_num_seqs, branch_free, layout, params, packed,
          prev_sampled, k_cache, v_cache, block_table):
    """One model step of a token bucket, from its host inputs ``packed`` ([layout.size] int32,
    ``StepLayout.pack``: one transfer).

    ``prev_rows`` [T]: for each input token, the row of ``prev_sampled`` (the previous step's
    sampled tokens) that holds it, or -1 to take ``token_ids``. The step writes the block table
    entries changed since the last step (``block_table_rows/cols/pages``, ``_write_block_table``)
    to the device-resident ``block_table`` [max_num_seqs, P] (InputBatch slots), then gathers
    its sequences' rows ``seq_slots`` [S] from it: one dispatch, where a separate write cost an
    idle engine's first token ~1 ms of host time on the H200. Returns the greedy and plain
    rows' tokens padded to [max_num_seqs] (so that the next step's prev_sampled has one shape
    in every bucket), the logits [S, V] for ``_filter``, the hidden rows [R, E] at
    ``hidden_indices`` for ``_prompt_logprobs``, the updated KV pool and the updated block
    table. ``branch_free``: no control flow (the GPU; see the sampler's module docstring).
    ``mesh``: the tensor-parallel mesh (None: one device)."""
    x = layout.unpack(packed)
    prev_rows = x["prev_rows"]
    token_ids = jnp.where(prev_rows >= 0, prev_sampled[jnp.maximum(prev_rows, 0)],
                          x["token_ids"])
    block_table = _write_block_table(block_table, x["block_table_rows"], x["block_table_cols"],
                                     x["block_table_pages"])
    md = llama.AttentionMetadata(x["positions"], x["slot_mapping"], x["query_start_loc"],
                                 x["seq_lens"], block_table[x["seq_slots"]])
    sm = SamplingMetadata(**{f.name: x[f.name] for f in dataclasses.fields(SamplingMetadata)})
    logits, k_cache, v_cache, hidden = llama.forward(
        config, params, token_ids, md, k_cache, v_cache, x["logits_indices"],
        attention_fn=attention_fn, mesh=mesh, hidden_indices=x["hidden_indices"])
    sampled = sample_unfiltered(logits, sm, branch_free=branch_free)
    return (jnp.pad(sampled, (0, max_num_seqs - sampled.shape[0])), logits, hidden, k_cache,
            v_cache, block_table)


def _filter(logits, sampled, sm, fm, state, bitmask):
    """The step's tokens ([max_num_seqs]) with the rows of ``fm`` drawn again (a step's S rows
    come first; constrained rows under their row of ``bitmask`` [S, W] int32), the sampler
    state with their tokens counted, and their Logprobs."""
    s = logits.shape[0]
    tokens, state, logprobs = sample_filtered(logits, sampled[:s], sm, fm, state, bitmask)
    return sampled.at[:s].set(tokens), state, logprobs


def _prompt_logprobs(config, mesh, params, hidden, targets):
    """Logprobs of ``targets`` [R] from the hidden rows [R, E] that precede them."""
    return compute_logprobs(llama.compute_logits(config, params, hidden, mesh), targets)


def _zeroed_pools(shape, dtype, num_layers: int):
    """(K pools, V pools): num_layers zeroed pools each (``kv_quant.pool_zeros``)."""
    return ([kv_quant.pool_zeros(shape, dtype) for _ in range(num_layers)],
            [kv_quant.pool_zeros(shape, dtype) for _ in range(num_layers)])


def _write_block_table(block_table, rows, cols, pages):
    """``block_table`` [max_num_seqs, P] with ``pages`` [N] written at (``rows``, ``cols``);
    entries with a row past the table pad (dropped)."""
    return block_table.at[rows, cols].set(pages, mode="drop")


def _copy_pages(k_cache, v_cache, src, dst):
    """Copy KV pages ``src`` [N] to ``dst`` [N] in every layer (0 -> 0 pads: the null page)."""
    copy = lambda pool: jax.tree.map(lambda a: a.at[:, dst].set(a[:, src]), pool)  # noqa: E731
    return [copy(k) for k in k_cache], [copy(v) for v in v_cache]


def _memory_of(compiled) -> tuple[int, int]:
    """``kv_sizing.program_bytes`` of a compiled program; (0, 0) where the backend gives no
    memory analysis."""
    ma = compiled.memory_analysis()
    if ma is None:
        return 0, 0
    return program_bytes(ma.temp_size_in_bytes, ma.output_size_in_bytes,
                         ma.alias_size_in_bytes, getattr(ma, "generated_code_size_in_bytes", 0))


def _trim(lp: dict, rows, ks) -> LogprobsLists:
    """LogprobsLists of the given rows of host Logprobs arrays, k alternatives each."""
    return LogprobsLists(
        [[int(lp["ids"][r])] + lp["top_ids"][r, :k].tolist() for r, k in zip(rows, ks)],
        [[float(lp["lps"][r])] + lp["top_lps"][r, :k].tolist() for r, k in zip(rows, ks)],
        [int(lp["ranks"][r]) for r in rows])


def _host_logprobs(lp: Logprobs, token_ids: np.ndarray) -> dict:
    return {"ids": token_ids, "top_ids": np.asarray(lp.top_ids),
            "top_lps": np.asarray(lp.top_logprobs), "lps": np.asarray(lp.token_logprobs),
            "ranks": np.asarray(lp.token_ranks)}


@dataclass
class StepHandle:
    """A dispatched step: its counter, its sampled tokens (on the device until ``get_output``),
    which rows hold a request's next token, and the log-probabilities it computed.

    Attributes:
      logprobs: Logprobs of the step's rows (device), or None when no row asked.
      logprob_ks: per entry of ``rows``, the alternatives its request wants (-1: none).
      prompt_logprobs: Logprobs of PROMPT_LOGPROB_ROWS prompt positions (device), or None.
      prompt_spans: (req_id, index of the first prompt token covered, first row, rows, k) per
        request in ``prompt_logprobs``.
      prompt_targets: [PROMPT_LOGPROB_ROWS] the prompt tokens those rows predict.
      filter_inputs: what ``ModelRunner.sample_filtered`` needs while the step's filtered
        sampler is not dispatched yet (its constrained rows wait for their bitmask), else None.
    """

    step: int
    sampled: jax.Array
    rows: np.ndarray
    req_ids: list[str]
    logprobs: Logprobs | None = None
    logprob_ks: np.ndarray | None = None
    prompt_logprobs: Logprobs | None = None
    prompt_spans: list[tuple[str, int, int, int, int]] | None = None
    prompt_targets: np.ndarray | None = None
    filter_inputs: tuple | None = None

    @property
    def awaits_bitmask(self) -> bool:
        return self.filter_inputs is not None


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
      branch_free: compile the step without control flow; default: the platform's
        ``branch_free_step`` (a GPU conditional blocks the dispatching thread; the module
        docstring says more).
      mesh: the tensor-parallel mesh (``jaxserve.models.sharding``) that params are split over;
        the KV pool is split by KV head over it, the step's other inputs and outputs are
        replicated. None: one device, the default.
      executable_cache: where compiled programs are loaded from and saved to
        (``executable_cache.py``); None: compiled at every start.
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
        executable_cache: ExecutableCache | None = None,
    ):
        self.config = config
        self.executables = executable_cache or ExecutableCache(None)
        self.mesh = mesh
        self.layout = sharding.Layout.of(config, sharding.mesh_size(mesh))
        self.params = params
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.platform = platform = current_platform()
        self.token_buckets = powers_of_two_up_to(max_num_batched_tokens, platform.min_token_bucket)
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.kv_dtype = kv_dtype
        self.k_cache = self.v_cache = None  # allocate_kv_cache, once the pool is sized
        self.input_batch = InputBatch(max_num_seqs, max_model_len, self.max_pages_per_seq)
        self.max_model_len = max_model_len
        self.prompt_logprob_rows = min(PROMPT_LOGPROB_ROWS, max_num_batched_tokens)
        if branch_free is None:
            branch_free = platform.branch_free_step
        # Everything but the params and the pool is replicated over the mesh (None: one device).
        self._replicated = None if mesh is None else sharding.replicated(mesh)
        self.step_layouts = {
            t: StepLayout(t, self.num_seqs_for(t), self.prompt_logprob_rows, BLOCK_TABLE_WRITES)
            for t in self.token_buckets}
        # The step of each token bucket (its layout is static); the pool and the block table
        # are donated.
        if mesh is None:
            jit_step = partial(KeyedJit, donate_argnums=(3, 4, 5))
            self._filter_jitted = KeyedJit(_filter, donate_argnums=(4,))
        else:
            # Params as split by the Megatron layout, the pool by KV head.
            rep, kv = self._replicated, sharding.kv_sharding(mesh)
            jit_step = partial(
                KeyedJit, donate_argnums=(3, 4, 5),
                in_shardings=(sharding.param_shardings(params, mesh), rep, rep, kv, kv, rep),
                out_shardings=(rep, rep, rep, kv, kv, rep))
            self._filter_jitted = KeyedJit(_filter, donate_argnums=(4,), in_shardings=rep,
                                           out_shardings=rep)
        self._step_jitted = {
            t: jit_step(partial(_step, config, attention_fn, mesh, max_num_seqs, branch_free,
                                layout)) for t, layout in self.step_layouts.items()}
        # The other programs a step may dispatch, each compiled once at start-up.
        self._aux_jitted = {
            "state writer": KeyedJit(write_state_row, donate_argnums=(0,)),
            "page copy": KeyedJit(_copy_pages, donate_argnums=(0, 1)),
            "block table write": KeyedJit(_write_block_table, donate_argnums=(0,)),
            "prompt logprobs": KeyedJit(partial(_prompt_logprobs, config, mesh)),
        }
        self._prev_sampled = jnp.zeros(max_num_seqs, jnp.int32, device=self._replicated)
        # The InputBatch's block table, kept on the device: a step sends only the entries that
        # changed (the whole table is 8 MB at 256 sequences of 131,072 tokens; staging it took
        # ~2 ms of an idle engine's first token on the H200, docs/performance.md). Created by
        # a jitted call, as the sampling state below.
        self.block_table = jax.jit(
            partial(jnp.zeros, (max_num_seqs, self.max_pages_per_seq), jnp.int32),
            out_shardings=self._replicated)()
        # Grammar bitmask rows (structured outputs): ceil(V / 32) int32 words per sequence.
        # A step without constrained rows passes the all-allowed mask of its S, kept on the
        # device, so such steps move no bitmask to the device.
        self.bitmask_width = bitmask_width(config.vocab_size)
        self._no_bitmask: dict[int, jax.Array] = {}  # by S
        self._compiled: dict[int, Callable] = {}
        self._filter_compiled: dict[int, Callable] = {}  # by S
        self._aux_compiled: dict[str, Callable] = {}
        self.peak_program_bytes = 0  # compile_buckets
        self._step_count = 0
        # Penalty counts, logit biases, stop ids per slot, on the device (sampler.py); stop ids
        # hold the request's own and the model's EOS ids (config's and the tokenizer's).
        # Created by a jitted call so that on a mesh (several hosts too) each device makes its
        # own replica.
        self.sampling_state = jax.jit(
            partial(init_state, max_num_seqs, config.vocab_size, MAX_LOGIT_BIAS,
                    MAX_STOP_TOKEN_IDS + len(config.eos_token_ids) + 1),
            out_shardings=self._replicated)()

    def _kv_pool(self, num_pages: int):
        """(shape [KV, num_pages, page_size, D] of one layer's K (or V) pool, KV the layout's,
        and its sharding: split over the mesh by KV head, None on one device)."""
        c = self.config
        shape = (self.layout.num_kv_heads, num_pages, self.page_size, c.head_dim)
        return shape, None if self.mesh is None else sharding.kv_sharding(self.mesh)

    def pool_structs(self, num_pages: int) -> tuple[list, list]:
        """(K pools, V pools) of num_pages pages as shapes only (``kv_quant.pool_struct``), to
        compile against a pool that is not allocated."""
        shape, where = self._kv_pool(num_pages)
        kv = [kv_quant.pool_struct(shape, self.kv_dtype, where)] * self.config.num_layers
        return kv, kv

    def allocate_kv_cache(self, num_pages: int) -> None:
        """Allocate the (zeroed) K and V pools of num_pages pages, page 0 included; on a mesh
        each device allocates only its KV heads. One program makes them all: one dispatch
        instead of one per pool (64 for the 8B model, each waiting for the GIL while the
        tokenizer thread imports transformers).

        Raises:
          ValueError: the pools did not all get memory of their own. A GPU allocator that
            cannot place an output has returned another output's memory for it without an
            error (kv_sizing's docstring), which would let layers overwrite each other.
        """
        shape, where = self._kv_pool(num_pages)
        make = KeyedJit(partial(_zeroed_pools, shape, self.kv_dtype, self.config.num_layers),
                        out_shardings=where)
        k_cache, v_cache = self.executables.compile(make)()
        shards = [s.data for x in jax.tree.leaves((k_cache, v_cache)) for s in x.addressable_shards]
        distinct, total = len({x.unsafe_buffer_pointer() for x in shards}), len(shards)
        if distinct < total:
            del k_cache, v_cache, shards
            raise ValueError(
                f"the KV pool ({num_pages} pages) did not fit in the device allocator: "
                f"{distinct} of its arrays got memory of their own, out of {total}")
        self.k_cache, self.v_cache = k_cache, v_cache

    def profile_peak_bytes(self, num_pages: int) -> int:
        """``kv_sizing.peak_program_bytes`` of the programs that can need the most (the largest
        token bucket's step, the sampler of the most sequences, the page copy and the prompt
        log-probabilities), each compiled against a pool of num_pages pages given by shapes
        only (nothing is allocated). On a mesh, the bytes of one device (XLA analyses the
        partitioned program). ``compile_buckets`` then measures every program at the real
        pool size."""
        k, v = self.pool_structs(num_pages)
        t = self.token_buckets[-1]
        programs = [(self._step_jitted[t], self.step_args(t, k, v), self._compiler_options(t)),
                    (self._filter_jitted, self._filter_args(self.num_seqs_for(t)), None),
                    (self._aux_jitted["page copy"], self._aux_args("page copy", k, v), None),
                    (self._aux_jitted["prompt logprobs"], self._aux_args("prompt logprobs"), None)]
        return peak_program_bytes([_memory_of(self.executables.compile(*p)) for p in programs])

    def num_seqs_for(self, num_tokens_bucket: int) -> int:
        return min(num_tokens_bucket, self.max_num_seqs)

    def step_args(self, t: int, k_cache, v_cache) -> tuple:
        """Placeholder arguments of token bucket t's step (``_step_jitted[t]``), for its
        compilation, with the given pool (arrays, or ShapeDtypeStructs to compile against a
        pool that is not allocated)."""
        packed = np.zeros(self.step_layouts[t].size, np.int32)
        return self.params, packed, self._prev_sampled, k_cache, v_cache, self.block_table

    @staticmethod
    def _dummy_sampling(s: int) -> tuple[SamplingMetadata, FilterMetadata]:
        f32, i32, off = np.zeros(s, np.float32), np.zeros(s, np.int32), np.zeros(s, bool)
        sm = SamplingMetadata(temperature=f32, top_k=i32, top_p=np.ones(s, np.float32),
                              seeds=np.zeros(s, np.uint32), steps=i32)
        fm = FilterMetadata(rows=off, slots=i32, min_p=f32, presence_penalty=f32,
                            frequency_penalty=f32, repetition_penalty=np.ones(s, np.float32),
                            logit_bias=off, suppress_stop=off, count=off, logprobs=off,
                            structured=off)
        return sm, fm

    def _filter_args(self, s: int) -> tuple:
        """Placeholder arguments of the sampler of s sequences (``_filter``)."""
        logits = jax.ShapeDtypeStruct((s, self.config.vocab_size), jnp.float32,
                                      sharding=self._replicated)
        if s not in self._no_bitmask:
            # jitted, as the sampling state: a device_put cannot place it over two hosts
            self._no_bitmask[s] = jax.jit(
                partial(jnp.full, (s, self.bitmask_width), -1, jnp.int32),
                out_shardings=self._replicated)()
        return (logits, self._prev_sampled, *self._dummy_sampling(s), self.sampling_state,
                self._no_bitmask[s])

    def _aux_args(self, name: str, k_cache=None, v_cache=None):
        """Placeholder arguments of the auxiliary programs, for their compilation (the page
        copy's with the given pool, ``pool_structs``)."""
        st = self.sampling_state
        if name == "state writer":
            return (st, np.int32(0), np.zeros(self.max_model_len, np.int32), np.int32(0),
                    np.int32(0), np.asarray(st.bias_ids[0]), np.asarray(st.bias_values[0]),
                    np.asarray(st.stop_ids[0]))
        if name == "page copy":
            pages = np.zeros(self.max_num_seqs, np.int32)
            return k_cache, v_cache, pages, pages
        if name == "block table write":
            entries = np.zeros(BLOCK_TABLE_WRITES, np.int32)
            return self.block_table, entries, entries, entries
        hidden = jax.ShapeDtypeStruct((self.prompt_logprob_rows, self.config.hidden_size),
                                      self.params["embed_tokens"].dtype)
        return self.params, hidden, np.zeros(self.prompt_logprob_rows, np.int32)

    def _compiler_options(self, tokens: int) -> dict | None:
        """XLA options of the step for a bucket of ``tokens``. On a GPU, XLA updates a step's
        command buffers (CUDA graphs) whenever its buffers move, which they do on every call:
        host time before the first kernel, hidden behind the step in flight while the engine is
        busy but paid in full by a prompt that arrives at an idle engine (its TTFT). Steps of
        prefill size run long enough that launching their kernels one by one costs nothing, so
        they go without; decode-size steps keep the graphs (docs/performance.md)."""
        min_tokens = self.platform.op_by_op_min_tokens
        if min_tokens is None or tokens < min_tokens:
            return None
        return {"xla_gpu_enable_command_buffer": ""}

    def compile_buckets(self, num_pages: int, log: Callable[[str], None] = print) -> None:
        """Compile the step for every token bucket and the top-k/top-p sampler for every
        sequence count, against a pool of num_pages pages (``allocate_kv_cache`` may come
        after), with a progress line each, and set ``peak_program_bytes`` over all of them
        (``kv_sizing.peak_program_bytes``). A program in the executable cache is loaded
        from it on a pool of a thread per core; the others are traced and lowered one after
        another on this thread, and each lowered program is compiled (and saved to the cache)
        at once on that pool (XLA's compiler runs outside the GIL), so compiling overlaps the
        lowering of the next."""
        start = time.perf_counter()
        k, v = self.pool_structs(num_pages)
        programs = {}  # (kind, tokens or seqs) -> (jitted, args, compiler options)
        for t in self.token_buckets:
            programs["step", t] = (self._step_jitted[t], self.step_args(t, k, v),
                                   self._compiler_options(t))
        for s in sorted({self.num_seqs_for(t) for t in self.token_buckets}):
            programs["filter", s] = (self._filter_jitted, self._filter_args(s), None)
        for name, fn in self._aux_jitted.items():
            programs[name, None] = (fn, self._aux_args(name, k, v), None)
        total, hits = len(programs), self.executables.hits
        with ThreadPoolExecutor(min(total, os.cpu_count() or 1)) as pool:
            futures = {self.executables.submit(pool, *program): label
                       for label, program in programs.items()}
            log(f"{total} programs ({len(self.token_buckets)} token buckets, "
                f"{total - len(self.token_buckets) - len(self._aux_jitted)} samplers, "
                f"{len(self._aux_jitted)} others) traced, or found in the executable cache, in "
                f"{time.perf_counter() - start:.1f}s")
            for i, done in enumerate(as_completed(futures), 1):
                kind, n = futures[done]
                table = {"step": self._compiled, "filter": self._filter_compiled}.get(kind)
                if table is None:
                    self._aux_compiled[kind] = done.result()
                    what = kind
                else:
                    table[n] = done.result()
                    what = f"{kind} {'tokens' if kind == 'step' else 'seqs'}={n}"
                log(f"compiling (or loading from a cache): {i}/{total} ({what}) "
                    f"{time.perf_counter() - start:.1f}s")
        log(f"{self.executables.hits - hits} of {total} programs came from the executable cache")
        self.peak_program_bytes = peak_program_bytes(
            [_memory_of(c) for c in [*self._compiled.values(), *self._filter_compiled.values(),
                                     *self._aux_compiled.values()]])

    def _write_state_row(self, slot: int, r: NewRequestData) -> None:
        """Dispatch the sampler-state row of a request entering the batch (sampler.py)."""
        st = self.sampling_state
        vocab = self.config.vocab_size
        tokens = np.zeros(self.max_model_len, np.int32)
        tokens[: len(r.token_ids)] = r.token_ids
        bias = r.sampling_params.logit_bias or {}
        bias_ids = np.full(st.bias_ids.shape[1], vocab, np.int32)
        bias_ids[: len(bias)] = list(bias)
        bias_values = np.zeros(st.bias_values.shape[1], np.float32)
        bias_values[: len(bias)] = list(bias.values())
        stop_ids = np.full(st.stop_ids.shape[1], vocab, np.int32)
        stop_ids[: len(r.stop_token_ids)] = r.stop_token_ids
        self.sampling_state = self._aux_compiled["state writer"](
            st, np.int32(slot), tokens, np.int32(r.num_prompt_tokens), np.int32(len(r.token_ids)),
            bias_ids, bias_values, stop_ids)

    def execute(self, sched: SchedulerOutput) -> StepHandle | None:
        """Apply the step's changes to the InputBatch and dispatch the step (no wait), then,
        when some row needs them, the page copies of forked choices, the prompt
        log-probabilities and the filtered sampler; the last waits for ``sample_filtered``
        when the step has constrained rows and ``sched.grammar_bitmask`` is None (async
        scheduling: the bitmask needs the previous step's tokens). None if nothing is
        scheduled.

        Raises:
          RuntimeError: the step's token bucket was not compiled at start-up, or a token the
            host does not know is not the previous step's (a scheduling bug).
        """
        b = self.input_batch
        for slot, r in b.update_states(sched):
            self._write_state_row(slot, r)
        n_tok = sched.total_num_scheduled_tokens
        if n_tok == 0:
            return None
        req_ids = list(sched.num_scheduled_tokens)
        n_seq = len(req_ids)
        # Forked choices are rows without tokens, so a step may hold more rows than tokens.
        t = _bucket(self.token_buckets, max(n_tok, n_seq))
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
        context = computed + counts  # each sequence's length after this step
        seq_lens = np.zeros(s, np.int32)
        seq_lens[:n_seq] = np.where(counts > 0, context, 0)  # a forked row attends to nothing
        seq_slots = np.zeros(s, np.int32)  # padding rows attend to nothing (seq_lens 0)
        seq_slots[:n_seq] = slots
        logits_indices = np.zeros(s, np.int32)
        logits_indices[:n_seq] = ends - 1
        if sched.forked_from:
            row_of = {r: i for i, r in enumerate(req_ids)}
            for child, parent in sched.forked_from.items():
                logits_indices[row_of[child]] = logits_indices[row_of[parent]]
        samples = np.fromiter((sched.samples[r] for r in req_ids), bool, n_seq)
        hidden_indices, prompt_spans, targets = self._prompt_logprob_rows(
            sched, req_ids, slots, computed, counts, ends)

        def per_seq(values, fill, dtype):
            out = np.full(s, fill, dtype)
            out[:n_seq] = values
            return out

        # tokens generated before the one sampled now: its position minus the prompt
        steps = context - b.num_prompt_tokens[slots]
        sm = SamplingMetadata(
            temperature=per_seq(b.temperature[slots], 0, np.float32),
            top_k=per_seq(b.top_k[slots], 0, np.int32),
            top_p=per_seq(b.top_p[slots], 1, np.float32),
            seeds=per_seq(b.seeds[slots], 0, np.uint32),
            steps=per_seq(steps, 0, np.int32),
        )
        step = self._compiled.get(t)
        if step is None:
            raise RuntimeError(f"bucket tokens={t} was not compiled at start-up")
        bt_rows, bt_cols, bt_pages = self._block_table_writes()
        packed = self.step_layouts[t].pack(dict(
            token_ids=token_ids, prev_rows=prev_rows, positions=positions,
            slot_mapping=slot_mapping, query_start_loc=qsl, seq_lens=seq_lens,
            seq_slots=seq_slots, logits_indices=logits_indices, hidden_indices=hidden_indices,
            block_table_rows=bt_rows, block_table_cols=bt_cols, block_table_pages=bt_pages,
            **{f.name: getattr(sm, f.name) for f in dataclasses.fields(sm)}))
        sampled, logits, hidden, self.k_cache, self.v_cache, self.block_table = step(
            self.params, packed, self._prev_sampled, self.k_cache, self.v_cache,
            self.block_table)
        logprob_ks = b.logprobs[slots]
        suppress = b.min_tokens[slots] > steps
        redraw = (b.penalized[slots] | b.logit_bias[slots] | suppress
                  | ((b.temperature[slots] > 0) & (b.min_p[slots] > 0)))
        redraw |= filtered_rows(sm, self.config.vocab_size)[:n_seq]
        structured = self._structured_rows(sched, req_ids, s)
        redraw |= structured[:n_seq]
        want_logprobs = samples & (logprob_ks >= 0)
        fm = None
        if redraw.any() or want_logprobs.any():
            fm = FilterMetadata(
                rows=per_seq(redraw, False, bool), slots=per_seq(slots, 0, np.int32),
                min_p=per_seq(b.min_p[slots], 0, np.float32),
                presence_penalty=per_seq(b.presence_penalty[slots], 0, np.float32),
                frequency_penalty=per_seq(b.frequency_penalty[slots], 0, np.float32),
                repetition_penalty=per_seq(b.repetition_penalty[slots], 1, np.float32),
                logit_bias=per_seq(b.logit_bias[slots], False, bool),
                suppress_stop=per_seq(suppress, False, bool),
                count=per_seq(samples & b.penalized[slots], False, bool),
                logprobs=per_seq(want_logprobs, False, bool), structured=structured)
        if sched.copy_pages:
            src = np.zeros(self.max_num_seqs, np.int32)
            dst = np.zeros(self.max_num_seqs, np.int32)
            src[: len(sched.copy_pages)], dst[: len(sched.copy_pages)] = zip(*sched.copy_pages)
            self.k_cache, self.v_cache = self._aux_compiled["page copy"](
                self.k_cache, self.v_cache, src, dst)
        prompt_logprobs = None
        if prompt_spans:
            prompt_logprobs = self._aux_compiled["prompt logprobs"](self.params, hidden, targets)
        self._step_count += 1
        b.num_computed_tokens[slots] = context
        rows = np.flatnonzero(samples).astype(np.int32)
        b.in_flight_row[slots[rows]] = rows
        b.in_flight_step[slots[rows]] = self._step_count - 1
        handle = StepHandle(self._step_count - 1, sampled, rows, [req_ids[i] for i in rows],
                            None, logprob_ks[rows], prompt_logprobs, prompt_spans, targets)
        self._prev_sampled = sampled
        if fm is not None:
            handle.filter_inputs = (logits, sm, fm, np.flatnonzero(structured),
                                    bool(want_logprobs.any()))
            if not structured.any() or sched.grammar_bitmask is not None:
                self.sample_filtered(handle, sched.grammar_bitmask)
        return handle

    def sample_filtered(self, handle: StepHandle, grammar_bitmask: np.ndarray | None) -> None:
        """Dispatch the filtered sampler of a step that ``execute`` left waiting for its
        constrained rows' bitmask (``handle.awaits_bitmask``), or of any step needing it.

        Args:
          handle: the step.
          grammar_bitmask: [constrained rows, W] int32 in the order of
            ``SchedulerOutput.structured_output_request_ids``; None when none.
        """
        logits, sm, fm, struct_rows, want_logprobs = handle.filter_inputs
        s = logits.shape[0]
        bitmask = self._no_bitmask[s]
        if grammar_bitmask is not None:
            bitmask = np.full((s, self.bitmask_width), -1, np.int32)
            bitmask[struct_rows] = grammar_bitmask
        sampled, self.sampling_state, lp = self._filter_compiled[s](
            logits, handle.sampled, sm, fm, self.sampling_state, bitmask)
        handle.sampled = self._prev_sampled = sampled
        handle.logprobs = lp if want_logprobs else None
        handle.filter_inputs = None

    def device_state_ok(self) -> bool:
        """Whether the device arrays every step reads survived (the KV pool, the block table,
        the sampler state, the last step's tokens): none deleted (donated to a program that
        then failed) and none holding a failed program's error."""
        arrays = jax.tree.leaves((self.k_cache, self.v_cache, self.block_table,
                                  self._prev_sampled, self.sampling_state))
        try:
            if any(a.is_deleted() for a in arrays):
                return False
            jax.block_until_ready(arrays)
        except Exception:  # noqa: BLE001 - whatever the failed program left, it cannot serve
            return False
        return True

    def _structured_rows(self, sched: SchedulerOutput, req_ids: list[str], s: int) -> np.ndarray:
        """[S] bool: the rows of the step's constrained sequences."""
        structured = np.zeros(s, bool)
        if sched.structured_output_request_ids:
            row_of = {r: i for i, r in enumerate(req_ids)}
            structured[[row_of[r] for r in sched.structured_output_request_ids]] = True
        return structured

    def _no_block_table_writes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """BLOCK_TABLE_WRITES entries that write nothing (rows past the table are dropped)."""
        return (np.full(BLOCK_TABLE_WRITES, self.max_num_seqs, np.int32),
                np.zeros(BLOCK_TABLE_WRITES, np.int32), np.zeros(BLOCK_TABLE_WRITES, np.int32))

    def _block_table_writes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The InputBatch's block table entries written since the last step, for the step to
        write to the device copy: its last BLOCK_TABLE_WRITES (padded); any before those go
        now by the "block table write" program, as many at a time."""
        rows, cols, pages = self.input_batch.take_block_table_changes()
        chunks = []
        for a in range(0, len(rows), BLOCK_TABLE_WRITES):
            r, c, p = self._no_block_table_writes()
            n = min(BLOCK_TABLE_WRITES, len(rows) - a)
            r[:n], c[:n], p[:n] = rows[a : a + n], cols[a : a + n], pages[a : a + n]
            chunks.append((r, c, p))
        for r, c, p in chunks[:-1]:
            self.block_table = self._aux_compiled["block table write"](self.block_table, r, c, p)
        return chunks[-1] if chunks else self._no_block_table_writes()

    def _prompt_logprob_rows(self, sched, req_ids, slots, computed, counts, ends):
        """For the requests in ``sched.prompt_logprobs``: the flat-batch rows of their scheduled
        prompt positions that predict a next prompt token, padded to PROMPT_LOGPROB_ROWS, the
        spans (see StepHandle) and the tokens predicted."""
        rows = np.zeros(self.prompt_logprob_rows, np.int32)
        targets = np.zeros(self.prompt_logprob_rows, np.int32)
        spans, used = [], 0
        if not sched.prompt_logprobs:
            return rows, spans, targets
        b = self.input_batch
        for i, rid in enumerate(req_ids):
            if rid not in sched.prompt_logprobs:
                continue
            slot = slots[i]
            first = computed[i]  # position of the chunk's first token
            n = min(computed[i] + counts[i], b.num_prompt_tokens[slot] - 1) - first
            if n <= 0:
                continue
            if used + n > len(rows):
                raise RuntimeError("prompt log-probability rows exceed the step's capacity")
            rows[used : used + n] = ends[i] - counts[i] + np.arange(n)
            targets[used : used + n] = b.token_ids[slot, first + 1 : first + 1 + n]
            k = b.prompt_logprobs[slot]
            spans.append((rid, int(first) + 1, used, int(n), int(k)))
            used += n
        return rows, spans, targets

    def get_output(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a dispatched step; returns its sampled tokens (for the requests whose step
        ended at their last token; prompt chunks sample nothing) and log-probabilities.

        Raises:
          RuntimeError: the step still awaits its grammar bitmask (``sample_filtered``).
        """
        if handle.awaits_bitmask:
            raise RuntimeError("the step's constrained rows were never sampled")
        # This process's copy (with a mesh over several hosts, the others are not addressable).
        sampled = np.asarray(handle.sampled.addressable_data(0))
        tokens = sampled[handle.rows]
        self.input_batch.record_sampled(handle.step, handle.rows, handle.req_ids, tokens)
        logprobs = {}
        if handle.logprobs is not None:
            lp = _host_logprobs(handle.logprobs, sampled)
            for rid, row, k in zip(handle.req_ids, handle.rows.tolist(),
                                   handle.logprob_ks.tolist()):
                if k >= 0:
                    logprobs[rid] = _trim(lp, [row], [k])
        prompt_logprobs = {}
        if handle.prompt_logprobs is not None:
            lp = _host_logprobs(handle.prompt_logprobs, handle.prompt_targets)
            for rid, first, start, n, k in handle.prompt_spans:
                rows = range(start, start + n)
                prompt_logprobs[rid] = (first, _trim(lp, rows, [k] * n))
        return ModelRunnerOutput(dict(zip(handle.req_ids, tokens.tolist())), logprobs,
                                 prompt_logprobs)
