"""POST /v1/chat/completions (OpenAI's, SSE streaming): as serving_completion.py, with the
chat template applied to the messages (off the event loop, with vLLM's template options). With a
``--reasoning-parser`` the choices' reasoning is split from their content (docs/reasoning.md).
A request with tools has its choices' content read by the ``--tool-call-parser``'s ToolParser,
and runs under the grammar of tool_grammar.py when its ``tool_choice`` is enforced
(docs/tool_calling.md); like any output constraint, that grammar starts once the reasoning has
ended.

``chat_inputs`` turns a chat request into what the engine runs; /v1/responses uses it too, on
the chat request it converts its own into (serving_responses.py).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.app_state import STATE_KEY
from jaxserve.entrypoints.beam_search import beam_search_outputs
from jaxserve.entrypoints.bodies import ChatBodies
from jaxserve.entrypoints.errors import APIError
from jaxserve.entrypoints.protocol import ChatCompletionRequest
from jaxserve.entrypoints.request_mapping import chat_messages, check_request, to_sampling_params
from jaxserve.entrypoints.serving_engine import (
    admitted, bad_request, encode, llm_of, lora_request_of, take_in)
from jaxserve.entrypoints.serving_stream import make_bodies, run_request, submitting
from jaxserve.entrypoints.tool_grammar import tool_call_grammar
from jaxserve.entrypoints.tool_parsers import ToolParser
from jaxserve.exceptions import ValidationError
from jaxserve.reasoning import ReasoningParser
from jaxserve.sampling_params import SamplingParams


@dataclass
class ChatInputs:
    """What the engine runs for a chat request.

    Attributes:
      ids: the prompt's token ids (the chat template applied).
      sp: its SamplingParams, ``max_tokens`` set.
      tool_parser: the ToolParser class that reads the reply's tool calls; None when the
        request has no tools, or ``tool_choice: none``.
      tool_calls_only: its ``tool_choice`` is enforced (``required`` or a named function): the
        reply is calls only (ToolParser's ``calls_only``).
      reasoning_parser: the ReasoningParser class of ``--reasoning-parser``, or None.
      in_reasoning: the reply starts in the reasoning (ReasoningParser.starts_in_reasoning).
      reasoning_end_id: the token that ends the reasoning, for the engine to start the
        request's output constraint after it (AsyncLLM.add_request); None when the constraint
        (if any) starts at once.
    """

    ids: list[int]
    sp: SamplingParams
    tool_parser: type[ToolParser] | None
    tool_calls_only: bool = False
    reasoning_parser: type[ReasoningParser] | None = None
    in_reasoning: bool = False
    reasoning_end_id: int | None = None


@contextlib.asynccontextmanager
async def chat_inputs(request: web.Request, req: ChatCompletionRequest,
                      names: dict[str, str] | None = None) -> AsyncIterator[ChatInputs]:
    """The ChatInputs of ``req``, admitted (serving_engine.admitted) while the block runs:
    its tool choice and output constraint checked, its SamplingParams made, its messages
    rendered (with vLLM's chat template options) and tokenized, the prompt checked against the
    engine's limits, where the reply's reasoning starts and ends worked out.

    Args:
      request: the HTTP request (the app's settings, admission).
      req: the chat request.
      names: a chat field -> the field the client sent, where they differ (a request of
        another API converted into ``req``): the 400s name the client's field.

    Raises:
      APIError: 400 naming the field at fault, 503 when overloaded.
    """
    llm, names = llm_of(request), names or {}
    try:
        tool_choice = req.effective_tool_choice()
    except ValidationError as e:
        raise bad_request(e, names) from None
    state = request.app[STATE_KEY]
    tool_parser = None if tool_choice is None else state["tool_parser"]
    grammar = None if tool_parser is None else _tool_grammar(llm, tool_parser, req, tool_choice)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    renames = {"logprobs": "top_logprobs", "max_tokens": field, "messages": "messages",
               "response_format": "response_format"}
    renames = {k: names.get(v, v) for k, v in renames.items()}
    sp = await to_sampling_params(llm, req, req.requested_max_tokens(), renames, grammar)
    reasoning_parser = state["reasoning_parser"]
    with admitted(request, sp.n):
        messages = chat_messages(req, renames)
        text, ids = await encode(llm.encode_chat(
            messages, req.add_generation_prompt, req.add_special_tokens, req.template_tools(),
            req.continue_final_message, req.chat_template_kwargs), renames)
        check_request(llm, ids, sp, renames["messages"], renames["max_tokens"])
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
        yield ChatInputs(ids, sp, tool_parser, tool_choice not in (None, "auto"),
                         reasoning_parser, in_reasoning, end_id)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    llm, req, model, deadline = await take_in(request, ChatCompletionRequest)
    async with chat_inputs(request, req) as inputs:
        ids, sp = inputs.ids, inputs.sp
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        beams = req.use_beam_search  # its own engine requests (beam_search.py)
        lora = lora_request_of(request, model)
        with submitting(llm, [] if beams else [ids], sp, request_id,
                        inputs.reasoning_end_id, lora, req.cache_salt) as submitted:
            bodies = make_bodies(
                ChatBodies, request_id, model, llm, sp, req,
                request.app[STATE_KEY]["return_tokens_as_token_ids"],
                tool_parser=inputs.tool_parser, tool_calls_only=inputs.tool_calls_only,
                reasoning_parser=inputs.reasoning_parser,
                in_reasoning=inputs.in_reasoning, include_reasoning=req.include_reasoning,
                role=req.response_role(), echo_text=req.echo_text())
            outputs = (beam_search_outputs(llm, [ids], sp, request_id, req.length_penalty,
                                           lora, req.cache_salt) if beams else None)
            return await run_request(request, llm, [ids], submitted, sp, bodies,
                                     stream=bool(req.stream), echo_texts=None,
                                     deadline=deadline, outputs=outputs)


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
