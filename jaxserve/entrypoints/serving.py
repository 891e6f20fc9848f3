"""Handlers of POST /v1/completions, POST /v1/chat/completions (OpenAI format, SSE streaming),
GET /v1/models, GET /v1/models/{model}, and vLLM's POST /tokenize and POST /detokenize.

Both generation endpoints read the body within ``--body-timeout`` (408) and the size limit
(413), parse and validate it (JSON, pydantic, then SamplingParams, the model's generation
config filling in the sampling fields it leaves out), admit its sequences (prompts x ``n``, each
an engine request; 503 with ``Retry-After`` past ``--max-num-seqs`` +
``--max-waiting-requests`` in flight), tokenize (chat template for chat) off the event loop,
check the length against max_model_len, submit the request to the engine (before the response
is set up: the engine starts on the prompt meanwhile), then either collect the
whole output or stream Server-Sent Events: one ``data: {chunk}`` per choice update (text, or
with logprobs or ``return_token_ids`` any new token), an optional usage chunk, then ``data:
[DONE]``. Once a stream's headers are sent, any error (the engine's, a ``--request-timeout``, a
bug) becomes one SSE error event followed by ``[DONE]``, never a second HTTP response. A client
that goes away mid-request (handler cancelled, or a failed write) has its request aborted in
the engine. A completions request with several prompts runs one engine request per prompt, all
at once, at most ``--max-num-seqs`` sequences in all. Every body is one of protocol.py's response models, built by the endpoint's ``Bodies``
(bodies.py). A chat request with tools has its choices' text read by the
``--tool-call-parser``'s ToolParser, and runs under the grammar of tool_grammar.py when its
``tool_choice`` is enforced (docs/tool_calling.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator

import msgspec
import pydantic
from aiohttp import web

from jaxserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestError
from jaxserve.engine.input_processor import check_token_ids
from jaxserve.entrypoints.app_state import LLM_KEY, STATE_KEY
from jaxserve.entrypoints.bodies import Bodies, ChatBodies, ChoiceState, CompletionBodies, usage
from jaxserve.entrypoints.errors import APIError, error_body
from jaxserve.entrypoints.limits import ServerLimits
from jaxserve.entrypoints.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
    ErrorResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse)
from jaxserve.entrypoints.responses import SSEStream, json_response
from jaxserve.entrypoints.safe_log import clip
from jaxserve.entrypoints.tool_grammar import tool_call_grammar
from jaxserve.entrypoints.tool_parsers import ToolParser
from jaxserve.exceptions import ValidationError
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import MAX_N, SamplingParams, StructuredOutputsParams

logger = logging.getLogger("jaxserve.api")

_MAX_LOGGED_FIELDS = 10  # unknown field names quoted in one warning
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}  # pydantic's union member tags


def _llm(request: web.Request) -> AsyncLLM:
    return request.app[LLM_KEY]


def _served_name(request: web.Request) -> str:
    return request.app[STATE_KEY]["served_model_name"] or _llm(request).model_name


def _require_ready(llm: AsyncLLM) -> None:
    if not llm.ready:
        if llm.shutting_down:
            msg = "the server is shutting down"
        elif llm.restarting:
            msg = "the engine process died and is restarting; retry when GET /health answers 200"
        elif llm.errored:
            msg = "the engine is not running (it stopped unexpectedly)"
        else:
            msg = "the engine is still starting; retry when GET /health answers 200"
        raise APIError(503, msg, code="engine_unavailable")


def _limits(request: web.Request) -> ServerLimits:
    return request.app[STATE_KEY]["limits"]


@contextlib.contextmanager
def _admitted(request: web.Request, sequences: int):
    """Counts a generation request's ``sequences`` (engine requests: prompts x ``n``) in
    flight for as long as the block runs. Entered once the body is read and validated, so a
    body still arriving takes no place.

    Raises:
      APIError: 503 with Retry-After when admitting them would put more than ``max_num_seqs
        + max_waiting_requests`` sequences in flight.
    """
    state, llm, limits = request.app[STATE_KEY], _llm(request), _limits(request)
    cap = (llm.engine_config.get("max_num_seqs") or 0) + limits.max_waiting_requests
    if state["in_flight"] + sequences > cap:
        llm.metrics.record_rejected("overloaded")
        raise APIError(503, f"the server is overloaded ({state['in_flight']} sequences in "
                       "flight); retry later", code="overloaded",
                       headers={"Retry-After": str(limits.retry_after_s)})
    state["in_flight"] += sequences
    try:
        yield
    finally:
        state["in_flight"] -= sequences


async def _read_body(request: web.Request) -> bytes:
    """The whole body, within the size limit (413) and the body timeout (408). Either error
    closes the connection: the rest of the body is not read."""
    limits = _limits(request)
    if request.content_length is not None and request.content_length > limits.max_body_bytes:
        raise APIError(413, f"the request body ({request.content_length} bytes) exceeds the "
                       f"limit of {limits.max_body_bytes} bytes", close=True)
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"the request body exceeds the limit of {limits.max_body_bytes} "
                       "bytes", close=True) from None
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
                       code="request_timeout", close=True) from None


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


_json_decoder = msgspec.json.Decoder()


def _loads(body: bytes):
    """JSON text (RFC 8259: UTF-8, whatever the Content-Type's charset says) -> Python value.
    Nesting is bounded by Python's recursion limit (about 1,000 levels).

    msgspec parses it, 4x faster than ``json`` (a 1,000-token-id prompt: 28 against 108 us on
    a CPU core): the value is the same. A body msgspec refuses is parsed again with ``json``,
    whose error the 400 quotes, and which takes what msgspec does not: a lone surrogate escape
    (protocol.py's check then names the field) and numbers too large for a float (inf, which
    the validation refuses)."""
    try:
        return _json_decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):  # (ValidationError is a DecodeError)
        pass
    try:
        return json.loads(body.decode("utf-8"), parse_constant=_no_constants)
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8: {e.reason} at byte "
                       f"{e.start}") from None
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: nested too deeply") from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


async def _parse(request: web.Request, model_cls):
    body = _loads(await _read_body(request))
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = model_cls.model_validate(body)
    except pydantic.ValidationError as e:
        # A union reports one error per member; the deepest is the one about the value
        # (``stop: ["\ud800"]``: the list item's encoding, not "stop is not a string").
        err = max(e.errors(include_url=False, include_input=False),
                  key=lambda err: len(err["loc"]))
        # Union members add their type names to the location ("str", "list[...]",
        # "function-after[...]"); keep the field names and item indices only.
        loc = ".".join(str(p) for p in err["loc"]
                       if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS))
        field = str(err["loc"][0]) if err["loc"] else None
        msg = err["msg"]
        if err["type"] == "missing":
            msg = "field required"
        raise APIError(400, f"{loc or field}: {msg}", param=field) from None
    if req.model_extra:
        names = itertools.islice(req.model_extra, _MAX_LOGGED_FIELDS)  # in body order
        more = len(req.model_extra) - _MAX_LOGGED_FIELDS
        logger.warning("ignoring unknown fields in %s request: %s%s", request.path,
                       ", ".join(clip(n) for n in names), f" and {more} more" if more > 0 else "")
    bad = req.unsupported_field() if hasattr(req, "unsupported_field") else None
    if bad:
        raise APIError(400, f"{bad}: this value is not supported by jaxserve yet", param=bad)
    return req


def _bad_request(e: ValidationError, renames: dict[str, str] | None = None) -> APIError:
    """The 400 of ``e``, its ``param`` the field at fault in the request's name (``renames``:
    the internal name -> the request's, where they differ)."""
    param = e.parameter
    return APIError(400, str(e), param=(renames or {}).get(param, param))


def _check_model(request: web.Request, model: str | None) -> str:
    name = _served_name(request)
    if model is not None and model != name:
        raise APIError(404, f"The model `{model}` does not exist. This server serves `{name}`.",
                       param="model", code="model_not_found")
    return name


async def _sampling_params(llm: AsyncLLM, req, max_tokens: int | None,
                           renames: dict[str, str],
                           tool_grammar: str | None = None) -> SamplingParams:
    """The request's SamplingParams, the model's generation config filling in what it leaves
    out. A value out of range is a 400 naming the request's field (``renames``: SamplingParams'
    name -> the request's, where they differ); so is ``n`` above the server's limit, and an
    output constraint (``response_format``, ``structured_outputs``, ``guided_*``) that does not
    compile (checked off the event loop: AsyncLLM.check_structured_outputs).

    ``tool_grammar``: the grammar that enforces the chat request's ``tool_choice``
    (``_tool_grammar``), its constraint instead: one that does not compile is a 400 on
    ``tools`` (their parameter schemas are what it embeds), and a request that also has a
    constraint of its own is a 400 on ``tool_choice`` (a reply cannot be both).
    """
    try:
        so, so_field = req.structured_outputs_params()
    except ValidationError as e:
        raise _bad_request(e) from None
    label = so_field  # what a 400 about the constraint starts with
    if tool_grammar is not None:
        if so is not None:
            raise APIError(400, "tool_choice: enforced tool calls (tool_choice required or a "
                           f"function, or a strict tool) cannot be combined with {so_field}",
                           param="tool_choice")
        so_field, label = "tools", "tools: the grammar that enforces the tool calls"
        try:
            so = StructuredOutputsParams(grammar=tool_grammar)
        except ValidationError as e:  # too long: the tools' schemas are
            raise APIError(400, f"{label}: {str(e).removeprefix('structured_outputs: ')}",
                           param=so_field) from None
    if so is not None:
        try:
            await llm.check_structured_outputs(so)
        except ValidationError as e:
            raise APIError(400, f"{label}: {e}", param=so_field) from None
    try:
        sp = req.sampling_params(max_tokens, llm.generation_config, so)
    except ValidationError as e:
        raise _bad_request(e, renames) from None
    limit = min(MAX_N, _max_sequences(llm))
    if sp.n > limit:
        raise APIError(400, f"n: at most {limit} choices per request on this server (the "
                       "engine runs at most --max-num-seqs sequences at once)", param="n")
    return sp


def _max_sequences(llm: AsyncLLM) -> int:
    """The most sequences (prompts x ``n``) one request may ask for: what the engine runs at
    once (``max_num_seqs``). More would only queue behind the request's own, and it bounds what
    one HTTP request adds to the queue."""
    return llm.engine_config.get("max_num_seqs") or MAX_N


def _check_request(llm: AsyncLLM, ids: list[int], sp: SamplingParams, prompt_field: str,
                   max_tokens_field: str) -> None:
    """AsyncLLM.check_request; a 400 names ``stop_token_ids`` / ``logit_bias``, the prompt's
    field, or the field of max_tokens when the prompt fits but not with the tokens asked."""
    try:
        llm.check_request(ids, sp)
    except ValidationError as e:
        raise _bad_request(e, {"prompt": prompt_field, "max_tokens": max_tokens_field}) from None


async def _encode(coro):
    """Awaits a tokenization; its ValidationError (too long, template error) is a 400."""
    try:
        return await coro
    except ValidationError as e:
        raise _bad_request(e) from None


def _raise_for(e: Exception):
    if isinstance(e, EngineDeadError):
        raise APIError(503, str(e), code="engine_unavailable") from None
    if isinstance(e, RequestError):
        status = 400 if e.kind == "invalid_request" else 500
        raise APIError(status, str(e)) from None
    raise e


def _timeout_message(request: web.Request) -> str:
    return f"the request ran past --request-timeout ({_limits(request).request_timeout_s:g} s)"


def _error_event(request: web.Request, e: Exception) -> ErrorResponse:
    """The SSE error event of a stream that failed after its headers were sent."""
    if isinstance(e, EngineDeadError):
        return error_body(str(e), "server_error", None, "engine_unavailable")
    if isinstance(e, RequestError):
        kind = "invalid_request_error" if e.kind == "invalid_request" else "server_error"
        return error_body(str(e), kind)
    if isinstance(e, TimeoutError):
        return error_body(_timeout_message(request), "server_error", None, "request_timeout")
    logger.error("error in the stream of %s %s", request.method, request.path, exc_info=e)
    return error_body("internal server error", "server_error")


Submitted = list[tuple[str, asyncio.Queue]]  # (engine request id, its AsyncLLM.add_request queue)


@contextlib.contextmanager
def _submitted(llm: AsyncLLM, prompts: list[list[int]], sp: SamplingParams, request_id: str):
    """Submits each prompt's engine request (``request_id``, or ``{request_id}-{i}`` for
    prompt i of several) and yields them as ``Submitted``; the requests still running are
    aborted when the block ends. Requests go to the engine before the response is set up, so
    that the engine starts on them meanwhile.

    Raises:
      APIError: 503 when the engine is gone.
    """
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    submitted: Submitted = []
    try:
        try:
            for rid, prompt in zip(ids, prompts):
                submitted.append((rid, llm.add_request(prompt, sp, rid)))
        except EngineDeadError as e:
            _raise_for(e)
        yield submitted
    finally:
        for rid, _ in submitted:
            llm.abort(rid)


async def _outputs(llm: AsyncLLM,
                   submitted: Submitted) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, RequestOutput delta) of each submitted request, as they come.
    Closing this iterator aborts the requests still running."""
    if len(submitted) == 1:
        async with contextlib.aclosing(llm.outputs(*submitted[0])) as gen:
            async for out in gen:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, rid: str, outputs: asyncio.Queue) -> None:
        try:
            async with contextlib.aclosing(llm.outputs(rid, outputs)) as gen:
                async for out in gen:
                    queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - the consumer raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, rid, q)) for i, (rid, q) in enumerate(submitted)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                left -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Progress:
    """Turns the deltas of a request's prompts into per-choice updates: the text (with the
    echoed prompt first, when asked), the token ids and the log-probability entries new since
    the choice's last update."""

    def __init__(self, prompts: list[list[int]], echo_texts: list[str] | None,
                 sp: SamplingParams):
        self.prompts = prompts
        self.echo_texts = echo_texts
        self.n = sp.n
        self.want_logprobs = sp.logprobs is not None
        self.choices = [ChoiceState(i, token_ids=[], entries=[] if self.want_logprobs else None)
                        for i in range(len(prompts) * sp.n)]
        self.num_cached = [0] * len(prompts)
        self._prompt_entries: list[list | None] = [None] * len(prompts)

    def updates(self, p: int, out: RequestOutput):
        """(choice, delta, new text, new entries or None) for each choice in ``out``."""
        if out.prompt_logprobs is not None:
            self._prompt_entries[p] = list(zip(self.prompts[p], out.prompt_logprobs))
        self.num_cached[p] = out.num_cached_tokens
        for c in out.outputs:
            ch = self.choices[p * self.n + c.index]
            text = c.text
            entries = list(zip(c.token_ids, c.logprobs or ())) if self.want_logprobs else None
            if not ch.started:
                ch.started = True
                if self.echo_texts is not None:
                    text = self.echo_texts[p] + text
                    if entries is not None:
                        entries = (self._prompt_entries[p]
                                   or [(t, None) for t in self.prompts[p]]) + entries
            ch.token_ids += c.token_ids
            ch.finish_reason = c.finish_reason
            yield ch, c, text, entries

    def usage(self):
        return usage(sum(map(len, self.prompts)), sum(len(c.token_ids) for c in self.choices),
                     sum(self.num_cached))


async def _run(request, llm: AsyncLLM, prompts: list[list[int]], submitted: Submitted,
               sp: SamplingParams, bodies: Bodies, *, stream: bool, include_usage: bool,
               echo_texts: list[str] | None, deadline: float | None):
    """Shared body of both endpoints: reads every prompt's ``n`` choices from the
    ``submitted`` requests, and answers with ``bodies``' response or chunks (a chunk per
    choice update). ``echo_texts``: each prompt's text, to start its choices with
    (completions' ``echo``). ``deadline`` (event loop time, None for none) ends the request:
    504, or an error event in a stream."""
    progress = _Progress(prompts, echo_texts, sp)
    gen = _outputs(llm, submitted)
    if not stream:
        try:
            async with contextlib.aclosing(gen), asyncio.timeout_at(deadline):
                async for p, out in gen:
                    for ch, _, text, entries in progress.updates(p, out):
                        ch.text += text
                        if entries is not None:
                            ch.entries += entries
        except (EngineDeadError, RequestError) as e:
            _raise_for(e)
        except TimeoutError:
            llm.metrics.record_rejected("timeout")
            raise APIError(504, _timeout_message(request), code="request_timeout") from None
        return json_response(bodies.response(progress.choices, prompts, sp.n, progress.usage()))

    sse = SSEStream(request)
    await sse.start()
    token_news = bodies.return_token_ids or progress.want_logprobs
    try:
        try:
            async with contextlib.aclosing(gen), asyncio.timeout_at(deadline):
                for first in bodies.first_chunks(len(progress.choices)):
                    await sse.send(first)
                async for p, out in gen:
                    for ch, c, text, entries in progress.updates(p, out):
                        if text or c.finished or (token_news and c.token_ids):
                            # The prompt's ids ride along with the choice's first token ids.
                            first_ids = len(ch.token_ids) == len(c.token_ids)
                            chunk = bodies.chunk(ch, text, c, entries,
                                                 prompts[p] if first_ids else None)
                            if chunk is not None:
                                await sse.send(chunk)
            if include_usage:
                await sse.send(bodies.usage_chunk(progress.usage()))
        except ConnectionError:
            raise
        except Exception as e:  # noqa: BLE001 - headers are out: the error goes in the stream
            if isinstance(e, TimeoutError):
                llm.metrics.record_rejected("timeout")
            await sse.send(_error_event(request, e))
        await sse.send("[DONE]")
    except ConnectionError as e:  # the client went away; gen is closed (aborted)
        logger.info("client disconnected from %s: %s", bodies.request_id, type(e).__name__)
    return sse.resp


def _deadline(request: web.Request) -> float | None:
    """When a request that arrives now must be done (event loop time), or None."""
    timeout = _limits(request).request_timeout_s
    return None if timeout is None else asyncio.get_running_loop().time() + timeout


def _bodies(cls, request_id: str, model: str, llm: AsyncLLM, sp: SamplingParams, req,
            **kwargs) -> Bodies:
    piece = None if sp.logprobs is None else llm.output_processor.pieces.piece
    return cls(request_id, model, num_logprobs=sp.logprobs, piece=piece,
               return_token_ids=req.return_token_ids, **kwargs)


async def create_completion(request: web.Request) -> web.StreamResponse:
    llm = _llm(request)
    _require_ready(llm)
    deadline = _deadline(request)
    req: CompletionRequest = await _parse(request, CompletionRequest)
    model = _check_model(request, req.model)
    sp = await _sampling_params(llm, req, req.max_tokens, {})
    try:
        prompts = req.prompts()
    except ValidationError as e:
        raise _bad_request(e) from None
    limit = _max_sequences(llm)
    if len(prompts) * sp.n > limit:
        raise APIError(400, f"prompt: {len(prompts)} prompts x n={sp.n} asks for "
                       f"{len(prompts) * sp.n} sequences; at most {limit} per request on this "
                       "server (--max-num-seqs)", param="prompt")
    with _admitted(request, len(prompts) * sp.n):
        ids_list = []
        for prompt in prompts:
            ids = (await _encode(llm.encode_prompt(prompt))
                   if isinstance(prompt, str) else list(prompt))
            _check_request(llm, ids, sp, "prompt", "max_tokens")
            ids_list.append(ids)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        with _submitted(llm, ids_list, sp, request_id) as submitted:
            echo_texts = None
            if req.echo:
                echo_texts = [p if isinstance(p, str) else await llm.detokenize(p)
                              for p in prompts]
            bodies = _bodies(CompletionBodies, request_id, model, llm, sp, req)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await _run(request, llm, ids_list, submitted, sp, bodies,
                              stream=bool(req.stream), include_usage=include_usage,
                              echo_texts=echo_texts, deadline=deadline)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    llm = _llm(request)
    _require_ready(llm)
    deadline = _deadline(request)
    req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
    model = _check_model(request, req.model)
    try:
        tool_choice = req.effective_tool_choice()
    except ValidationError as e:
        raise _bad_request(e) from None
    tool_parser = None if tool_choice is None else request.app[STATE_KEY]["tool_parser"]
    grammar = None if tool_parser is None else _tool_grammar(llm, tool_parser, req, tool_choice)
    max_tokens = req.requested_max_tokens()
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    sp = await _sampling_params(llm, req, max_tokens, {"logprobs": "top_logprobs",
                                                       "max_tokens": field}, grammar)
    with _admitted(request, sp.n):
        messages = _template_messages(req)
        ids = await _encode(llm.encode_chat(messages, tools=req.template_tools()))
        _check_request(llm, ids, sp, "messages", field)
        if sp.max_tokens is None:  # OpenAI's and vLLM's meaning: up to the context
            sp.max_tokens = llm.max_model_len - len(ids)
        if tool_parser is not None:
            tool_parser.adjust_sampling_params(sp)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        with _submitted(llm, [ids], sp, request_id) as submitted:
            bodies = _bodies(ChatBodies, request_id, model, llm, sp, req,
                             tool_parser=tool_parser)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await _run(request, llm, [ids], submitted, sp, bodies,
                              stream=bool(req.stream), include_usage=include_usage,
                              echo_texts=None, deadline=deadline)


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


def _template_messages(req) -> list[dict]:
    """The request's messages for the chat template; a non-text part is a 400 on messages."""
    try:
        return req.template_messages()
    except ValidationError as e:
        raise _bad_request(e) from None


def _model_card(request: web.Request) -> ModelCard:
    llm = _llm(request)
    return ModelCard(id=_served_name(request), created=request.app[STATE_KEY]["created"],
                     root=llm.model_name, max_model_len=llm.max_model_len)


async def show_available_models(request: web.Request) -> web.Response:
    """GET /v1/models: the one model served."""
    _require_ready(_llm(request))
    return json_response(ModelList(data=[_model_card(request)]))


async def retrieve_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: the model's card, or 404 for a name this server does not serve."""
    _require_ready(_llm(request))
    _check_model(request, request.match_info["model"])
    return json_response(_model_card(request))


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize (vLLM's): a prompt, or chat messages through the chat template, to token
    ids."""
    llm = _llm(request)
    _require_ready(llm)
    req: TokenizeRequest = await _parse(request, TokenizeRequest)
    _check_model(request, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        ids = await _encode(llm.encode_prompt(req.prompt, req.add_special_tokens is not False))
    else:
        ids = await _encode(llm.encode_chat(_template_messages(req), req.add_generation_prompt,
                                            bool(req.add_special_tokens), req.template_tools()))
    strs = llm.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return json_response(TokenizeResponse(count=len(ids), max_model_len=llm.max_model_len,
                                          tokens=ids, token_strs=strs))


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize (vLLM's): token ids to text."""
    llm = _llm(request)
    _require_ready(llm)
    req: DetokenizeRequest = await _parse(request, DetokenizeRequest)
    _check_model(request, req.model)
    try:
        check_token_ids(req.tokens, llm.vocab_size, "tokens")
    except ValidationError as e:
        raise _bad_request(e) from None
    return json_response(DetokenizeResponse(prompt=await llm.detokenize(req.tokens)))
