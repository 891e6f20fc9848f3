"""GrammarValidator: the API process's check of a request's constraint, so that a bad schema,
regex or grammar is a 400 naming its field instead of an engine error.

The constraint is compiled with llguidance exactly as the engine will compile it
(``grammar.compile_matcher``), on a worker thread (never on the event loop), and the verdict
is cached by (kind, spec): a client that sends the same schema with every request pays for it
once. Compiling is bounded twice: llguidance's LIMITS fail a grammar that needs too much work,
and ``timeout_s`` answers the request when the compiler takes longer than that anyway. A
compile that finishes past ``timeout_s`` is cached as "too slow", so the engine never gets a
grammar that would stall its loop that long, and the same spec never occupies the thread twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import concurrent.futures
import time
from collections import OrderedDict

from jaxserve.exceptions import ValidationError
from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured_output.grammar import build_ll_tokenizer, compile_matcher
from jaxserve.tokenizer_io import TokenizerVocab

MAX_CACHED_VERDICTS = 1024
COMPILE_TIMEOUT_S = 10.0


class GrammarValidator:
    """Args:
      tokenizer, vocab_size, eos_token_ids: as the engine's (``build_ll_tokenizer``).
      timeout_s: longest a compile may take before the request is refused.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids,
                 timeout_s: float = COMPILE_TIMEOUT_S):
        self.timeout_s = timeout_s
        # One thread: a compile that overran its time limit holds it until llguidance's limits
        # end it, and no spec is compiled twice.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="jaxserve-grammar")
        # Built on that thread, ahead of the first compile: the server is ready without
        # waiting for it (0.6 s of the 8B model's start on the H200). The engine built the
        # same one before it was ready, so it does not fail here.
        self._ll_tokenizer = self._pool.submit(build_ll_tokenizer, TokenizerVocab.of(tokenizer),
                                               vocab_size, eos_token_ids)
        # (kind, SHA-256 of the spec) -> "" (compiles) or the error
        self._verdicts: OrderedDict[tuple[str, bytes], str] = OrderedDict()
        self._pending: dict[tuple[str, bytes], asyncio.Future] = {}

    def _too_slow(self, kind: str) -> str:
        return f"{kind}: the grammar did not compile within {self.timeout_s:g} s"

    def _compile(self, params: StructuredOutputsParams) -> str:
        start = time.perf_counter()
        try:
            compile_matcher(self._ll_tokenizer.result(), params)
        except ValueError as e:
            return str(e)
        return self._too_slow(params.key[0]) if time.perf_counter() - start > self.timeout_s else ""

    async def check(self, params: StructuredOutputsParams) -> None:
        """Raises ValidationError on ``structured_outputs``, "<kind>: <error>", when the constraint does not compile, or does
        not compile within ``timeout_s``."""
        kind, spec = params.key
        key = kind, hashlib.sha256(spec.encode("utf-8", "surrogatepass")).digest()
        verdict = self._verdicts.get(key)
        if verdict is None:
            fut = self._pending.get(key)
            if fut is None:
                fut = asyncio.get_running_loop().run_in_executor(self._pool, self._compile,
                                                                 params)
                self._pending[key] = fut
                fut.add_done_callback(lambda f: self._remember(key, f))
            try:
                verdict = await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
            except TimeoutError:
                # Not cached here: it may have waited behind another compile.
                verdict = self._too_slow(kind)
        if verdict:
            raise ValidationError(verdict, parameter="structured_outputs")

    def _remember(self, key, fut: asyncio.Future) -> None:
        self._pending.pop(key, None)
        if not fut.cancelled() and fut.exception() is None:
            self._verdicts[key] = fut.result()
            if len(self._verdicts) > MAX_CACHED_VERDICTS:
                self._verdicts.popitem(last=False)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
