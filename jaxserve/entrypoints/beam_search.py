"""Beam search for ``use_beam_search`` (vLLM's request field; its ``EngineClient.beam_search``
and ``vllm/beam_search.py``): ``n`` beams, searched in the API process over ordinary engine
requests.

Each step sends every live beam (prompt + its tokens) as a request for one token with the
``2 * n`` most likely next tokens' log-probabilities (raw logits, SamplingParams' rule); each
beam grows by each of those tokens, a beam that draws EOS is complete (unless ``ignore_eos``),
and the ``n`` best of the others go on. After ``max_tokens`` steps (or at max_model_len) the
``n`` best of the complete and live beams are the choices, best first. A beam's score is its
cumulative log-probability over its length (prompt included, a final EOS not) to the power
``length_penalty``, as vLLM scores it. The prefix cache serves each step's shared prefix, so a
step computes about one page per beam.

Sampling fields play no part (the search is deterministic); the fields it cannot honour are
refused with a 400 (``_SamplingFields.check``): stop strings, logit_bias, allowed_token_ids,
log-probabilities, output constraints and tools; ``n`` is at most 10 (2n log-probabilities).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from jaxserve.lora.request import LoRARequest
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


@dataclass
class Beam:
    """One hypothesis: its generated tokens, their summed log-probability, and why it ended
    ("stop": EOS; None while live)."""

    tokens: list[int] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None


def beam_score(beam: Beam, num_prompt: int, length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score``: cumulative log-probability / length ** penalty, the
    length counting the prompt and not a final EOS."""
    length = num_prompt + len(beam.tokens) - (beam.finish_reason == "stop")
    return beam.cum_logprob / max(length, 1) ** length_penalty


async def _next_tokens(llm: AsyncLLM, ids: list[int], width: int,
                       lora_request: LoRARequest | None,
                       cache_salt: str | None) -> dict[int, float]:
    """The ``2 * width`` most likely tokens after ``ids`` and their log-probabilities (one
    engine request, with ``lora_request``'s adapter if given, under ``cache_salt``)."""
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width, ignore_eos=True)
    rid = f"beam-{uuid.uuid4().hex}"
    queue = llm.add_request(ids, sp, rid, lora_request=lora_request, cache_salt=cache_salt)
    options = {}
    async with contextlib.aclosing(llm.outputs(rid, queue)) as gen:
        async for delta in gen:
            for c in delta.outputs:
                for position in c.logprobs or ():
                    options = {t: lp.logprob for t, lp in position.items()}
    return options


async def beam_search(llm: AsyncLLM, prompt: list[int], sp: SamplingParams, request_id: str,
                      length_penalty: float, lora_request: LoRARequest | None,
                      cache_salt: str | None) -> RequestOutput:
    """The ``sp.n`` best beams after ``prompt``, as a finished RequestOutput (its choices in
    score order, their text decoded as ``sp.skip_special_tokens`` says)."""
    width, num_prompt = sp.n, len(prompt)
    eos = set() if sp.ignore_eos else set(llm.output_processor.eos_token_ids)
    steps = min(sp.max_tokens, llm.config.max_model_len - num_prompt)
    live, complete = [Beam()], []
    for _ in range(steps):
        nexts = await asyncio.gather(*(_next_tokens(llm, prompt + b.tokens, width, lora_request,
                                                    cache_salt) for b in live))
        grown = []
        for beam, options in zip(live, nexts):
            for token, logprob in options.items():
                new = Beam(beam.tokens + [token], beam.cum_logprob + logprob)
                if token in eos:
                    new.finish_reason = "stop"
                    complete.append(new)
                else:
                    grown.append(new)
        grown.sort(key=lambda b: beam_score(b, num_prompt, length_penalty), reverse=True)
        live = grown[:width]
        if not live:
            break
    best = sorted(complete + live, key=lambda b: beam_score(b, num_prompt, length_penalty),
                  reverse=True)[:width]
    outputs = []
    for i, beam in enumerate(best):
        text_ids = beam.tokens[:-1] if beam.finish_reason == "stop" else beam.tokens
        text = await llm.detokenize(text_ids, sp.skip_special_tokens)
        outputs.append(CompletionOutput(i, text, beam.tokens, beam.finish_reason or "length"))
    return RequestOutput(request_id, None, prompt, outputs)


async def beam_search_outputs(llm: AsyncLLM, prompts: list[list[int]], sp: SamplingParams,
                              request_id: str, length_penalty: float,
                              lora_request: LoRARequest | None = None,
                              cache_salt: str | None = None,
                              ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, its finished RequestOutput) of each prompt's beam search, run at once,
    in prompt order: what serving_stream.run_request reads. Closing it cancels the searches
    (their engine requests are aborted). ``lora_request``: the adapter they run with;
    ``cache_salt``: the prefix cache's salt of their engine requests."""
    tasks = [asyncio.ensure_future(beam_search(llm, p, sp, f"{request_id}-{i}", length_penalty,
                                               lora_request, cache_salt))
             for i, p in enumerate(prompts)]
    try:
        for i, task in enumerate(tasks):
            yield i, await task
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
