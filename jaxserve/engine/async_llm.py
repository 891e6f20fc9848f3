"""AsyncLLM: the API process's engine front (vLLM V1's name).

Owns the tokenizer, the InputProcessor (tokenization, chat template, prompt checks), the
EngineCoreClient (engine process + pipe), the OutputProcessor (detokenization, stop strings,
per-request queues) and the metrics. Never imports
JAX: the tokenizer comes from a folder the engine process saved it to.

Usage (inside an event loop)::

    llm = AsyncLLM(EngineConfig(...))
    await llm.start()
    _, ids = await llm.encode_chat([{"role": "user", "content": "Hi"}])
    queue = llm.add_request(ids, SamplingParams(max_tokens=16), "req-1")
    async for out in llm.outputs("req-1", queue):
        print(out.outputs[0].text, end="")
    await llm.shutdown()

Tokenization and chat templating run on one worker thread, never on the event loop (a long
prompt would stall every stream for as long as it takes), and text is measured before it is
tokenized (``InputProcessor.check_text_size``). One thread, because a transformers fast tokenizer
must not be driven from two threads at once.

Engine death (docs/reliability.md): every live request fails at once with EngineDeadError; then
the engine process is started again, up to ``max_engine_restarts`` times in the server's life
(new requests get 503 meanwhile). Past that, or when a restart fails, ``failed`` is set and the
server exits non-zero for its supervisor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from jaxserve.config import EngineConfig, ResolvedConfig
from jaxserve.engine import EngineCoreRequest, child_request_id
from jaxserve.engine import messages as M
from jaxserve.engine.core_client import EngineCoreClient, EngineDeadError, EngineStartError
from jaxserve.engine.input_processor import InputProcessor, chat_text_bytes
from jaxserve.engine.output_processor import OutputProcessor, RequestError, merge_outputs
from jaxserve.lora.checkpoint import LoRAShapes
from jaxserve.lora.request import LoRARequest
from jaxserve.metrics import Metrics, cache_config_labels
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.structured_output.validator import GrammarValidator
from jaxserve.tokenizer_io import import_tokenizer_code, load_tokenizer

__all__ = ["AsyncLLM", "EngineDeadError", "EngineStartError", "RequestError"]

logger = logging.getLogger("jaxserve.engine")


class AsyncLLM:
    """Async generation against the engine process.

    Attributes (valid after ``start()``):
      tokenizer: transformers fast tokenizer with the model's chat template.
      model_name: the model's name (``messages.Ready``'s).
      config: the configuration the engine runs with (``config.max_model_len``: the longest
        sequence, prompt + output, tokens).
      metrics: the Metrics behind ``GET /metrics``.
      allocator_fraction: XLA_PYTHON_CLIENT_MEM_FRACTION the engine process runs with.
      lora_shapes: what a LoRA adapter must fit (``lora.checkpoint.LoRAShapes``) with
        --enable-lora, else None.
      ready: True once the engine is serving; False before, while it restarts, and after it
        died or shut down.
      failed: set when the engine is gone for good (restarts used up, or a restart failed).

    Args:
      config: the engine configuration.
      max_engine_restarts: how many times a dead engine process is started again (0: never).
      metrics_prefix: the metrics' names (Metrics' ``prefix``: "jaxserve" or "vllm").
    """

    def __init__(self, config: EngineConfig, max_engine_restarts: int = 0,
                 metrics_prefix: str = "jaxserve"):
        self.max_engine_restarts = max_engine_restarts
        self.metrics_prefix = metrics_prefix
        self.engine_restarts = 0
        self.failed = asyncio.Event()
        self._restart_task: asyncio.Task | None = None
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="jaxserve-tokenize")
        self.engine_core = EngineCoreClient(config, self._on_message, self._on_engine_dead)
        self.tokenizer = None
        self.model_name: str | None = None
        self.config: ResolvedConfig | None = None
        self.vocab_size: int = 0
        self.generation_config: dict = {}
        self.allocator_fraction: float = 0.0
        self.lora_shapes: LoRAShapes | None = None
        self.metrics: Metrics | None = None
        self.input_processor: InputProcessor | None = None
        self.grammar_validator: GrammarValidator | None = None
        self.output_processor: OutputProcessor | None = None
        self.ready = False
        self.errored = False
        self.shutting_down = False

    async def start(self, before_ready: Callable[[], Awaitable[None]] | None = None) -> None:
        """Start the engine process and load the tokenizer it saved, then await
        ``before_ready`` (the server's ``--lora-modules``: served before the first request can
        come) and turn ready.

        Raises:
          EngineStartError: with a one-line reason (bad model path, out of memory, ...).
          whatever ``before_ready`` raises.
        """
        loop = asyncio.get_running_loop()
        # Import the tokenizer's code (seconds on a GPU machine) while the engine process
        # starts, not after it is ready.
        imported = loop.run_in_executor(None, import_tokenizer_code)
        ready: M.Ready = await self.engine_core.start()
        try:
            await imported
            self.tokenizer = await loop.run_in_executor(None, load_tokenizer, ready.tokenizer_dir)
            self.input_processor = await loop.run_in_executor(
                None, InputProcessor, self.tokenizer, ready.config.max_model_len, ready.vocab_size)
            self.grammar_validator = await loop.run_in_executor(
                None, GrammarValidator, self.tokenizer, ready.vocab_size, ready.eos_token_ids)
        except Exception as e:  # noqa: BLE001
            raise EngineStartError(f"cannot load the engine's tokenizer: {e}") from e
        self.model_name = ready.model_name
        self.config = ready.config
        self.vocab_size = ready.vocab_size
        self.generation_config = ready.generation_config
        self.allocator_fraction = ready.allocator_fraction
        self.lora_shapes = ready.lora_shapes
        self.metrics = Metrics(ready.model_name, self.metrics_prefix, ready.config.max_model_len,
                               ready.config.max_loras if ready.config.enable_lora else 0,
                               cache_config_labels(ready.config, ready.num_gpu_blocks))
        self.output_processor = OutputProcessor(self.tokenizer, ready.eos_token_ids, self.metrics)
        if before_ready is not None:
            try:
                await before_ready()
            except BaseException:
                self.shutting_down = True  # the caller stops the engine: not a death to restart
                raise
        self.ready = True

    # -- prompts -------------------------------------------------------------------------------

    async def _tokenize(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    async def encode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Text prompt -> token ids (InputProcessor.tokenize_prompt), off the event loop.

        Raises:
          ValidationError: on ``prompt``, when the text is too long to fit max_model_len.
        """
        self.input_processor.check_text_size(len(prompt.encode("utf-8")), "prompt")
        return await self._tokenize(self.input_processor.tokenize_prompt, prompt,
                                    add_special_tokens)

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          add_special_tokens: bool = False, tools: list[dict] | None = None,
                          continue_final_message: bool = False,
                          chat_template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """Chat messages (and tools, template options) -> (the rendered text, its token ids)
        (InputProcessor.tokenize_chat), off the event loop.

        Raises:
          ValidationError: on ``messages``: too long to fit max_model_len, or the template
            rejected them; on ``chat_template_kwargs``: a key that cannot be set.
        """
        self.input_processor.check_text_size(
            chat_text_bytes(messages, tools, chat_template_kwargs), "messages")
        return await self._tokenize(self.input_processor.tokenize_chat, messages,
                                    add_generation_prompt, add_special_tokens, tools,
                                    continue_final_message, chat_template_kwargs)

    def vocabulary_id(self, token: str) -> int | None:
        """The id of the vocabulary entry that is exactly ``token`` (an added token such as
        ``</think>``), or None when there is none."""
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or self.tokenizer.convert_ids_to_tokens(token_id) != token:
            return None
        return token_id

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """Token ids -> text (special tokens kept unless skipped: vLLM's /detokenize keeps
        them), off the event loop."""
        return await self._tokenize(
            functools.partial(self.tokenizer.decode, skip_special_tokens=skip_special_tokens),
            token_ids)

    def check_request(self, prompt_token_ids: list[int], sp: SamplingParams) -> None:
        """InputProcessor.check_sampling_params and check_prompt with the server's rule.

        Raises:
          ValidationError: on the field at fault (``stop_token_ids``, ``logit_bias``,
            ``prompt``, or ``max_tokens`` when the prompt fits but not with the tokens asked).
        """
        self.input_processor.check_sampling_params(sp)
        self.input_processor.check_prompt(prompt_token_ids, sp.max_tokens)

    async def check_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Compile the constraint as the engine will (off the event loop, cached, within
        GrammarValidator's time limit).

        Raises:
          ValidationError: on ``structured_outputs``, "<kind>: <error>", when it does not
            compile (in time).
        """
        await self.grammar_validator.check(params)

    # -- generation ----------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    request_id: str, reasoning_end_token_id: int | None = None,
                    lora_request: LoRARequest | None = None,
                    cache_salt: str | None = None) -> asyncio.Queue:
        """Submit a request: it is on its way to the engine when this returns, so the engine
        starts on it while the caller sets up its response. Its RequestOutput deltas, then the
        exception that ends it if one does, arrive on the returned queue (read it with
        ``outputs``); ``abort`` ends it early. ``reasoning_end_token_id``, ``lora_request``,
        ``cache_salt``: EngineCoreRequest's.

        Raises:
          EngineDeadError: the engine is gone (or the server is shutting down).
        """
        if not self.ready or self.shutting_down:
            raise EngineDeadError("the engine is not available")
        self.engine_core.add_request(EngineCoreRequest(request_id, prompt_token_ids,
                                                       sampling_params, reasoning_end_token_id,
                                                       lora_request, cache_salt))
        # Tracked after the send, so that the detokenizers' set-up overlaps the engine's work:
        # outputs are read on this event loop, so none can arrive before this returns.
        queue: asyncio.Queue = asyncio.Queue()
        try:
            self.output_processor.add_request(request_id, None, prompt_token_ids,
                                              sampling_params, queue, lora_request)
        except BaseException:
            self.engine_core.abort_requests(
                [child_request_id(request_id, i, sampling_params.n)
                 for i in range(sampling_params.n)])
            raise
        return queue

    async def outputs(self, request_id: str,
                      queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Yield the RequestOutput deltas of a request that ``add_request`` submitted (``queue``
        is what it returned) until one has ``finished``.

        Each yielded ``outputs[0].text`` / ``.token_ids`` is new since the previous one (deltas
        that piled up while the consumer was busy are merged into one).

        Closing the iterator early (client disconnect, cancellation) aborts the request in the
        engine, which frees its KV pages.

        Raises:
          EngineDeadError: the engine died.
          RequestError: the engine rejected the request or failed while running it.
        """
        finished = False
        try:
            while not finished:
                out = await queue.get()
                while not isinstance(out, BaseException) and not out.finished and not queue.empty():
                    nxt = queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        out = nxt
                        break
                    out = merge_outputs(out, nxt)
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a live request, every choice of it (no-op if it already finished)."""
        if self.output_processor is None:
            return
        ids = self.output_processor.abort_request(request_id)
        if ids and not self.engine_core.dead:
            try:
                self.engine_core.abort_requests(ids)
            except EngineDeadError:
                pass

    @property
    def restarting(self) -> bool:
        """True while a dead engine is being started again."""
        return self._restart_task is not None and not self._restart_task.done()

    @property
    def num_live_requests(self) -> int:
        return 0 if self.output_processor is None else len(self.output_processor.requests)

    def fail_all(self, message: str) -> None:
        """End every live request with EngineDeadError(message) and abort them in the engine."""
        if self.output_processor is None:
            return
        ids = [eid for st in self.output_processor.requests.values() for eid in st.engine_ids]
        self.output_processor.propagate_error(None, EngineDeadError(message))
        if ids and not self.engine_core.dead:
            try:
                self.engine_core.abort_requests(ids)
            except EngineDeadError:
                pass

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop: let live requests finish for up to ``grace_s`` seconds, fail the rest, and stop
        the engine process (waits for it to exit)."""
        self.shutting_down = True
        if self._restart_task is not None:
            self._restart_task.cancel()
        deadline = time.monotonic() + grace_s
        while self.num_live_requests and time.monotonic() < deadline and not self.engine_core.dead:
            await asyncio.sleep(0.05)
        self.fail_all("the server is shutting down")
        self.ready = False
        await self.engine_core.shutdown()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        if self.grammar_validator is not None:
            self.grammar_validator.shutdown()

    # -- pipe callbacks (event loop) -----------------------------------------------------------

    def _on_message(self, msg) -> None:
        if self.output_processor is None:
            return
        if isinstance(msg, M.Outputs):
            if msg.stats is not None:
                self.metrics.update_stats(msg.stats)
            if msg.outputs:
                to_abort = self.output_processor.process_outputs(
                    msg.outputs, msg.timestamp).reqs_to_abort
                if to_abort:
                    self.engine_core.abort_requests(to_abort)
        elif isinstance(msg, M.Error):
            self.output_processor.propagate_error(msg.request_ids,
                                                  RequestError(msg.message, msg.kind))

    def _on_engine_dead(self) -> None:
        self.ready = False
        self.errored = True
        if self.output_processor is not None:
            self.output_processor.propagate_error(
                None, EngineDeadError("the engine process died"))
        if self.metrics is not None:
            self.metrics.engine_down()
        if self.shutting_down:
            return
        if self.engine_restarts < self.max_engine_restarts:
            self.engine_restarts += 1
            logger.warning("the engine process died; failed all requests; restarting it "
                           "(%d of %d)", self.engine_restarts, self.max_engine_restarts)
            self._restart_task = asyncio.get_running_loop().create_task(self._restart())
        else:
            logger.warning("the engine process died; failed all requests%s",
                           f"; no restart left ({self.max_engine_restarts} used)"
                           if self.max_engine_restarts else "")
            self.failed.set()

    async def _restart(self) -> None:
        """Start a new engine process with the same configuration; the tokenizer, processors
        and metrics are kept (same model)."""
        old = self.engine_core
        await asyncio.get_running_loop().run_in_executor(None, old.kill)  # reap it
        self.engine_core = EngineCoreClient(old.config, self._on_message, self._on_engine_dead)
        try:
            await self.engine_core.start()
        except EngineStartError as e:
            logger.warning("the engine could not be restarted: %s", e)
            self.failed.set()
            return
        self.metrics.engine_up(self.engine_restarts)
        self.errored = False
        self.ready = True
        logger.warning("the engine process is back; serving")
