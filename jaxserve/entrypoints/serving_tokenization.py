"""vLLM's POST /tokenize and POST /detokenize (its serving_tokenization.py)."""

from __future__ import annotations

from aiohttp import web

from jaxserve.engine.input_processor import check_token_ids
from jaxserve.entrypoints.errors import APIError
from jaxserve.entrypoints.protocol import (
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse)
from jaxserve.entrypoints.request_mapping import chat_messages
from jaxserve.entrypoints.responses import json_response
from jaxserve.entrypoints.serving_engine import (
    bad_request, check_model, encode, llm_of, parse_request, require_ready)
from jaxserve.exceptions import ValidationError


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize (vLLM's): a prompt, or chat messages through the chat template, to token
    ids."""
    llm = llm_of(request)
    require_ready(llm)
    req: TokenizeRequest = await parse_request(request, TokenizeRequest)
    check_model(request, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        ids = await encode(llm.encode_prompt(req.prompt, req.add_special_tokens is not False))
    else:
        _, ids = await encode(llm.encode_chat(
            chat_messages(req), req.add_generation_prompt, bool(req.add_special_tokens),
            req.template_tools(), req.continue_final_message, req.chat_template_kwargs))
    strs = llm.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return json_response(TokenizeResponse(count=len(ids), max_model_len=llm.config.max_model_len,
                                          tokens=ids, token_strs=strs))


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize (vLLM's): token ids to text."""
    llm = llm_of(request)
    require_ready(llm)
    req: DetokenizeRequest = await parse_request(request, DetokenizeRequest)
    check_model(request, req.model)
    try:
        check_token_ids(req.tokens, llm.vocab_size, "tokens")
    except ValidationError as e:
        raise bad_request(e) from None
    return json_response(DetokenizeResponse(prompt=await llm.detokenize(req.tokens)))
