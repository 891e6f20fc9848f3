"""POST /v1/chat/completions (OpenAI's, SSE streaming): as serving_completion.py, with the
chat template applied to the messages (off the event loop, with vLLM's template options). With a
``--reasoning-parser`` the choices' reasoning is split from their content (docs/reasoning.md).
A request with tools has its choices' content read by the ``--tool-call-parser``'s ToolParser,
and runs under the grammar of tool_grammar.py when its ``tool_choice`` is enforced
(docs/tool_calling.md); like any output constraint, that grammar starts once the reasoning has
ended.
"""

from __future__ import annotations

import uuid

from aiohttp import web

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.app_state import STATE_KEY
from jaxserve.entrypoints.beam_search import beam_search_outputs
from jaxserve.entrypoints.bodies import ChatBodies
from jaxserve.entrypoints.errors import APIError
from jaxserve.entrypoints.protocol import ChatCompletionRequest
from jaxserve.entrypoints.request_mapping import chat_messages, check_request, to_sampling_params
from jaxserve.entrypoints.serving_engine import (
    admitted, bad_request, check_model, deadline_of, encode, llm_of, parse_request,
    require_ready)
from jaxserve.entrypoints.serving_stream import make_bodies, run_request, submitting
from jaxserve.entrypoints.tool_grammar import tool_call_grammar
from jaxserve.entrypoints.tool_parsers import ToolParser
from jaxserve.exceptions import ValidationError


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    llm = llm_of(request)
    require_ready(llm)
    deadline = deadline_of(request)
    req: ChatCompletionRequest = await parse_request(request, ChatCompletionRequest)
    model = check_model(request, req.model)
    try:
        tool_choice = req.effective_tool_choice()
    except ValidationError as e:
        raise bad_request(e) from None
    state = request.app[STATE_KEY]
    tool_parser = None if tool_choice is None else state["tool_parser"]
    grammar = None if tool_parser is None else _tool_grammar(llm, tool_parser, req, tool_choice)
    max_tokens = req.requested_max_tokens()
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    sp = await to_sampling_params(llm, req, max_tokens, {"logprobs": "top_logprobs",
                                                         "max_tokens": field}, grammar)
    reasoning_parser = state["reasoning_parser"]
    with admitted(request, sp.n):
        messages = chat_messages(req)
        text, ids = await encode(llm.encode_chat(
            messages, req.add_generation_prompt, req.add_special_tokens, req.template_tools(),
            req.continue_final_message, req.chat_template_kwargs))
        check_request(llm, ids, sp, "messages", field)
        if sp.max_tokens is None:  # OpenAI's and vLLM's meaning: up to the context
            sp.max_tokens = llm.config.max_model_len - len(ids)
        if tool_parser is not None:
            tool_parser.adjust_sampling_params(sp)
        in_reasoning = reasoning_parser is not None and reasoning_parser.starts_in_reasoning(
            text, req.chat_template_kwargs)
        # A constraint starts after the reasoning (vLLM's rule): the engine needs the token
        # that ends it (an end tag that is no single token cannot be seen: it starts at once).
        end_id = (llm.vocabulary_id(reasoning_parser.end_tag)
                  if in_reasoning and sp.structured_outputs is not None else None)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        beams = req.use_beam_search  # its own engine requests (beam_search.py)
        with submitting(llm, [] if beams else [ids], sp, request_id, end_id) as submitted:
            bodies = make_bodies(
                ChatBodies, request_id, model, llm, sp, req, state["return_tokens_as_token_ids"],
                tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                in_reasoning=in_reasoning, include_reasoning=req.include_reasoning,
                role=req.response_role(), echo_text=req.echo_text())
            outputs = (beam_search_outputs(llm, [ids], sp, request_id, req.length_penalty)
                       if beams else None)
            return await run_request(request, llm, [ids], submitted, sp, bodies,
                                     stream=bool(req.stream), stream_options=req.stream_options,
                                     echo_texts=None, deadline=deadline, outputs=outputs)


def _tool_grammar(llm: AsyncLLM, tool_parser: type[ToolParser], req: ChatCompletionRequest,
                  tool_choice: str) -> str | None:
    """The Lark grammar that enforces ``tool_choice`` (tool_grammar.py): for ``required``, a
    named function, and ``auto`` with a ``strict`` tool; None otherwise (``auto`` is then
    only parsed). A schema nested too deeply to be rewritten into it is a 400 on ``tools``
    (the body's JSON may nest as deep as Python's recursion limit)."""
    functions = [t.function.model_dump() for t in req.tools]
    try:
        return tool_call_grammar(tool_parser, functions, tool_choice,
                                 parallel_tool_calls=req.parallel_tool_calls is not False,
                                 special_tokens=llm.tokenizer.all_special_tokens)
    except RecursionError:
        raise APIError(400, "tools: a function's parameters are nested too deeply",
                       param="tools") from None
