"""AsyncLLM: the API process's engine front (vLLM V1's name).

Owns the tokenizer, the InputProcessor (tokenization, chat template, prompt checks), the
EngineCoreClient (engine process + pipe), the OutputProcessor (detokenization, stop strings,
per-request queues) and the metrics. Never imports
JAX: the tokenizer comes from a folder the engine process saved it to.

Usage (inside an event loop)::

    llm = AsyncLLM(EngineConfig(...))
    await llm.start()
    ids = llm.encode_chat([{"role": "user", "content": "Hi"}])
    async for out in llm.generate(ids, SamplingParams(max_tokens=16), "req-1"):
        print(out.outputs[0].text, end="")
    await llm.shutdown()
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator

from jaxserve.config import EngineConfig
from jaxserve.engine import EngineCoreRequest
from jaxserve.engine import messages as M
from jaxserve.engine.core_client import EngineCoreClient, EngineDeadError, EngineStartError
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.engine.output_processor import OutputProcessor, RequestError, merge_outputs
from jaxserve.metrics import Metrics
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer_io import load_tokenizer

__all__ = ["AsyncLLM", "EngineDeadError", "EngineStartError", "RequestError"]


class AsyncLLM:
    """Async generation against the engine process.

    Attributes (valid after ``start()``):
      tokenizer: transformers fast tokenizer with the model's chat template.
      model_name: the model's own name.
      max_model_len: longest sequence, prompt + output, tokens.
      metrics: the Metrics behind ``GET /metrics``.
      allocator_fraction: XLA_PYTHON_CLIENT_MEM_FRACTION the engine process runs with.
      ready: True once the engine is serving; False before, and after it died or shut down.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.engine_core = EngineCoreClient(config, self._on_message, self._on_engine_dead)
        self.tokenizer = None
        self.model_name: str | None = None
        self.max_model_len: int = 0
        self.vocab_size: int = 0
        self.engine_config: dict = {}
        self.allocator_fraction: float = 0.0
        self.metrics: Metrics | None = None
        self.input_processor: InputProcessor | None = None
        self.output_processor: OutputProcessor | None = None
        self.ready = False
        self.errored = False
        self.shutting_down = False

    async def start(self) -> None:
        """Start the engine process and load the tokenizer it saved.

        Raises:
          EngineStartError: with a one-line reason (bad model path, out of memory, ...).
        """
        ready: M.Ready = await self.engine_core.start()
        loop = asyncio.get_running_loop()
        try:
            self.tokenizer = await loop.run_in_executor(None, load_tokenizer, ready.tokenizer_dir)
        except Exception as e:  # noqa: BLE001
            raise EngineStartError(f"cannot load the engine's tokenizer: {e}") from e
        finally:
            shutil.rmtree(ready.tokenizer_dir, ignore_errors=True)
        self.model_name = ready.model_name
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.engine_config = ready.config
        self.allocator_fraction = ready.allocator_fraction
        self.metrics = Metrics(ready.model_name)
        self.input_processor = InputProcessor(self.tokenizer, ready.max_model_len, ready.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer, ready.eos_token_ids, self.metrics)
        self.ready = True

    # -- prompts -------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str) -> list[int]:
        """Text prompt -> token ids (InputProcessor.tokenize_prompt)."""
        return self.input_processor.tokenize_prompt(prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Chat messages -> token ids (InputProcessor.tokenize_chat). Raises ValueError."""
        return self.input_processor.tokenize_chat(messages)[1]

    def check_prompt(self, prompt_token_ids: list[int], max_tokens: int | None) -> None:
        """InputProcessor.check_prompt with the server's rule. Raises ValueError."""
        self.input_processor.check_prompt(prompt_token_ids, max_tokens)

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its RequestOutput deltas until one has ``finished``.

        Each yielded ``outputs[0].text`` / ``.token_ids`` is new since the previous one (deltas
        that piled up while the consumer was busy are merged into one).

        Closing the iterator early (client disconnect, cancellation) aborts the request in the
        engine, which frees its KV pages.

        Raises:
          EngineDeadError: the engine is gone (or the server is shutting down).
          RequestError: the engine rejected the request or failed while running it.
        """
        if not self.ready or self.shutting_down:
            raise EngineDeadError("the engine is not available")
        queue: asyncio.Queue = asyncio.Queue()
        self.output_processor.add_request(request_id, None, prompt_token_ids, sampling_params,
                                          queue)
        finished = False
        try:
            self.engine_core.add_request(
                EngineCoreRequest(request_id, prompt_token_ids, sampling_params))
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
        """Abort a live request (no-op if it already finished)."""
        if self.output_processor is not None and self.output_processor.abort_request(request_id):
            if not self.engine_core.dead:
                try:
                    self.engine_core.abort_requests([request_id])
                except EngineDeadError:
                    pass

    @property
    def num_live_requests(self) -> int:
        return 0 if self.output_processor is None else len(self.output_processor.requests)

    def fail_all(self, message: str) -> None:
        """End every live request with EngineDeadError(message) and abort them in the engine."""
        if self.output_processor is None:
            return
        ids = list(self.output_processor.requests)
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
        deadline = time.monotonic() + grace_s
        while self.num_live_requests and time.monotonic() < deadline and not self.engine_core.dead:
            await asyncio.sleep(0.05)
        self.fail_all("the server is shutting down")
        self.ready = False
        await self.engine_core.shutdown()

    # -- pipe callbacks (event loop) -----------------------------------------------------------

    def _on_message(self, msg) -> None:
        if self.output_processor is None:
            return
        if isinstance(msg, M.Outputs):
            if msg.stats is not None:
                self.metrics.update_stats(msg.stats)
            if msg.outputs:
                to_abort = self.output_processor.process_outputs(msg.outputs).reqs_to_abort
                if to_abort:
                    self.engine_core.abort_requests(to_abort)
        elif isinstance(msg, M.Error):
            self.output_processor.propagate_error(msg.request_ids,
                                                  RequestError(msg.message, msg.kind))

    def _on_engine_dead(self) -> None:
        self.ready = False
        self.errored = True
        print("[jaxserve] the engine process died; failing all requests", flush=True)
        if self.output_processor is not None:
            self.output_processor.propagate_error(
                None, EngineDeadError("the engine process died"))
