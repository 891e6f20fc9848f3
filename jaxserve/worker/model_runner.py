"""ModelRunner: turns a SchedulerOutput into padded device inputs and runs the jitted step.

One step = one call of a compiled executable: model forward over the ragged batch, KV write into
the donated pool, and sampling. Token counts T come from a fixed list of buckets (powers of two
up to max_num_batched_tokens); the sequence count is S = min(T, max_num_seqs), and the block
table always has the width P of a max_model_len sequence. Attention reads pages only as far as
each sequence's length reaches, so its cost follows the real contexts, not P; that keeps the
number of compiled shapes to the token buckets alone (docs/design.md section 3; P buckets were
tried and multiplied start-up compilation). Every bucket is compiled ahead of time by
``compile_buckets``; ``execute`` never compiles (it raises if asked to).
"""

import time
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.core.scheduler import SchedulerOutput
from jaxserve.models import llama
from jaxserve.worker.sampler import SamplingMetadata, sample


def powers_of_two_up_to(limit: int, start: int = 1) -> list[int]:
    """[start, 2 start, 4 start, ...] below limit, then limit itself."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


def _bucket(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def _step(config, attention_fn, params, token_ids, md, k_cache, v_cache, logits_indices, sm):
    logits, k_cache, v_cache = llama.forward(
        config, params, token_ids, md, k_cache, v_cache, logits_indices, attention_fn=attention_fn
    )
    return sample(logits, sm), k_cache, v_cache


class ModelRunner:
    """Owns the parameters, the KV pool and the compiled step of each bucket.

    Args:
      config: model shapes.
      params: the model's params, one dict per layer (``jaxserve.models.llama``), on the device.
      page_size: tokens per page.
      max_num_seqs, max_num_batched_tokens, max_model_len: scheduler limits (tokens/sequences).
      kv_dtype: dtype of the KV pool.
      attention_fn: pallas_kernels attention entry point.
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
    ):
        self.config = config
        self.params = params
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.token_buckets = powers_of_two_up_to(max_num_batched_tokens)
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.kv_dtype = kv_dtype
        self.k_cache = self.v_cache = None  # allocate_kv_cache, once the pool is sized
        self._jitted = jax.jit(partial(_step, config, attention_fn), donate_argnums=(3, 4))
        self._compiled: dict[int, Callable] = {}

    def _kv_shapes(self, num_pages: int):
        c = self.config
        return [(c.num_kv_heads, num_pages, self.page_size, c.head_dim)] * c.num_layers

    def allocate_kv_cache(self, num_pages: int) -> None:
        """Allocate the (zeroed) K and V pools of num_pages pages, page 0 included."""
        shapes = self._kv_shapes(num_pages)
        self.k_cache = [jnp.zeros(s, self.kv_dtype) for s in shapes]
        self.v_cache = [jnp.zeros(s, self.kv_dtype) for s in shapes]

    def profile_step_bytes(self, num_pages: int) -> int:
        """Device bytes the largest token bucket's step needs beyond its arguments, from XLA's
        memory analysis of that bucket compiled against a pool of num_pages pages (described
        by shapes only: nothing is allocated). 0 if the backend gives no analysis."""
        from jaxserve.engine.kv_sizing import step_bytes_from_memory_analysis

        shapes = self._kv_shapes(num_pages)
        sds = lambda s: jax.ShapeDtypeStruct(s, self.kv_dtype)
        kv = [sds(s) for s in shapes]
        token_ids, md, logits_indices, sm = self._dummy_inputs(self.token_buckets[-1])
        compiled = self._jitted.lower(self.params, token_ids, md, kv, kv, logits_indices, sm).compile()
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
        return zeros_t, md, np.zeros(s, np.int32), sm

    def compile_buckets(self, log: Callable[[str], None] = print) -> None:
        """Compile the step for every token bucket, with a progress line each."""
        start = time.perf_counter()
        for i, t in enumerate(self.token_buckets, 1):
            token_ids, md, logits_indices, sm = self._dummy_inputs(t)
            lowered = self._jitted.lower(
                self.params, token_ids, md, self.k_cache, self.v_cache, logits_indices, sm
            )
            self._compiled[t] = lowered.compile()
            log(
                f"compiling buckets (or loading them from the cache): {i}/{len(self.token_buckets)} "
                f"(tokens={t}) {time.perf_counter() - start:.1f}s"
            )

    def execute(self, sched: SchedulerOutput) -> list[int]:
        """Run one step; returns the token sampled for each scheduled request, in order (tokens
        of requests still inside their prompt are meaningless and ignored by the scheduler)."""
        n_tok = sched.num_tokens
        n_seq = len(sched.scheduled)
        t = _bucket(self.token_buckets, n_tok)
        s = self.num_seqs_for(t)
        p = self.max_pages_per_seq
        token_ids = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        slots = np.zeros(t, np.int32)
        qsl = np.full(s + 1, n_tok, np.int32)
        seq_lens = np.zeros(s, np.int32)
        block_tables = np.zeros((s, p), np.int32)
        logits_indices = np.zeros(s, np.int32)
        temperature = np.zeros(s, np.float32)
        top_k = np.zeros(s, np.int32)
        top_p = np.ones(s, np.float32)
        seeds = np.zeros(s, np.uint32)
        steps = np.zeros(s, np.int32)
        ps = self.page_size
        off = 0
        for i, (req, n) in enumerate(sched.scheduled):
            c = req.num_computed_tokens
            pos = np.arange(c, c + n, dtype=np.int32)
            bt = np.asarray(req.block_ids, np.int32)
            token_ids[off : off + n] = req.all_token_ids[c : c + n]
            positions[off : off + n] = pos
            slots[off : off + n] = bt[pos // ps] * ps + pos % ps
            qsl[i] = off
            seq_lens[i] = c + n
            block_tables[i, : len(bt)] = bt
            off += n
            logits_indices[i] = off - 1
            sp = req.sampling_params
            temperature[i] = sp.temperature
            top_k[i] = sp.top_k
            top_p[i] = sp.top_p
            seeds[i] = req.seed
            steps[i] = req.num_output_tokens
        md = llama.AttentionMetadata(positions, slots, qsl, seq_lens, block_tables)
        sm = SamplingMetadata(temperature, top_k, top_p, seeds, steps)
        step = self._compiled.get(t)
        if step is None:
            raise RuntimeError(f"bucket tokens={t} was not compiled at start-up")
        sampled, self.k_cache, self.v_cache = step(
            self.params, token_ids, md, self.k_cache, self.v_cache, logits_indices, sm
        )
        return np.asarray(sampled)[:n_seq].tolist()
