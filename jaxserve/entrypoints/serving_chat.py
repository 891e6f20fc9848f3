"""POST /v1/chat/completions (OpenAI's, SSE streaming): as serving_completion.py, with the
chat template applied to the messages (off the event loop). A request with tools has its
choices' text read by the ``--tool-call-parser``'s ToolParser, and runs under the grammar of
tool_grammar.py when its ``tool_choice`` is enforced (docs/tool_calling.md).

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
from jaxserve.entrypoints.bodies import ChatBodies
from jaxserve.entrypoints.errors import APIError
from jaxserve.entrypoints.protocol import ChatCompletionRequest
from jaxserve.entrypoints.request_mapping import chat_messages, check_request, to_sampling_params
from jaxserve.entrypoints.serving_engine import (
    admitted, bad_request, encode, llm_of, take_in)
from jaxserve.entrypoints.serving_stream import make_bodies, run_request, submitting
from jaxserve.entrypoints.tool_grammar import tool_call_grammar
from jaxserve.entrypoints.tool_parsers import ToolParser
from jaxserve.exceptions import ValidationError
from jaxserve.sampling_params import SamplingParams


@dataclass
class ChatInputs:
    """What the engine runs for a chat request.

    Attributes:
      ids: the prompt's token ids (the chat template applied).
      sp: its SamplingParams, ``max_tokens`` set.
      tool_parser: the ToolParser class that reads the reply's tool calls; None when the
        request has no tools, or ``tool_choice: none``.
    """

    ids: list[int]
    sp: SamplingParams
    tool_parser: type[ToolParser] | None


@contextlib.asynccontextmanager
async def chat_inputs(request: web.Request, req: ChatCompletionRequest,
                      names: dict[str, str] | None = None) -> AsyncIterator[ChatInputs]:
    """The ChatInputs of ``req``, admitted (serving_engine.admitted) while the block runs:
    its tool choice and output constraint checked, its SamplingParams made, its messages
    rendered and tokenized, the prompt checked against the engine's limits.

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
    tool_parser = None if tool_choice is None else request.app[STATE_KEY]["tool_parser"]
    grammar = None if tool_parser is None else _tool_grammar(llm, tool_parser, req, tool_choice)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    renames = {"logprobs": "top_logprobs", "max_tokens": field, "messages": "messages",
               "response_format": "response_format"}
    renames = {k: names.get(v, v) for k, v in renames.items()}
    sp = await to_sampling_params(llm, req, req.requested_max_tokens(), renames, grammar)
    with admitted(request, sp.n):
        messages = chat_messages(req, renames)
        ids = await encode(llm.encode_chat(messages, tools=req.template_tools()), renames)
        check_request(llm, ids, sp, renames["messages"], renames["max_tokens"])
        if sp.max_tokens is None:  # OpenAI's and vLLM's meaning: up to the context
            sp.max_tokens = llm.config.max_model_len - len(ids)
        if tool_parser is not None:
            tool_parser.adjust_sampling_params(sp)
        yield ChatInputs(ids, sp, tool_parser)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    llm, req, model, deadline = await take_in(request, ChatCompletionRequest)
    async with chat_inputs(request, req) as inputs:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        with submitting(llm, [inputs.ids], inputs.sp, request_id) as submitted:
            bodies = make_bodies(ChatBodies, request_id, model, llm, inputs.sp, req,
                                 tool_parser=inputs.tool_parser)
            return await run_request(request, llm, [inputs.ids], submitted, inputs.sp, bodies,
                                     stream=bool(req.stream), echo_texts=None,
                                     deadline=deadline)


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
