"""ModelRunner: applies a SchedulerOutput to its persistent InputBatch, has the step's padded
inputs built (``prepare_inputs``), dispatches the compiled programs (``programs``, compiled by
``compilation``) and turns a step's results into a ModelRunnerOutput.

One step = one call of a compiled executable, without control flow on the GPU (an XLA
conditional there blocks the dispatching thread): model forward over the ragged batch, KV write
into the donated pool, and greedy or plain-temperature sampling; in steps with top-k/top-p rows
(or penalties, log-probabilities, a grammar's bitmask: structured outputs) a second executable
(one per sequence count S) draws those rows. ``execute`` only dispatches; ``get_output`` waits
for the sampled tokens. Between the two the host is free (async scheduling schedules and
dispatches the next step there): a token the host does not know yet is read by the next step
straight from the previous step's sampled array on the device. Token counts T come from a fixed
list of buckets (powers of two up to max_num_batched_tokens, from Platform.min_token_bucket);
the sequence count is S = min(T, max_num_seqs), and the block table always has the width P of a
max_model_len sequence. Attention reads pages only as far as each sequence's length reaches, so
its cost follows the real contexts, not P; that keeps the number of compiled shapes to the token
buckets alone (docs/architecture.md, "Buckets and the executable cache"; P buckets would
multiply start-up compilation). Every program is compiled ahead of time by ``compile_buckets``;
``execute`` never compiles (it raises if asked to). With speculative decoding a sequence's
draft tokens are scheduled tokens with a logits row each, so a bucket has a fixed number of
logits rows L at least S (``logits_rows_for``; docs/spec_decode.md), and ``get_output`` returns
the tokens of the rows ``rejection_sampler.emitted_rows`` picks. With the draft_model method a
draft pool follows the target pool (``spec_decode/draft_model.py``): each step runs the draft
model over its tokens, and ``get_output`` of a step that asks for drafts proposes them. An EAGLE
head (``spec_decode/eagle.py``) does the same from the hidden states the step returns, and keeps
each sequence's newest one on the device (``slot_hidden``).
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.config import ModelConfig
from jaxserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.engine import LogprobsLists
from jaxserve.engine.kv_sizing import peak_program_bytes
from jaxserve.models import moe, sharding
from jaxserve.platforms import current_platform
from jaxserve.spec_decode.device_drafts import NgramDrafting
from jaxserve.spec_decode.draft_model import DraftModel
from jaxserve.spec_decode.eagle import EagleHead
from jaxserve.spec_decode.rejection_sampler import emitted_rows
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from jaxserve.structured_output.manager import bitmask_width
from jaxserve.worker import compilation
from jaxserve.worker.compilation import decode_buckets, powers_of_two_up_to
from jaxserve.worker.executable_cache import ExecutableCache
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.prepare_inputs import InputBuilder
from jaxserve.worker.programs import Programs, jit_programs, jit_zeroed_pools
from jaxserve.worker.sampler import Logprobs, init_state
from jaxserve.worker.sampling_fields import (SAMPLING, FilterMetadata, SamplingMetadata,
                                             neutral)
from jaxserve.worker.step_inputs import StepLayout
from pallas_kernels import kv_quant, pool_head_dim, reads_stacked_pools

# Prompt positions whose log-probabilities one step computes (the scheduler caps the prompt
# chunks of such requests to it): the step returns this many hidden rows, and a separate
# executable turns them into [rows, V] logits, so full-vocabulary logits never exist for more
# than this many prompt positions at once.
PROMPT_LOGPROB_ROWS = 128


# Block table entries a step writes to the device copy before it runs (prepare_inputs):
# a decode or chunked-prefill step's new pages (at most its tokens / page size + one per
# sequence) fit; a new request's prefix-cache hits, or the stale row of a reused slot, can
# take more, and those go first by the "block table write" program, as many at a time.
BLOCK_TABLE_WRITES = 1024


def _trim(lp: dict, rows, ks) -> LogprobsLists:
    """LogprobsLists of the given rows of host Logprobs arrays, k alternatives each."""
    return LogprobsLists(
        [[int(lp["ids"][r])] + lp["top_ids"][r, :k].tolist() for r, k in zip(rows, ks)],
        [[float(lp["lps"][r])] + lp["top_lps"][r, :k].tolist() for r, k in zip(rows, ks)],
        [int(lp["ranks"][r]) for r in rows])


def _host_logprobs(lp: Logprobs, token_ids: np.ndarray) -> dict:
    # one wait for the four copies (device_get starts them all first)
    top_ids, top_lps, lps, ranks = jax.device_get(
        (lp.top_ids, lp.top_logprobs, lp.token_logprobs, lp.token_ranks))
    return {"ids": token_ids, "top_ids": top_ids, "top_lps": top_lps, "lps": lps,
            "ranks": ranks}


@dataclass
class StepHandle:
    """A dispatched step: its counter, its sampled tokens (on the device until ``get_output``),
    which rows hold a request's next token, and the log-probabilities it computed.

    Attributes:
      rows: per sampling request, its last logits row.
      num_drafts: per entry of ``rows``, the drafts the request verifies (its rows are the
        num_drafts before ``rows`` and that one).
      draft_ids, seq_start: [m] the step's logits rows' (``rejection_sampler.emitted_rows``).
      logprobs: Logprobs of the step's rows (device), or None when no row asked.
      logprob_ks: per entry of ``rows``, the alternatives its request wants (-1: none).
      prompt_logprobs: Logprobs of PROMPT_LOGPROB_ROWS prompt positions (device), or None.
      prompt_spans: (req_id, index of the first prompt token covered, first row, rows, k) per
        request in ``prompt_logprobs``.
      prompt_targets: [PROMPT_LOGPROB_ROWS] the prompt tokens those rows predict.
      propose: the draft model proposes drafts after the step
        (``SchedulerOutput.propose_drafts``).
      rows_hidden: an EAGLE head's h of the step's logits rows ([max_rows, E], device), for
        the sequences whose drafts were rejected; else None.
      filter_inputs: what ``ModelRunner.sample_filtered`` needs while the step's filtered
        sampler is not dispatched yet (its constrained rows wait for their bitmask), else None.
    """

    step: int
    sampled: jax.Array
    rows: np.ndarray
    req_ids: list[str]
    num_drafts: np.ndarray
    draft_ids: np.ndarray
    seq_start: np.ndarray
    logprobs: Logprobs | None = None
    logprob_ks: np.ndarray | None = None
    prompt_logprobs: Logprobs | None = None
    prompt_spans: list[tuple[str, int, int, int, int]] | None = None
    prompt_targets: np.ndarray | None = None
    filter_inputs: tuple | None = None
    propose: bool = False
    rows_hidden: jax.Array | None = None

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
        docstring says more). A branch-free step, or one whose attention is not the reference,
        keeps a pool per layer (unrolled layers).
      mesh: the tensor-parallel mesh (``jaxserve.models.sharding``) that params are split over;
        the KV pool is split by KV head over it, the step's other inputs and outputs are
        replicated. None: one device, the default.
      executable_cache: where compiled programs are loaded from and saved to
        (``executable_cache.py``); None: compiled at every start.
      quantization: the method of the params' linear weights (``--quantization`` or the
        checkpoint's, ``fp8_checkpoint.resolve_method``: all ``linear.Fp8Weight``), for the
        step's compiler options; None: plain weights.
      lora: the LoRA adapters' manager when the params carry adapter pools (``--enable-lora``):
        each step gets its adapters' pool slots from it; None: no adapters.
      num_speculative_tokens: the most drafts a sequence verifies in a step (speculative
        decoding, docs/spec_decode.md; 0: off).
      max_spec_seqs: the most sequences that carry drafts in one step; with
        num_speculative_tokens, the logits rows each bucket computes (``logits_rows_for``).
      draft: the draft_model method's model or an EAGLE head (one device: no mesh), whose
        pool of the target's page count the runner keeps beside the target's; None: neither.
      ngram_lookup: (prompt_lookup_min, prompt_lookup_max) of the n-gram method, whose drafts
        the step makes on the device (``spec_decode.device_drafts``); None: another method or
        none.
      decode_steps: the token buckets a step of only one-token decodes can take get a second
        step program whose attention is ``decode_only`` (``decode_buckets``); default: the
        platform's ``decode_steps``.
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
        quantization: str | None = None,
        lora=None,
        num_speculative_tokens: int = 0,
        max_spec_seqs: int = 0,
        draft: DraftModel | EagleHead | None = None,
        ngram_lookup: tuple[int, int] | None = None,
        decode_steps: bool | None = None,
    ):
        self.config = config
        self.lora = lora
        self.quantization = quantization
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
        # The pools' head width: the model's, or the attention kernels' wider one.
        self.pool_head_dim = pool_head_dim(attention_fn, config.head_dim)
        self.draft_pool_head_dim = (None if draft is None
                                    else pool_head_dim(attention_fn, draft.config.head_dim))
        self.k_cache = self.v_cache = None  # allocate_kv_cache, once the pool is sized
        self.input_batch = InputBatch(max_num_seqs, max_model_len, self.max_pages_per_seq)
        self.max_model_len = max_model_len
        self.prompt_logprob_rows = min(PROMPT_LOGPROB_ROWS, max_num_batched_tokens)
        if branch_free is None:
            branch_free = platform.branch_free_step
        # The layer loop over a stacked pool is control flow, which a branch-free step has none
        # of, and its pool is read by the reference attention only.
        self.stacked_kv_pool = (platform.stacked_kv_pool and not branch_free
                                and reads_stacked_pools(attention_fn))
        # Everything but the params and the pool is replicated over the mesh (None: one device).
        self._replicated = None if mesh is None else sharding.replicated(mesh)
        self.num_speculative_tokens = num_speculative_tokens
        self.max_spec_seqs = max_spec_seqs
        self.ngram = None
        if ngram_lookup is not None:
            self.ngram = NgramDrafting(num_speculative_tokens, *ngram_lookup, page_size,
                                       config.vocab_size)
        self.step_layouts = {
            t: StepLayout(t, self.num_seqs_for(t), self.prompt_logprob_rows, BLOCK_TABLE_WRITES,
                          self.logits_rows_for(t),
                          min(self.num_seqs_for(t), max_spec_seqs) if self.ngram else 0)
            for t in self.token_buckets}
        row_counts = sorted({layout.num_logits_rows for layout in self.step_layouts.values()})
        if decode_steps is None:
            decode_steps = platform.decode_steps
        self.decode_buckets = decode_buckets(self.token_buckets, max_num_seqs) if decode_steps else ()
        # The MoE layers' expert GEMMs: the platform's choice, as the step's other kernels.
        grouped_gemm = moe.get_grouped_gemm(platform.moe_grouped_gemm, platform.interpret_pallas)
        self.programs = jit_programs(
            config, params, attention_fn, grouped_gemm, mesh, row_counts[-1], branch_free,
            self.step_layouts, row_counts, self.stacked_kv_pool, num_speculative_tokens, draft,
            page_size, self.ngram, self.decode_buckets)
        self.draft = draft
        self.draft_k_cache = self.draft_v_cache = None  # allocate_kv_cache
        # The draft model's q of the last proposed drafts (draft_model.propose), and each
        # request's row there (its drafts' q: rows * k + j).
        self._draft_probs = None
        self._proposed_rows: dict[str, int] = {}
        if draft is not None:
            self._draft_probs = jnp.zeros(
                (max_spec_seqs * num_speculative_tokens, config.vocab_size), jnp.float32)
        # An EAGLE head's h of each slot's newest computed position (InputBatch.hidden_pos)
        self.slot_hidden = None
        if isinstance(draft, EagleHead):
            self.slot_hidden = jnp.zeros((max_num_seqs, config.hidden_size),
                                         params["embed_tokens"].dtype)
        self.compiled: Programs | None = None  # compile_buckets
        self._prev_sampled = jnp.zeros(row_counts[-1], jnp.int32, device=self._replicated)
        # The n-gram method's drafting state (device_drafts): the last step's row drafts and
        # each slot's token history, made by a jitted call as the block table below.
        self._drafting = None
        if self.ngram is not None:
            self._drafting = jax.jit(lambda: (
                jnp.full(row_counts[-1], -1, jnp.int32),
                jnp.zeros((max_num_seqs, max_model_len), jnp.int32)),
                out_shardings=self._replicated)()
        # The InputBatch's block table, kept on the device: a step sends only the entries that
        # changed (the whole table is 8 MB at 256 sequences of 131,072 tokens; staging it would
        # cost ~2 ms of an idle engine's first token on the H200, docs/performance.md). Created by
        # a jitted call, as the sampling state below.
        self.block_table = jax.jit(
            partial(jnp.zeros, (max_num_seqs, self.max_pages_per_seq), jnp.int32),
            out_shardings=self._replicated)()
        # Grammar bitmask rows (structured outputs): ceil(V / 32) int32 words per sequence.
        # A step without constrained rows passes the all-allowed mask of its S, kept on the
        # device, so such steps move no bitmask to the device.
        self.bitmask_width = bitmask_width(config.vocab_size)
        self._no_bitmask: dict[int, jax.Array] = {}  # by S
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
        st = self.sampling_state
        self.inputs = InputBuilder(
            self.input_batch, self.step_layouts, page_size=page_size,
            vocab_size=config.vocab_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            prompt_logprob_rows=self.prompt_logprob_rows, block_table_writes=BLOCK_TABLE_WRITES,
            bias_width=st.bias_ids.shape[1], stop_width=st.stop_ids.shape[1],
            num_speculative_tokens=num_speculative_tokens)

    def _kv_pool(self, num_pages: int, draft: bool = False):
        """(shape of one K (or V) pool, its sharding, how many), KV the layout's, D the pool's
        head width (``pool_head_dim``): L pools of [KV, num_pages, page_size, D], or where the
        platform stacks the pool (``Platform.stacked_kv_pool``) one [L, KV, num_pages,
        page_size, D] (count None); split
        over the mesh by KV head, None on one device. ``draft``: the draft model's pool (one
        device, one pool a layer: its few layers run unrolled)."""
        if draft:
            c = self.draft.config
            return ((c.num_kv_heads, num_pages, self.page_size, self.draft_pool_head_dim), None,
                    c.num_layers)
        c, stacked = self.config, self.stacked_kv_pool
        shape = (self.layout.num_kv_heads, num_pages, self.page_size, self.pool_head_dim)
        where = None if self.mesh is None else sharding.kv_sharding(self.mesh, stacked)
        return ((c.num_layers, *shape), where, None) if stacked else (shape, where, c.num_layers)

    def pool_structs(self, num_pages: int, draft: bool = False) -> tuple:
        """(K pools, V pools) of num_pages pages as shapes only (``kv_quant.pool_struct``), to
        compile against a pool that is not allocated; ``draft``: the draft model's (empty
        lists when there is none)."""
        if draft and self.draft is None:
            return [], []
        shape, where, count = self._kv_pool(num_pages, draft)
        kv = kv_quant.pool_struct(shape, self.kv_dtype, where)
        return (kv, kv) if count is None else ([kv] * count, [kv] * count)

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
        pools = []
        for draft in (False, True)[: 1 + (self.draft is not None)]:
            shape, where, count = self._kv_pool(num_pages, draft)
            pools.append(self.executables.compile(
                jit_zeroed_pools(shape, self.kv_dtype, count, where))())
        shards = [s.data for x in jax.tree.leaves(pools) for s in x.addressable_shards]
        distinct, total = len({x.unsafe_buffer_pointer() for x in shards}), len(shards)
        if distinct < total:
            del pools, shards
            raise ValueError(
                f"the KV pool ({num_pages} pages) did not fit in the device allocator: "
                f"{distinct} of its arrays got memory of their own, out of {total}")
        self.k_cache, self.v_cache = pools[0]
        if self.draft is not None:
            self.draft_k_cache, self.draft_v_cache = pools[1]

    def profile_peak_bytes(self, num_pages: int) -> int:
        """``kv_sizing.peak_program_bytes`` of the programs that can need the most
        (``compilation.profile_peak_bytes``), each compiled against a pool of num_pages pages
        given by shapes only (nothing is allocated). On a mesh, the bytes of one device (XLA
        analyses the partitioned program). ``compile_buckets`` then measures every program at
        the real pool size."""
        return compilation.profile_peak_bytes(self.executables, self.programs,
                                              self._placeholder_args_for(num_pages),
                                              self._compiler_options)

    def num_seqs_for(self, num_tokens_bucket: int) -> int:
        return min(num_tokens_bucket, self.max_num_seqs)

    def logits_rows_for(self, num_tokens_bucket: int) -> int:
        """L of a bucket: a row per sequence, and one per draft token of at most max_spec_seqs
        sequences; never more than its tokens (a draft is a token)."""
        s = self.num_seqs_for(num_tokens_bucket)
        extra = min(s, self.max_spec_seqs) * self.num_speculative_tokens
        return min(num_tokens_bucket, s + extra) if extra else s

    def _bucket(self, num_tokens: int, num_rows: int) -> int:
        """The smallest token bucket with num_tokens tokens and num_rows logits rows.

        Raises:
          RuntimeError: none has (a scheduling bug).
        """
        for t in self.token_buckets:
            if t >= num_tokens and self.step_layouts[t].num_logits_rows >= num_rows:
                return t
        raise RuntimeError(f"no token bucket holds {num_tokens} tokens and {num_rows} rows")

    def _placeholder_args_for(self, num_pages: int) -> Programs:
        """``placeholder_args`` with pools of num_pages pages given by shapes only."""
        return self.placeholder_args(*self.pool_structs(num_pages),
                                     *self.pool_structs(num_pages, draft=True))

    def placeholder_args(self, k_cache, v_cache, draft_k_cache=(), draft_v_cache=()) -> Programs:
        """Placeholder arguments of every program, for their compilation, with the given pools
        (arrays, or ShapeDtypeStructs to compile against pools that are not allocated; the
        draft model's, when there is one)."""
        st = self.sampling_state
        drafts = {}
        if self.draft is not None:
            rows = np.zeros(self.max_spec_seqs, np.int32)
            eagle = () if self.slot_hidden is None else (self.slot_hidden,)
            drafts = dict(
                draft_step={t: (self.draft.params, np.zeros(layout.size, np.int32),
                                self._prev_sampled, draft_k_cache, draft_v_cache,
                                self.block_table, *self._eagle_step_args(t))
                            for t, layout in self.step_layouts.items()},
                propose=(self.draft.params, draft_k_cache, draft_v_cache, self.block_table,
                         rows, rows, rows, np.int32(0),
                         neutral(SamplingMetadata, self.max_spec_seqs), *eagle),
                draft_page_copy=(draft_k_cache, draft_v_cache, np.zeros(self.max_num_seqs,
                                                                          np.int32),
                                 np.zeros(self.max_num_seqs, np.int32)))
            if eagle:
                drafts["hidden_fixup"] = (self.slot_hidden, self._rows_hidden_struct(),
                                          rows, rows)
        drafting = ()
        if self._drafting is not None:
            drafting = self._drafting
            drafts["history_write"] = (self._drafting[1], np.int32(0),
                                       np.zeros(self.max_model_len, np.int32))
        pages = np.zeros(self.max_num_seqs, np.int32)
        entries = np.zeros(BLOCK_TABLE_WRITES, np.int32)
        hidden = jax.ShapeDtypeStruct((self.prompt_logprob_rows, self.config.hidden_size),
                                      self.params["embed_tokens"].dtype)
        step = {t: (self.params, np.zeros(layout.size, np.int32), self._prev_sampled, k_cache,
                    v_cache, self.block_table, *drafting)
                for t, layout in self.step_layouts.items()}
        return Programs(
            step=step, decode_step={t: step[t] for t in self.decode_buckets},
            filter={s: self._filter_args(s) for s in self.programs.filter},
            state_writer=(st, np.int32(0), np.zeros(self.max_model_len, np.int32), np.int32(0),
                          np.int32(0), np.asarray(st.bias_ids[0]), np.asarray(st.bias_values[0]),
                          np.asarray(st.stop_ids[0])),
            page_copy=(k_cache, v_cache, pages, pages),
            block_table_write=(self.block_table, entries, entries, entries),
            prompt_logprobs=(self.params, hidden, np.zeros(self.prompt_logprob_rows, np.int32)),
            **drafts)

    def _eagle_step_args(self, t: int) -> tuple:
        """Placeholders of ``programs._eagle_step``'s arguments after the pool and block table,
        for bucket t (none without an EAGLE head)."""
        if self.slot_hidden is None:
            return ()
        width = self.config.hidden_size * max(1, len(self.draft.aux_layers))
        hidden = jax.ShapeDtypeStruct((t, width), self.slot_hidden.dtype)
        return hidden, self.slot_hidden, np.zeros((3, self.step_layouts[t].seqs), np.int32)

    def _rows_hidden_struct(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self._prev_sampled.shape[0], self.config.hidden_size),
                                    self.slot_hidden.dtype)

    def _filter_args(self, s: int) -> tuple:
        """Placeholder arguments of the sampler of s logits rows (``programs._filter``)."""
        logits = jax.ShapeDtypeStruct((s, self.config.vocab_size), jnp.float32,
                                      sharding=self._replicated)
        if s not in self._no_bitmask:
            # jitted, as the sampling state: a device_put cannot place it over two hosts
            self._no_bitmask[s] = jax.jit(
                partial(jnp.full, (s, self.bitmask_width), -1, jnp.int32),
                out_shardings=self._replicated)()
        return (logits, self._prev_sampled, neutral(SamplingMetadata, s),
                neutral(FilterMetadata, s), self.sampling_state, self._no_bitmask[s],
                self._draft_probs)

    def _compiler_options(self, tokens: int) -> dict | None:
        """XLA options of the step for a bucket of ``tokens``. On a GPU, XLA updates a step's
        command buffers (CUDA graphs) whenever its buffers move, which they do on every call:
        host time before the first kernel, hidden behind the step in flight while the engine is
        busy but paid in full by a prompt that arrives at an idle engine (its TTFT). Steps of
        prefill size run long enough that launching their kernels one by one costs nothing, so
        they go without; decode-size steps keep the graphs (docs/performance.md). With FP8
        linear weights, the platform's ``fp8_step_options`` too."""
        options = dict(self.platform.fp8_step_options) if self.quantization else {}
        min_tokens = self.platform.op_by_op_min_tokens
        if min_tokens is not None and tokens >= min_tokens:
            options["xla_gpu_enable_command_buffer"] = ""
        return options or None

    def compile_buckets(self, num_pages: int, log: Callable[[str], None] = print) -> None:
        """Compile every program (``compilation.compile_programs``: the step of every token
        bucket, the filtered sampler of every sequence count, the others) against a pool of
        num_pages pages (``allocate_kv_cache`` may come after), and set ``peak_program_bytes``
        over all of them (``kv_sizing.peak_program_bytes``)."""
        self.compiled = compilation.compile_programs(
            self.executables, self.programs, self._placeholder_args_for(num_pages),
            self._compiler_options, log)
        self.peak_program_bytes = peak_program_bytes(
            [compilation.memory_of(c) for _, _, c in self.compiled.entries()])

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
        needs_state = b.update_states(sched)
        for slot, r in needs_state:
            self.sampling_state = self.compiled.state_writer(
                self.sampling_state, *self.inputs.state_row(slot, r))
        if self._drafting is not None:  # entering requests' histories (device_drafts)
            for r in sched.new_reqs:
                slot, tokens = self.inputs.state_row(b.req_index[r.req_id], r)[:2]
                self._drafting = (self._drafting[0], self.compiled.history_write(
                    self._drafting[1], slot, tokens))
        n_tok = sched.total_num_scheduled_tokens
        if n_tok == 0:
            return None
        # Forked choices are rows without tokens, so a step may hold more rows than tokens.
        num_rows = len(sched.num_scheduled_tokens) + sum(
            map(len, sched.scheduled_spec_decode_tokens.values()))
        t = self._bucket(n_tok, num_rows)
        step = self.compiled.step.get(t)
        if (t in self.compiled.decode_step and num_rows == n_tok
                and max(sched.num_scheduled_tokens.values()) == 1):
            step = self.compiled.decode_step[t]  # a token for each sequence: decodes only
        if step is None:
            raise RuntimeError(f"bucket tokens={t} was not compiled at start-up")
        if self.lora is not None:  # the step's adapters into the device pool, if not there
            slots = np.fromiter((b.req_index[r] for r in sched.num_scheduled_tokens), np.int32)
            self.params, b.lora_slot[slots] = self.lora.activate(self.params,
                                                                 b.lora_int_id[slots])
        x = self.inputs.build(sched, t, self._step_count - 1)
        for r, c, p in x.early_block_table_writes:
            self.block_table = self.compiled.block_table_write(self.block_table, r, c, p)
        drafting = self._drafting or ()
        sampled, logits, hidden, self.k_cache, self.v_cache, self.block_table, *aux = step(
            self.params, x.packed, self._prev_sampled, self.k_cache, self.v_cache,
            self.block_table, *drafting)
        draft_ids, sm = x.draft_ids, x.sm
        if drafting:  # the drafts the step made, and its rows' settled output indices
            row_drafts, steps, history = aux.pop(0)
            self._drafting = (row_drafts, history)
            draft_ids = row_drafts
            sm = dataclasses.replace(sm, steps=steps)
        rows_hidden = None
        if self.draft is not None:  # the draft pool covers every token the target's does
            out = self.compiled.draft_step[t](
                self.draft.params, x.packed, self._prev_sampled, self.draft_k_cache,
                self.draft_v_cache, self.block_table, *self._eagle_inputs(t, x, aux))
            self.draft_k_cache, self.draft_v_cache = out[:2]
            if aux:
                self.slot_hidden, rows_hidden = out[2:]
        f = self.inputs.filter_inputs(sched, x, self._draft_prob_rows(x))
        copies = self.inputs.page_copies(sched)
        if copies is not None:
            self.k_cache, self.v_cache = self.compiled.page_copy(self.k_cache, self.v_cache,
                                                                 *copies)
            if self.draft is not None:
                self.draft_k_cache, self.draft_v_cache = self.compiled.draft_page_copy(
                    self.draft_k_cache, self.draft_v_cache, *copies)
        prompt_logprobs = None
        if x.prompt_spans:
            prompt_logprobs = self.compiled.prompt_logprobs(self.params, hidden, x.prompt_targets)
        self._step_count += 1
        b.num_computed_tokens[x.slots] = x.context
        seqs = np.flatnonzero(x.samples)
        rows = x.last_rows[seqs]
        b.in_flight_row[x.slots[seqs]] = rows
        b.in_flight_step[x.slots[seqs]] = self._step_count - 1
        b.in_flight_drafts[x.slots[seqs]] = x.num_drafts[seqs]
        handle = StepHandle(self._step_count - 1, sampled, rows, [x.req_ids[i] for i in seqs],
                            x.num_drafts[seqs], draft_ids, x.seq_start, None,
                            f.logprob_ks[seqs], prompt_logprobs, x.prompt_spans,
                            x.prompt_targets, propose=sched.propose_drafts,
                            rows_hidden=rows_hidden)
        self._prev_sampled = sampled
        if f.fm is not None:
            fm = f.fm
            if drafting:
                fm = dataclasses.replace(fm, draft_ids=draft_ids[: len(fm.draft_ids)])
            handle.filter_inputs = (logits, sm, fm, np.flatnonzero(f.structured),
                                    f.want_logprobs, self._draft_probs)
            if not f.structured.any() or sched.grammar_bitmask is not None:
                self.sample_filtered(handle, sched.grammar_bitmask)
        else:
            sampled.copy_to_host_async()
        if drafting:
            draft_ids.copy_to_host_async()
        return handle

    def _eagle_inputs(self, t: int, x, aux: list) -> tuple:
        """``programs._eagle_step``'s inputs after the block table, for the step ``x`` of
        bucket t (InputBatch not yet advanced): the step's hidden states and the carry rows;
        records each sequence's newest h position (``InputBatch.hidden_pos``). () without an
        EAGLE head."""
        if not aux:
            return ()
        b, n = self.input_batch, len(x.slots)
        start = b.num_computed_tokens[x.slots]
        carry = np.zeros((3, self.step_layouts[t].seqs), np.int32)
        carry[1] = self.max_num_seqs  # padding: written nowhere
        carry[:, :n] = [(start > 0) & (b.hidden_pos[x.slots] == start - 1), x.slots,
                        x.last_rows]
        b.hidden_pos[x.slots] = x.context - 1
        return aux[0], self.slot_hidden, carry

    def _draft_prob_rows(self, x) -> np.ndarray | None:
        """[m] int32: per logits row of the step ``x``, the row of ``_draft_probs`` holding the
        q of the draft it verifies (-1: none); None without a draft model."""
        if self.draft is None:
            return None
        first = np.array([self._proposed_rows.get(r, -1) for r in x.req_ids], np.int32)
        first = first * self.num_speculative_tokens
        seq_first = first[x.row_seq]
        j = np.arange(len(x.row_seq), dtype=np.int32) - x.seq_start
        return np.where((x.draft_ids >= 0) & (seq_first >= 0), seq_first + j, -1).astype(np.int32)

    def sample_filtered(self, handle: StepHandle, grammar_bitmask: np.ndarray | None) -> None:
        """Dispatch the filtered sampler of a step that ``execute`` left waiting for its
        constrained rows' bitmask (``handle.awaits_bitmask``), or of any step needing it.

        Args:
          handle: the step.
          grammar_bitmask: [constrained rows, W] int32 in the order of
            ``SchedulerOutput.structured_output_request_ids``; None when none.
        """
        logits, sm, fm, struct_rows, want_logprobs, draft_probs = handle.filter_inputs
        s = logits.shape[0]
        bitmask = self._no_bitmask[s]
        if grammar_bitmask is not None:
            bitmask = np.full((s, self.bitmask_width), -1, np.int32)
            bitmask[struct_rows] = grammar_bitmask
        sampled, self.sampling_state, lp = self.compiled.filter[s](
            logits, handle.sampled, sm, fm, self.sampling_state, bitmask, draft_probs)
        handle.sampled = self._prev_sampled = sampled
        # get_output's copy starts when the sampler ends, beside what the device runs next
        sampled.copy_to_host_async()
        handle.logprobs = lp if want_logprobs else None
        handle.filter_inputs = None

    def step_drafts(self, handle: StepHandle, sched: SchedulerOutput) -> dict | None:
        """The drafts the step made on the device (the n-gram method's) for its constrained
        sequences that verify some: req_id -> [k] int32 (-1 or the vocabulary size where the
        lookup found none), for their grammar's masks; waits for the step. None where the
        step's drafts are ``sched``'s own (made on the host) or none is constrained."""
        if not isinstance(handle.draft_ids, jax.Array):
            return None
        constrained = set(sched.structured_output_request_ids)
        spans = [(rid, row, k) for rid, row, k in zip(handle.req_ids, handle.rows.tolist(),
                                                     handle.num_drafts.tolist())
                 if k and rid in constrained]
        if not spans:
            return None
        draft_ids = np.asarray(handle.draft_ids)
        return {rid: draft_ids[row - k : row].tolist() for rid, row, k in spans}

    def device_state_ok(self) -> bool:
        """Whether the device arrays every step reads survived (the KV pool, the block table,
        the sampler state, the last step's tokens; the draft model's pool and q; the n-gram
        method's drafts and token history): none deleted
        (donated to a program that then failed) and none holding a failed program's error."""
        arrays = jax.tree.leaves((self.k_cache, self.v_cache, self.block_table,
                                  self._prev_sampled, self.sampling_state, self.draft_k_cache,
                                  self.draft_v_cache, self._draft_probs, self.slot_hidden,
                                  self._drafting))
        try:
            if any(a.is_deleted() for a in arrays):
                return False
            jax.block_until_ready(arrays)
        except Exception:  # noqa: BLE001 - whatever the failed program left, it cannot serve
            return False
        return True

    def get_output(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a dispatched step; returns its sampled tokens (for the requests whose step
        ended at their last token; prompt chunks sample nothing) and log-probabilities. A
        request that verified drafts gets the tokens of its emitted rows
        (``rejection_sampler.emitted_rows``): the drafts accepted, then the sampled token; its
        rejected drafts' K/V positions count as not computed (they are written again).

        Raises:
          RuntimeError: the step still awaits its grammar bitmask (``sample_filtered``).
        """
        if handle.awaits_bitmask:
            raise RuntimeError("the step's constrained rows were never sampled")
        # replicated: this process's copy, also with a mesh over several hosts
        sampled = np.asarray(handle.sampled)
        m = len(handle.seq_start)
        draft_ids = handle.draft_ids
        num_proposed = {}
        if isinstance(draft_ids, jax.Array):  # made by the step (device_drafts)
            draft_ids = np.asarray(draft_ids)[:m]
            # proposed[r]: drafts in the rows before r (a filler verifies V, no token)
            valid = (draft_ids >= 0) & (draft_ids < self.config.vocab_size)
            proposed = np.concatenate([[0], np.cumsum(valid)])
            for rid, row, k in zip(handle.req_ids, handle.rows.tolist(),
                                   handle.num_drafts.tolist()):
                n = int(proposed[row] - proposed[row - k])  # rows row - k .. row - 1
                if n < k:
                    num_proposed[rid] = n
        emitted = emitted_rows(sampled[:m], draft_ids, handle.seq_start)
        # per request: its emitted rows, the first num_drafts + 1 rows ending at its last row
        per_req = [first + np.flatnonzero(emitted[first : last + 1])
                   for first, last in zip((handle.rows - handle.num_drafts).tolist(),
                                          handle.rows.tolist())]
        tokens = [sampled[r].tolist() for r in per_req]
        rejected = [k + 1 - len(r) for k, r in zip(handle.num_drafts.tolist(), per_req)]
        self.input_batch.record_sampled(handle.step, handle.rows, handle.req_ids, tokens,
                                        rejected)
        logprobs = {}
        if handle.logprobs is not None:
            lp = _host_logprobs(handle.logprobs, sampled)
            for rid, rows, k in zip(handle.req_ids, per_req, handle.logprob_ks.tolist()):
                if k >= 0:
                    logprobs[rid] = _trim(lp, rows.tolist(), [k] * len(rows))
        prompt_logprobs = {}
        if handle.prompt_logprobs is not None:
            lp = _host_logprobs(handle.prompt_logprobs, handle.prompt_targets)
            for rid, first, start, n, k in handle.prompt_spans:
                rows = range(start, start + n)
                prompt_logprobs[rid] = (first, _trim(lp, rows, [k] * n))
        accepted = {rid: t[:-1] for rid, t, k in zip(handle.req_ids, tokens,
                                                    handle.num_drafts.tolist()) if k}
        if handle.rows_hidden is not None and any(rejected):
            self._fix_hidden(handle, rejected)
        drafts = self._propose(handle.req_ids, tokens) if handle.propose else {}
        return ModelRunnerOutput({rid: t[-1] for rid, t in zip(handle.req_ids, tokens)},
                                 logprobs, prompt_logprobs, accepted, drafts, num_proposed)

    def _fix_hidden(self, handle: StepHandle, rejected: list[int]) -> None:
        """An EAGLE head's h of the sequences that rejected drafts: that of their last emitted
        row, not of their last row (``eagle.write_slot_hidden``)."""
        b = self.input_batch
        fix = [(b.req_index[rid], row - back, back) for rid, row, back in
               zip(handle.req_ids, handle.rows.tolist(), rejected)
               if back and rid in b.req_index]
        if not fix:
            return
        slots, rows, back = np.array(fix, np.int32).T
        b.hidden_pos[slots] -= back
        at = np.zeros((2, self.max_spec_seqs), np.int32)
        at[0] = self.max_num_seqs  # padding: written nowhere
        at[:, : len(fix)] = slots, rows
        self.slot_hidden = self.compiled.hidden_fixup(self.slot_hidden, handle.rows_hidden,
                                                      *at)

    def _propose(self, req_ids: list[str], tokens: list[list[int]]) -> dict[str, list[int]]:
        """The draft model's k drafts (``draft_model.propose``) after each request's newest
        token (``tokens[i][-1]``, just recorded), for those still in the batch whose pages
        reach k positions past it (the scheduler's lookahead; not near max_model_len). Waits
        for them: the scheduler needs them for the next step."""
        b, k, ps = self.input_batch, self.num_speculative_tokens, self.page_size
        slots = np.fromiter((b.req_index.get(r, -1) for r in req_ids), np.int32, len(req_ids))
        pos = b.num_computed_tokens[slots]
        ok = (slots >= 0) & (pos + k <= self.max_model_len)
        ok &= (pos + k - 1) // ps < b.num_blocks[slots]
        ok &= b.num_tokens[slots] == pos + 1  # the newest token is the only one not computed
        if self.slot_hidden is not None:  # an EAGLE head starts from the h before that token
            ok &= b.hidden_pos[slots] == pos - 1
        live = np.flatnonzero(ok)
        n = len(live)
        self._proposed_rows = {}
        if n == 0 or n > self.max_spec_seqs:
            return {}
        rows = np.zeros((3, self.max_spec_seqs), np.int32)
        rows[:, :n] = [[tokens[i][-1] for i in live], pos[live], slots[live]]
        # the first draft's output index: the tokens after the prompt, the newest included
        steps = (b.num_tokens - b.num_prompt_tokens)[slots[live]]
        sm = SamplingMetadata(**self.inputs.gather(SAMPLING, slots[live], self.max_spec_seqs,
                                                   steps=steps))
        eagle = () if self.slot_hidden is None else (self.slot_hidden,)
        drafts, self._draft_probs, self.draft_k_cache, self.draft_v_cache = (
            self.compiled.propose(self.draft.params, self.draft_k_cache, self.draft_v_cache,
                                  self.block_table, *rows, np.int32(n), sm, *eagle))
        drafts = np.asarray(drafts)
        self._proposed_rows = {req_ids[i]: j for j, i in enumerate(live)}
        return {req_ids[i]: drafts[j].tolist() for j, i in enumerate(live)}
