"""A generation request's fields -> what the engine runs: its SamplingParams (the model's
generation config filling in what it leaves out), its output constraint, its chat messages, and
the checks against the engine's limits; every refusal a 400 that names the request's field.
"""

from __future__ import annotations

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.beam_search import MAX_BEAM_WIDTH
from jaxserve.entrypoints.errors import APIError
from jaxserve.entrypoints.serving_engine import bad_request, max_choices
from jaxserve.exceptions import ValidationError
from jaxserve.sampling_params import MAX_N, SamplingParams, StructuredOutputsParams


async def to_sampling_params(llm: AsyncLLM, req, max_tokens: int | None,
                             renames: dict[str, str],
                             tool_grammar: str | None = None) -> SamplingParams:
    """The request's SamplingParams, the model's generation config filling in what it leaves
    out. Fields that contradict each other are a 400 (``req.check``); a value out of range is
    a 400 naming the request's field (``renames``: SamplingParams' name, or the constraint's
    field, -> the request's, where they differ); so is ``n`` above the server's limit, and an
    output constraint (``response_format``, ``structured_outputs``, ``guided_*``) that does not
    compile (checked off the event loop: AsyncLLM.check_structured_outputs).

    ``tool_grammar``: the grammar that enforces the chat request's ``tool_choice``
    (serving_chat.py), its constraint instead: one that does not compile is a 400 on
    ``tools`` (their parameter schemas are what it embeds), and a request that also has a
    constraint of its own is a 400 on ``tool_choice`` (a reply cannot be both).
    """
    try:
        req.check()
        so, so_field = req.structured_outputs_params()
    except ValidationError as e:
        raise bad_request(e, renames) from None
    so_field = renames.get(so_field, so_field)
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
        raise bad_request(e, renames) from None
    limit = min(MAX_N, max_choices(llm))
    if sp.n > limit:
        raise APIError(400, f"n: at most {limit} choices per request on this server (the "
                       "engine runs at most --max-num-seqs sequences at once)", param="n")
    if req.use_beam_search and sp.n > MAX_BEAM_WIDTH:
        raise APIError(400, f"n: at most {MAX_BEAM_WIDTH} beams with use_beam_search (each "
                       f"step asks for 2n of at most {2 * MAX_BEAM_WIDTH} log-probabilities)",
                       param="n")
    return sp


def check_request(llm: AsyncLLM, ids: list[int], sp: SamplingParams, prompt_field: str,
                  max_tokens_field: str) -> None:
    """AsyncLLM.check_request; a 400 names ``stop_token_ids`` / ``logit_bias``, the prompt's
    field, or the field of max_tokens when the prompt fits but not with the tokens asked."""
    try:
        llm.check_request(ids, sp)
    except ValidationError as e:
        raise bad_request(e, {"prompt": prompt_field, "max_tokens": max_tokens_field}) from None


def chat_messages(req, renames: dict[str, str] | None = None) -> list[dict]:
    """The request's messages for the chat template; a non-text part is a 400 on messages
    (``renames``: as bad_request's)."""
    try:
        return req.template_messages()
    except ValidationError as e:
        raise bad_request(e, renames) from None
