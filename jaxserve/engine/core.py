"""EngineCore: scheduler + KV pool + model runner behind add_request / abort / step.

The HTTP server runs it in its own process (core_proc); ``jaxserve.LLM`` runs it in process.
Token ids in, token ids out: no text here.
"""

import atexit
import functools
import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import distributed, host_memory
from jaxserve.config import EngineConfig, ModelConfig, resolve_config
from jaxserve.sampling_params import describe_sampling_defaults
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.spec_decode import eagle
from jaxserve.spec_decode.draft_model import DraftModel, check_vocabulary
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.engine import (
    EngineCoreOutput,
    EngineCoreRequest,
    SchedulerStats,
    kv_sizing,
)
from jaxserve.exceptions import ValidationError
from jaxserve.lora import manager as lora_manager
from jaxserve.model_loader import (
    load_checkpoint,
    load_generation_config,
    resolve_model,
)
from jaxserve.model_loader.tokenizer_export import TokenizerExport
from jaxserve.model_loader.default_model import cache_dir
from jaxserve.models import sharding
from jaxserve.models.fp8_checkpoint import resolve_method
from jaxserve.models.registry import build_params, resolve_kv_cache_dtype
from jaxserve.platforms import current_platform
from jaxserve.structured_output.manager import StructuredOutputManager, token_bitmask
from jaxserve.tokenizer_io import TokenizerVocab, load_tokenizer
from jaxserve.worker.executable_cache import ExecutableCache
from jaxserve.worker.model_runner import ModelRunner
from pallas_kernels import get_attention_fn, kv_quant

def enable_compilation_cache() -> None:
    """Keep XLA's compiles of the start-up's other programs (parameter set-up, ...) in JAX's
    persistent cache ($JAXSERVE_CACHE/jax-compiles); the model runner's programs go to the
    executable cache ($JAXSERVE_CACHE/executables), which skips their tracing too."""
    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "jax-compiles"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def kv_bytes_per_page(model_config, layout: sharding.Layout, head_dim: int, page_size: int,
                      kv_dtype) -> int:
    """K and V bytes of one page on one device: the KV heads the layout gives each device, of
    the pool's head width ``head_dim`` (``ModelRunner.pool_head_dim``), and an FP8 pool's
    scales."""
    c = model_config
    return kv_sizing.kv_bytes_per_page(
        c.num_layers, layout.kv_heads_per_device, head_dim, page_size,
        np.dtype(kv_dtype).itemsize, kv_quant.scale_bytes(kv_dtype))



def load_drafter(method: str, model: str, target_hf_config: dict, target: ModelConfig,
                 target_params: dict, dtype, config: EngineConfig,
                 mesh) -> DraftModel | eagle.EagleHead:
    """The draft_model method's model or an EAGLE head, its params in ``dtype`` on the one
    device; an EAGLE ``model`` "dummy" is a random head of the target's shapes
    (``eagle.random_weights``, drawn from ``config.seed``).

    Raises:
      ValueError: naming the field: "model": a path that holds no model, a vocabulary (or,
        EAGLE, a hidden size) other than the target's, a head not in its method's layout
        (``eagle.load_head``); "method": a tensor-parallel mesh (the drafter's pool is not
        split), a target an EAGLE head does not attach to.
    """
    if mesh is not None:
        raise ValueError(f"method {method!r} runs on one device; drop --tensor-parallel-size")
    if method in eagle.METHODS:
        eagle.check_target(target)
        if model == eagle.DUMMY:
            cfg = eagle.head_config(target_hf_config, method)
            weights = eagle.random_weights(cfg, method, seed=config.seed, dtype=np.dtype(dtype))
            return eagle.load_head(method, cfg, weights, target, target_params, dtype)
    try:
        source, fmt = resolve_model(model)
        ckpt = load_checkpoint(source, fmt, with_tokenizer=False)
    except (ValueError, OSError) as e:
        raise ValueError(f"model {model!r}: {e}") from None
    if method in eagle.METHODS:
        return eagle.load_head(method, ckpt.hf_config, ckpt.weights, target, target_params,
                               dtype)
    draft_config = ModelConfig.from_hf_config(ckpt.hf_config)
    check_vocabulary(draft_config, target)
    draft_config, params = build_params(ckpt.hf_config, ckpt.weights, dtype, config.seed,
                                        max_model_len=config.max_model_len)
    return DraftModel(draft_config, params)


def _timed(fn, *args):
    """(fn(*args), seconds it took)."""
    t = time.perf_counter()
    return fn(*args), time.perf_counter() - t


def _structured_output_manager(tokenizer_future, model_config):
    """(StructuredOutputManager, EOS ids, seconds), once ``tokenizer_future`` (of ``_timed``)
    has written the tokenizer's folder. Generation ends at the model's EOS ids (config.json /
    GGUF) and the tokenizer's own."""
    folder = tokenizer_future.result()[0]
    vocab = TokenizerVocab.read(folder)
    eos = set(model_config.eos_token_ids) | {vocab.eos_token_id}
    eos_token_ids = tuple(sorted(t for t in eos if t is not None))
    (manager, seconds) = _timed(StructuredOutputManager, vocab, model_config.vocab_size,
                                eos_token_ids)
    return manager, eos_token_ids, seconds


_MASK64 = (1 << 64) - 1


def device_seed(seed: int) -> int:
    """The sampler's 32-bit seed (``SamplingField`` "seeds", uint32) of a request's 64-bit one:
    the high half of splitmix64's output (Steele, Lea and Flood, "Fast splittable pseudorandom
    number generators", OOPSLA 2014), so that every bit of the seed counts (1 and 2**32 + 1
    draw differently; a truncation would make them equal). Negative seeds are taken mod 2**64."""
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 32


class EngineCore:
    """Loads the model, sizes and allocates the KV pool, compiles every bucket, then serves steps.

    Args:
      config: engine settings; ``self.config`` is the ResolvedConfig the engine runs with.
      log: receives one line per start-up phase.

    Raises:
      ValueError: unusable model path, unsupported architecture or dtype, or settings that do not
        fit (the message names the flag to change).
    """

    def __init__(self, config: EngineConfig, log: Callable[[str], None] = print):
        enable_compilation_cache()
        distributed.initialize(config)  # before the first use of a JAX backend
        start = time.perf_counter()
        self.spec_config = None
        if config.speculative_config is not None:
            try:
                self.spec_config = SpeculativeConfig.from_dict(config.speculative_config)
            except ValueError as e:
                raise ValueError(f"--speculative-config: {e}") from None
        source, fmt = resolve_model(config.model, config.load_format)
        self.generation_config = load_generation_config(source, fmt, config.generation_config)
        log(f"sampling defaults for requests that leave them out: "
            f"{describe_sampling_defaults(self.generation_config)}")
        # The tokenizer's folder (``self.tokenizer_dir``) is kept from an earlier start, or
        # written by a child process (importing transformers: seconds on the GPU machine, and
        # heap this process would keep) while the backend starts and the parameters are built
        # and the steps compiled; the structured outputs' LLTokenizer follows it on a thread
        # once the model's EOS ids are known. The export lives as long as the engine (a
        # temporary folder goes with it).
        self._tokenizer_export = export = TokenizerExport(source, fmt)
        try:
            self._start_up(config, log, source, fmt, export, start)
        except BaseException:
            export.cancel()  # else it runs on after the engine is gone
            raise

    def _start_up(self, config: EngineConfig, log: Callable[[str], None], source: str,
                  fmt: str, export: TokenizerExport, start: float) -> None:
        """The rest of ``__init__``, while ``export`` writes the tokenizer."""
        pool = ThreadPoolExecutor(1)
        tokenizer = pool.submit(_timed, export.wait)
        # JAX caps its GPU allocator at XLA_PYTHON_CLIENT_MEM_FRACTION (0.75 unless set) of total
        # memory; raise the cap above --gpu-memory-utilization, and keep preallocation on (one
        # region, see kv_sizing), before the backend starts (the next line starts it). This is
        # the one place that sets them, for the server's engine process and LLM alike. (In a
        # process whose JAX GPU backend is already running, they no longer take effect; the
        # pool sizing then errs small, see kv_sizing.)
        self.allocator_fraction = kv_sizing.configure_allocator(
            config.gpu_memory_utilization, os.environ)
        self.platform = platform = current_platform()
        mesh = sharding.make_mesh(config.tensor_parallel_size)
        if config.num_hosts > 1:
            distributed.check_mesh_spans_hosts(mesh, config.num_hosts)
        log(f"allocator fraction {self.allocator_fraction:g} of device memory "
            f"(XLA_PYTHON_CLIENT_MEM_FRACTION: --gpu-memory-utilization "
            f"{config.gpu_memory_utilization:g} plus the allocator's slack; "
            f"{platform.name} backend"
            f"{'' if platform.device_memory else ', where it has no effect'})")
        t0 = time.perf_counter()
        ckpt = load_checkpoint(source, fmt, with_tokenizer=False, mesh=mesh)
        # vLLM's name for a model: --model as given; the default model's is its own.
        self.model_name = config.model or ckpt.name
        max_position_embeddings = ModelConfig.from_hf_config(ckpt.hf_config).max_position_embeddings
        config = self.config = resolve_config(config, platform, max_position_embeddings)
        if self.spec_config is not None:
            try:
                self.spec_config.check_engine(config.tensor_parallel_size, config.max_model_len)
            except ValueError as e:
                raise ValueError(f"--speculative-config: {e}") from None
        dtype = jnp.dtype(config.dtype)
        t1 = time.perf_counter()
        quantization = resolve_method(ckpt.hf_config, config.quantization)
        self.model_config, params = build_params(ckpt.hf_config, ckpt.weights, dtype, config.seed,
                                                 mesh, quantization, config.max_model_len)
        hf_config = ckpt.hf_config
        del ckpt
        mc = self.model_config
        draft = None
        if self.spec_config is not None and self.spec_config.model is not None:
            try:
                draft = load_drafter(self.spec_config.method, self.spec_config.model, hf_config,
                                     mc, params, dtype, config, mesh)
            except ValueError as e:
                raise ValueError(f"--speculative-config: {e}") from None
        self.lora_manager = None
        if config.enable_lora:
            params, self.lora_manager = lora_manager.create(
                config, mc, params, quantization, mesh, log, *self._lora_room(params, mesh))
        t2 = time.perf_counter()
        weights = np.dtype(dtype).name + (f", {quantization} linear layers"
                                          if quantization else "")
        log(f"loaded {self.model_name} ({mc.architecture}, {weights}) in "
            f"{t2 - t0:.1f}s (checkpoint {t1 - t0:.1f}s, parameters on the device {t2 - t1:.1f}s)"
            + ("" if mesh is None else f"; split over {mesh.size} devices (tensor parallel)"))
        log(f"scheduler: max_num_seqs {config.max_num_seqs}, max_num_batched_tokens "
            f"{config.max_num_batched_tokens}, max_model_len {config.max_model_len}")
        if self.spec_config is not None:
            sc = self.spec_config
            log(f"speculative decoding: {sc.method}"
                + (f" ({sc.model})" if sc.model else
                   f" (prompt lookup {sc.prompt_lookup_min}-{sc.prompt_lookup_max} tokens)")
                + f", {sc.num_speculative_tokens} drafts a step"
                + (", at any batch size" if sc.disable_by_batch_size is None else
                   f", off while more than {sc.disable_by_batch_size} requests are unfinished"))
        structured = pool.submit(_structured_output_manager, tokenizer, mc)
        pool.shutdown(wait=False)
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype)
        spec = self.spec_config
        self.runner = ModelRunner(
            mc, params, page_size=config.page_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, kv_dtype=kv_dtype,
            attention_fn=get_attention_fn(config.attention_backend, platform.interpret_pallas),
            mesh=mesh,
            executable_cache=ExecutableCache(cache_dir() / "executables"),
            quantization=quantization,
            lora=self.lora_manager,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            max_spec_seqs=min(spec.disable_by_batch_size or config.max_num_seqs,
                              config.max_num_seqs) if spec else 0,
            draft=draft,
            ngram_lookup=((spec.prompt_lookup_min, spec.prompt_lookup_max)
                          if spec and spec.method == "ngram" else None),
        )
        del params, draft
        runner = self.runner
        per_page = kv_bytes_per_page(mc, runner.layout, runner.pool_head_dim, config.page_size,
                                     kv_dtype)
        if runner.draft is not None:  # its pool has the target pool's pages
            dc = runner.draft.config
            per_page += kv_bytes_per_page(dc, sharding.Layout.of(dc, 1), runner.draft_pool_head_dim,
                                          config.page_size, kv_dtype)
        peak = 0
        if platform.device_memory:
            probe = kv_sizing.pages_per_seq(config.max_model_len, config.page_size) + 1
            t0 = time.perf_counter()
            peak = self.runner.profile_peak_bytes(probe)
            log(f"profiled the largest programs against a {probe}-page pool: peak "
                f"{peak / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f}s")
        num_pages = self._plan_pages(per_page, peak, log)
        self.runner.compile_buckets(num_pages, log)
        if platform.device_memory and self.runner.peak_program_bytes > peak:
            # A program the profile did not cover needs more: a smaller pool, compiled again.
            peak = self.runner.peak_program_bytes
            log(f"at the pool's size the programs' peak is {peak / 2**30:.2f} GiB; sizing again")
            num_pages = self._plan_pages(per_page, peak, log)
            self.runner.compile_buckets(num_pages, log)
        self.num_pages = num_pages
        t3 = time.perf_counter()
        try:
            self.runner.allocate_kv_cache(num_pages)
        except ValueError as e:
            raise ValueError(f"{e}: lower --gpu-memory-utilization" if platform.device_memory
                             else str(e)) from None
        log(f"allocated the KV pool in {time.perf_counter() - t3:.1f}s")
        if platform.device_memory:
            self._check_peak_fits(self.runner.peak_program_bytes)
        self.tokenizer_dir, tokenizer_s = tokenizer.result()
        how = ("kept from an earlier start" if export.kept
               else f"written in {tokenizer_s:.1f}s by a child process alongside")
        log(f"tokenizer {how}; engine ready {time.perf_counter() - start:.1f}s after it began")

        self.vocab_size = mc.vocab_size
        self.structured_output_manager, self.eos_token_ids, so_s = structured.result()
        log(f"structured outputs: llguidance tokenizer built in {so_s:.1f}s on that thread")
        # Every program is compiled and held: JAX's tracing caches (jaxprs, lowered modules;
        # 0.06 GiB on the CPU's default model) serve no later call.
        jax.clear_caches()
        host_memory.release_freed()
        on_host = lambda tree: (0 if platform.device_memory  # noqa: E731
                                else sum({id(x): x.nbytes for x in jax.tree.leaves(tree)}.values()))
        r = self.runner  # a draft model's or EAGLE head's too (an array they share: once)
        line = host_memory.describe(
            on_host((r.params, None if r.draft is None else r.draft.params)),
            on_host((r.k_cache, r.v_cache, r.draft_k_cache, r.draft_v_cache)))
        if line:
            log(line)
        self.scheduler = Scheduler(
            KVCacheManager(num_pages, config.page_size, config.enable_prefix_caching),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            eos_token_ids=self.eos_token_ids,
            max_prompt_logprob_rows=self.runner.prompt_logprob_rows,
            structured_output_manager=self.structured_output_manager,
            max_loras=config.max_loras if config.enable_lora else 0,
            spec_config=spec,
            constrained_drafts=config.num_hosts == 1,
        )
        self._rng = random.Random(config.seed)
        self._in_flight = None  # (SchedulerOutput, StepHandle) dispatched, not yet updated
        # Steps scheduled whose tokens are not applied yet: the ones a failure takes down.
        self._unsettled: list[SchedulerOutput] = []
        self._channel = None  # multi-host: host 0 publishes each step, the others receive it
        if config.num_hosts > 1:
            self._channel = distributed.StepChannel(config.num_hosts, config.host_id)
            if config.host_id == 0:  # the followers' end, however this process ends
                atexit.register(self._channel.publish, None)
            log(f"host {config.host_id} of {config.num_hosts}: "
                + ("serving; the other hosts follow its steps" if config.host_id == 0
                   else "following host 0's steps"))

    def _plan_pages(self, per_page: int, peak: int, log: Callable[[str], None]) -> int:
        """Pages for the pool: --kv-cache-gib on the CPU; on a GPU what --gpu-memory-utilization
        leaves once ``peak`` (the programs' peak bytes, kv_sizing) is set aside; with several
        hosts the size every host can hold. Logs the pool.

        Raises:
          ValueError: not one max_model_len sequence fits (naming the flags).
        """
        config = self.config
        if self.platform.device_memory:
            num_pages = self._gpu_num_pages(per_page, peak, log)
            hint = "raise --gpu-memory-utilization or lower --max-model-len"
        else:
            num_pages = kv_sizing.cpu_num_pages(config.kv_cache_gib, per_page)
            hint = "raise --kv-cache-gib or lower --max-model-len"
        if config.num_hosts > 1:  # one pool over all hosts: the size every host can hold
            num_pages = distributed.min_over_hosts(num_pages, self.runner.mesh)
        num_seqs = kv_sizing.check_pool_fits(num_pages, config.page_size, config.max_model_len,
                                             hint)
        mesh = self.runner.mesh
        log(f"KV cache: {num_pages - 1} pages of {config.page_size} tokens "
            f"({(num_pages - 1) * config.page_size} tokens, {(num_pages - 1) * per_page / 2**30:.2f} GiB "
            f"in {np.dtype(self.runner.kv_dtype).name}{'' if mesh is None else ' per device'}; "
            f"{num_seqs} sequences of {config.max_model_len} tokens fit); prefix caching "
            f"{'on' if config.enable_prefix_caching else 'off'}")
        if num_seqs < config.max_num_seqs:
            log(f"note: fewer than --max-num-seqs {config.max_num_seqs} sequences of "
                f"--max-model-len {config.max_model_len} tokens fit in the KV cache; the scheduler "
                "admits by the pages requests really use, and preempts when they run out")
        return num_pages

    @staticmethod
    def _devices(mesh) -> list:
        """The devices of this process that hold the model (split over ``mesh``, or None)."""
        return [jax.local_devices()[0]] if mesh is None else list(mesh.local_devices)

    def _device_memory(self, params: dict, mesh) -> list[tuple[int, int]]:
        """(allocator limit, bytes in use) of each GPU of this process that holds the model:
        in use, at least its part of ``params``.

        Raises:
          ValueError: a GPU reports no memory limit.
        """
        memory = []
        for d in self._devices(mesh):
            stats = d.memory_stats() or {}
            limit = stats.get("bytes_limit")
            if not limit:
                raise ValueError(
                    f"the GPU {d} reports no memory limit, so --gpu-memory-utilization cannot "
                    "size the KV cache on this device")
            weights = sum(s.data.nbytes for x in jax.tree.leaves(params)
                          for s in x.addressable_shards if s.device == d)
            memory.append((int(limit), int(max(stats.get("bytes_in_use", 0), weights))))
        return memory

    def _lora_room(self, params: dict, mesh) -> tuple[int | None, int | None]:
        """The memory LoRA's pool and host cache may take (``kv_sizing.lora_memory_problem``'s
        device_room and host_room): on a GPU, what --gpu-memory-utilization leaves after the
        weights (``params``) on the device with the least, and the host memory available; on
        the CPU, None (the pool is host memory) and the host memory available less the
        --kv-cache-gib pool still to come. Host memory None where it cannot be read."""
        host = host_memory.available_bytes()
        if not self.platform.device_memory:
            kv = int(self.config.kv_cache_gib * kv_sizing.GIB) * len(self._devices(mesh))
            return None, (None if host is None else max(host - kv, 0))
        b = kv_sizing.smallest_kv_budget(
            self._device_memory(params, mesh), utilization=self.config.gpu_memory_utilization,
            allocator_fraction=self.allocator_fraction, peak_bytes=0)
        return max(b.pool_bytes, 0), host

    def _gpu_num_pages(self, per_page: int, peak: int, log: Callable[[str], None]) -> int:
        """Pages for the pool under --gpu-memory-utilization (see kv_sizing), which applies to
        each device: on every device of this process that holds the model, its budget minus
        what is resident there now (its part of the weights) minus the programs' peak bytes
        (per device: XLA analyses the partitioned program); the pool gets the smallest."""
        util = self.config.gpu_memory_utilization
        memory = self._device_memory(self.runner.params, self.runner.mesh)
        b = kv_sizing.smallest_kv_budget(memory, utilization=util,
                                         allocator_fraction=self.allocator_fraction,
                                         peak_bytes=peak)
        log(b.describe(util) + ("" if len(memory) == 1 else f" (the smallest of {len(memory)} devices)"))
        return kv_sizing.num_pages_for_bytes(b.pool_bytes, per_page)

    def _check_peak_fits(self, peak: int) -> None:
        """After the pool is allocated: on each device the programs' peak still fits under the
        allocator's limit.

        Raises:
          ValueError: it does not (naming --gpu-memory-utilization).
        """
        for d in self._devices(self.runner.mesh):
            stats = d.memory_stats() or {}
            problem = kv_sizing.peak_fit_problem(int(stats.get("bytes_in_use", 0)),
                                                 int(stats.get("bytes_limit", 0)), peak)
            if problem:
                raise ValueError(f"on {d}: {problem}: lower --gpu-memory-utilization")

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request that the InputProcessor checked (non-empty prompt in the vocabulary,
        shorter than max_model_len; a request id not in use). Its ``n`` choices run as
        sequences ``child_request_id(request_id, i, n)``; choice i draws with seed + i (vLLM's
        rule), choices 1.. fork from choice 0 once its prompt is computed (Scheduler). A
        constrained request gets a grammar matcher per choice, and one with
        ``allowed_token_ids`` their bitmask row.

        A request with a LoRA adapter has it read onto the host here (``LoRAModelManager``).

        Raises:
          ValidationError: on ``structured_outputs``, "<kind>: <error>", for a constraint that
            does not compile; on ``model``, an adapter without --enable-lora.
          ValueError: the request's adapter is missing or refused (``lora.checkpoint``).
        """
        if request.lora_request is not None:
            self.add_lora(request.lora_request)
        sp = request.sampling_params
        seed = sp.seed
        if seed is None:
            seed = self._rng.getrandbits(64)
        grammars = [None] * sp.n
        if sp.structured_outputs is not None:
            grammars = [self.structured_output_manager.grammar_init(sp.structured_outputs)
                        for _ in range(sp.n)]
        allowed = None
        if sp.allowed_token_ids is not None:
            allowed = token_bitmask(sp.allowed_token_ids, self.vocab_size)
        parent = Request(request, device_seed(seed), grammar=grammars[0], allowed_bitmask=allowed)
        for i in range(1, sp.n):
            child = Request(request, device_seed(seed + i), index=i, grammar=grammars[i],
                            allowed_bitmask=allowed)
            child.fork_parent = parent
            parent.fork_children.append(child)
        self.scheduler.add_request(parent)

    def add_lora(self, lora_request) -> None:
        """Read a LoRA adapter onto the host (vLLM's ``EngineCore.add_lora``); requests that
        name it load it into the device pool when they run.

        Raises:
          ValidationError: on ``model``, the engine runs without --enable-lora.
          ValueError: the adapter is missing or refused (``lora.checkpoint``).
        """
        if self.lora_manager is None:
            raise ValidationError(f"LoRA adapter {lora_request.lora_name!r}: the engine runs "
                                  "without --enable-lora", parameter="model")
        self.lora_manager.add_lora(lora_request, lambda: {
            r.lora_int_id for r in self.scheduler.requests.values() if r.lora_int_id})

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and dispatch one step, and return the new tokens and finished requests.

        Synchronous (``--no-async-scheduling``): wait for this step's tokens, then update. Async:
        dispatch this step first, then wait for the previous step's tokens (the device runs
        this step meanwhile) and update with them; a step's outputs come one call later.
        A step with constrained sequences (structured outputs) needs their grammar bitmask,
        which needs every earlier token and the drafts the step verifies: the step's model
        part is dispatched first, and the filtered sampler once the previous step's tokens
        have updated the matchers (async: after that update; synchronous: at once), so
        filling the bitmask overlaps the model's step on the device
        (docs/structured_outputs.md); n-gram drafts, made by the step, are waited for first.
        With several hosts (where host 0 publishes each step once, bitmask included, before it
        is dispatched) the engine runs synchronously while a constrained sequence is
        unfinished, and such sequences get no drafts. With a draft model or an
        EAGLE head the steps that may carry drafts run synchronously too: the drafter proposes
        after a step's tokens are known and the scheduler places them; the n-gram method's
        steps make their own drafts and keep async scheduling (docs/spec_decode.md).
        """
        sync = not self.config.async_scheduling or self.scheduler.drafts_on_host() or (
            self._channel is not None and self.scheduler.has_structured_requests())
        flushed = []
        if sync and self._in_flight is not None:
            flushed = self._update(self._in_flight[0], self._in_flight[1])
            self._in_flight = None
        sched = self.scheduler.schedule()
        self._unsettled.append(sched)
        if self._channel is not None:
            self.scheduler.grammar_bitmask(sched)
            self._channel.publish(sched)
        handle = self.runner.execute(sched)
        if sync:
            if handle is None:
                self._unsettled.remove(sched)
                return flushed
            if handle.awaits_bitmask:
                self._sample_constrained(sched, handle)
            return flushed + self._update(sched, handle)
        prev, self._in_flight = self._in_flight, (sched, handle) if handle else None
        if handle is None:
            self._unsettled.remove(sched)
        outputs = []
        if prev is not None:
            outputs = self._update(*prev)
        if handle is not None and handle.awaits_bitmask:
            self._sample_constrained(sched, handle)
        return outputs

    def _sample_constrained(self, sched: SchedulerOutput, handle) -> None:
        """Dispatch the filtered sampler of a step whose constrained rows waited for their
        grammar bitmask, once every earlier token has updated the matchers."""
        self.scheduler.grammar_bitmask(sched, self.runner.step_drafts(handle, sched))
        self.runner.sample_filtered(handle, sched.grammar_bitmask)

    def _update(self, sched: SchedulerOutput, handle) -> list[EngineCoreOutput]:
        """Wait for a dispatched step's tokens and apply them to the scheduler."""
        outputs = self.scheduler.update(sched, self.runner.get_output(handle))
        self._unsettled.remove(sched)
        return outputs

    def recover_from_failed_step(self) -> tuple[list[str], bool]:
        """After ``step`` raised: aborts the sequences of the steps whose tokens were not yet
        applied (the one being dispatched, and under async scheduling the one in flight), and
        returns their ids and whether the engine can go on (``ModelRunner.device_state_ok``:
        a program that failed after its KV pool was donated leaves none to serve from). The
        other requests, waiting or running, are untouched."""
        ids = sorted({r for sched in self._unsettled for r in sched.num_scheduled_tokens})
        self._unsettled.clear()
        self._in_flight = None
        self.scheduler.abort_requests(ids)
        return ids, self.runner.device_state_ok()

    def follow(self) -> None:
        """Hosts other than 0: run every step host 0 runs, with its SchedulerOutputs, in the
        same order of dispatches and waits (so both hosts' runners keep the same state), until
        host 0 ends. The sampled tokens are only waited for; host 0 owns the requests."""
        held = None  # async scheduling: the step dispatched before, waited for after the next
        while (sched := self._channel.receive()) is not None:
            handle = self.runner.execute(sched)
            if self.config.async_scheduling:
                handle, held = held, handle
            if handle is not None:
                self.runner.get_output(handle)

    @functools.cached_property
    def tokenizer(self):
        """The transformers tokenizer of ``tokenizer_dir`` (for ``LLM`` and tools; the server's
        engine process never loads it)."""
        return load_tokenizer(self.tokenizer_dir)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()
