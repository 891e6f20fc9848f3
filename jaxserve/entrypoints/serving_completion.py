"""POST /v1/completions (OpenAI's, SSE streaming): a prompt, token ids, or a list of either
(one engine request per prompt and choice, all at once: the engine queues what it cannot run
yet, as vLLM does; with ``use_beam_search``, each prompt's beam search instead: beam_search.py).
The body is read and validated, its sequences (prompts x ``n``) admitted, each text prompt
tokenized off the event loop and checked against max_model_len, the requests submitted to the
engine (before the response is set up: the engine starts on them meanwhile), then answered
whole or streamed (serving_stream.py).
"""

from __future__ import annotations

import uuid

from aiohttp import web

from jaxserve.entrypoints.app_state import STATE_KEY
from jaxserve.entrypoints.beam_search import beam_search_outputs
from jaxserve.entrypoints.bodies import CompletionBodies
from jaxserve.entrypoints.errors import APIError
from jaxserve.entrypoints.protocol import CompletionRequest
from jaxserve.entrypoints.request_mapping import check_request, to_sampling_params
from jaxserve.entrypoints.serving_engine import (
    admitted, bad_request, encode, in_flight_cap, lora_request_of, take_in)
from jaxserve.entrypoints.serving_stream import make_bodies, run_request, submitting
from jaxserve.exceptions import ValidationError


async def create_completion(request: web.Request) -> web.StreamResponse:
    llm, req, model, deadline = await take_in(request, CompletionRequest)
    sp = await to_sampling_params(llm, req, req.max_tokens, {})
    try:
        prompts = req.prompts()
    except ValidationError as e:
        raise bad_request(e) from None
    limit = in_flight_cap(request)
    if len(prompts) * sp.n > limit:  # could never be admitted: not a 503 to retry
        raise APIError(400, f"prompt: {len(prompts)} prompts x n={sp.n} asks for "
                       f"{len(prompts) * sp.n} sequences; at most {limit} on this server "
                       "(--max-num-seqs + --max-waiting-requests)", param="prompt")
    with admitted(request, len(prompts) * sp.n):
        ids_list = []
        for prompt in prompts:
            ids = (await encode(llm.encode_prompt(prompt))
                   if isinstance(prompt, str) else list(prompt))
            check_request(llm, ids, sp, "prompt", "max_tokens")
            ids_list.append(ids)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        beams = req.use_beam_search  # its own engine requests (beam_search.py)
        lora = lora_request_of(request, model)
        with submitting(llm, [] if beams else ids_list, sp, request_id,
                        lora_request=lora, cache_salt=req.cache_salt) as submitted:
            echo_texts = None
            if req.echo:
                echo_texts = [p if isinstance(p, str) else await llm.detokenize(p)
                              for p in prompts]
            bodies = make_bodies(CompletionBodies, request_id, model, llm, sp, req,
                                 request.app[STATE_KEY]["return_tokens_as_token_ids"])
            outputs = (beam_search_outputs(llm, ids_list, sp, request_id, req.length_penalty,
                                           lora, req.cache_salt) if beams else None)
            return await run_request(request, llm, ids_list, submitted, sp, bodies,
                                     stream=bool(req.stream), echo_texts=echo_texts,
                                     deadline=deadline, outputs=outputs)
