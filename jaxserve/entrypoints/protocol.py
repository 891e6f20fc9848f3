"""OpenAI request and response bodies (pydantic 2), as vLLM's ``entrypoints/openai/protocol.py``.

Requests (/v1/completions, /v1/chat/completions): types are checked strictly (a string where a
number belongs is a 400, as with OpenAI), and bounded here so that no value can overflow what it
is later packed into: integers fit int32 (``seed``: int64), floats are finite, and every string
can be encoded as UTF-8 (JSON's ``"\\ud800"`` escape gives a lone surrogate, which no encoder
downstream accepts); lists stop at their first bad item. Semantic ranges (temperature in
[0, 2], ...) are SamplingParams' checks. Structured outputs come from ``response_format``
(OpenAI's), ``structured_outputs`` (vLLM's) or vLLM's older ``guided_json`` / ``guided_regex``
/ ``guided_choice`` / ``guided_grammar``, one of them per request. Fields OpenAI defines that
jaxserve does not support (``best_of``, ``suffix``) are accepted only at their neutral value
(``unsupported_field`` names the first offender); fields nobody defines are
kept in ``model_extra`` so the server can log and ignore them. The model's generation config
fills in the sampling fields of GENERATION_DEFAULTS a request leaves out.

Responses: every body the server sends (completions and chat completions, their streamed chunks,
usage, /v1/models, /tokenize, /detokenize, errors), shaped to validate against OpenAI's OpenAPI
schema for the endpoint (``tests/data/openai_openapi_subset.yaml``; the tests check every body).
Fields are declared in the order they go on the wire. Optional fields that OpenAI's format
leaves out when unused (a chunk's ``usage``, a delta's ``role`` / ``content`` / ``tool_calls``,
a message's ``tool_calls``, and in stream chunks vLLM's token ids and reasoning) are omitted when
None; the others (``logprobs``, ``finish_reason``, a message's ``refusal``, error ``param`` /
``code``, and in whole responses vLLM's ``prompt_token_ids``, ``token_ids``,
``prompt_logprobs`` and a message's ``reasoning`` / ``reasoning_content``) are sent as null, as
vLLM sends them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import pydantic
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from jaxserve.entrypoints.tool_parsers.call_object import json_as
from jaxserve.exceptions import ValidationError
from jaxserve.sampling_params import (
    INT32_MAX, MAX_LOGPROBS, SamplingParams, StructuredOutputsParams)


def _utf8(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the string holds a lone UTF-16 surrogate (e.g. \\ud800); it cannot "
                         "be encoded as UTF-8") from None
    return s


Text = Annotated[str, AfterValidator(_utf8)]
Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]  # the vocabulary check comes later
# vLLM's cache_salt: the prefix cache shares pages only among requests of the same salt
CacheSalt = Annotated[str, StringConstraints(min_length=1), AfterValidator(_utf8)]


def Items(item: Any) -> Any:
    """``list[item]`` that stops at its first bad item: by default pydantic reports every one,
    and a body of a million bad token ids takes a minute to validate and report, on the event
    loop."""
    return Annotated[list[item], Field(fail_fast=True)]


class _Base(BaseModel):
    # allow_inf_nan=False: JSON has no NaN / Infinity, and 1e400 parses to inf; both are 400s.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}  # pydantic's union member tags


def field_error(e: pydantic.ValidationError) -> ValidationError:
    """A body's pydantic error as the ValidationError of the field at fault: ``"<path>:
    <message>"`` (``messages.0.content: ...``), its ``parameter`` the top-level field."""
    # A union reports one error per member; the deepest is the one about the value
    # (``stop: ["\ud800"]``: the list item's encoding, not "stop is not a string").
    err = max(e.errors(include_url=False, include_input=False), key=lambda err: len(err["loc"]))
    # Union members add their type names to the location ("str", "list[...]",
    # "function-after[...]"); keep the field names and item indices only.
    loc = ".".join(str(p) for p in err["loc"]
                   if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS))
    field = str(err["loc"][0]) if err["loc"] else None
    msg = "field required" if err["type"] == "missing" else err["msg"]
    return ValidationError(f"{loc or field}: {msg}", parameter=field)


class StreamOptions(_Base):
    """``stream_options`` (only with ``stream: true``). vLLM's defaults: a given
    ``stream_options`` asks for the usage chunk unless it says otherwise;
    ``continuous_usage_stats`` (vLLM's) adds the usage so far to every chunk too."""

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(_Base):
    """``response_format.json_schema``: a named schema; without ``schema``, any JSON value.
    ``strict`` is accepted and always in effect: the output is constrained to the schema."""

    name: Text
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class StructuralTagItem(_Base):
    """One structure of vLLM's structural tag: ``begin``, JSON of ``schema``, ``end``."""

    begin: Text
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    end: Text


class ResponseFormat(_Base):
    """OpenAI's ``response_format``, on both endpoints, and vLLM's ``structural_tag`` type
    (``structures`` and ``triggers``)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: Items(StructuralTagItem) | None = None
    triggers: Items(Text) | None = None


class StructuredOutputsField(_Base):
    """vLLM's ``structured_outputs`` request field: one of json (a schema), regex, choice,
    grammar, json_object, structural_tag, and the options of a JSON constraint
    (StructuredOutputsParams has them all)."""

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Items(Text) | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    structural_tag: Text | None = None
    disable_any_whitespace: bool | None = None
    whitespace_pattern: Text | None = None
    disable_additional_properties: bool = False
    disable_fallback: bool = False


# Request fields that the model's generation config fills in when a request leaves them out
# (vLLM's --generation-config auto), named as SamplingParams names them.
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                       "max_tokens")


class _SamplingFields(_Base):
    """Fields shared by both endpoints: OpenAI's, plus vLLM's sampling extensions (top_k,
    min_p, repetition_penalty, min_tokens, stop_token_ids, include_stop_str_in_output,
    ignore_eos, skip_special_tokens, spaces_between_special_tokens, allowed_token_ids,
    prompt_logprobs) and output options (return_token_ids, return_tokens_as_token_ids,
    use_beam_search with length_penalty)."""

    model: Text | None = None
    n: Int32 | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: Int64 | None = None
    stop: Text | Items(Text) | None = None
    stop_token_ids: Items(TokenId) | None = None
    min_tokens: Int32 = 0
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: Items(TokenId) | None = None
    prompt_logprobs: Int32 | None = None
    return_token_ids: bool = False  # vLLM's extension: token ids in each choice
    cache_salt: CacheSalt | None = None
    # vLLM's: log-probability tokens as "token_id:{id}"; None: the server's
    # --return-tokens-as-token-ids
    return_tokens_as_token_ids: bool | None = None
    use_beam_search: bool = False  # vLLM's: n beams (beam_search.py)
    length_penalty: float = 1.0
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | Text | None = None  # vLLM's older names
    guided_regex: Text | None = None
    guided_choice: Items(Text) | None = None
    guided_grammar: Text | None = None
    guided_whitespace_pattern: Text | None = None  # of a JSON constraint
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None  # accepted, as OpenAI's end-user id; not used

    def unsupported_field(self) -> str | None:
        """The first OpenAI field set to a value jaxserve does not support, or None."""
        return None

    def check(self) -> None:
        """Checks across fields (vLLM's request validators).

        Raises:
          ValidationError: ``stream_options`` without ``stream`` (OpenAI and vLLM refuse it);
            ``prompt_logprobs`` above 0 in a stream (vLLM sends them in no chunk); beam
            search with what it cannot honour (beam_search.py).
        """
        # vLLM's test: an empty object passes.
        if self.stream_options is not None and self.stream_options.model_fields_set and (
                not self.stream):
            raise ValidationError("stream_options: stream options can only be given when "
                                  "stream is true", parameter="stream_options")
        if self.stream and self.prompt_logprobs:
            raise ValidationError("prompt_logprobs: prompt log-probabilities are not "
                                  "available when stream is true", parameter="prompt_logprobs")
        if self.use_beam_search:
            given = [f for f in ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids",
                                 "logprobs", "prompt_logprobs", "response_format",
                                 "structured_outputs", "guided_json", "guided_regex",
                                 "guided_choice", "guided_grammar", "tools")
                     if getattr(self, f, None)]
            if given:
                raise ValidationError(f"{given[0]}: not supported with use_beam_search",
                                      parameter=given[0])

    def _logprobs(self) -> tuple[int | None, int | None]:
        """(SamplingParams.logprobs, .prompt_logprobs) the request asks for."""
        return None, self._prompt_logprobs()

    def _prompt_logprobs(self) -> int | None:
        # A stream sends no prompt log-probabilities: 0 there (which ``check`` lets through, as
        # vLLM does) computes none.
        return None if self.stream else self.prompt_logprobs

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """(the request's output constraint, the field it came from), or (None, None).

        Raises:
          ValidationError: on the constraint's field: several constraints, or one without
            exactly one kind (``structured_outputs: {}``).
        """
        given = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ValidationError("response_format: json_schema is required when type is "
                                      "json_schema", parameter="response_format")
            schema = rf.json_schema.schema_
            given.append(("response_format", {"json": {} if schema is None else schema}))
        elif rf is not None and rf.type == "structural_tag":
            if rf.structures is None or rf.triggers is None:
                raise ValidationError("response_format: a structural_tag takes structures and "
                                      "triggers (xgrammar's newer form, with format, is not "
                                      "supported)", parameter="response_format")
            given.append(("response_format", {"structural_tag": json.dumps({
                "structures": [s.model_dump(by_alias=True) for s in rf.structures],
                "triggers": rf.triggers})}))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given.append(("structured_outputs", {  # its own fields: unknown keys are logged
                StructuredOutputsField.model_fields[k].alias or k: getattr(so, k)
                for k in so.model_fields_set if k in StructuredOutputsField.model_fields}))
        for kind in ("json", "regex", "choice", "grammar"):
            if getattr(self, f"guided_{kind}") is not None:
                given.append((f"guided_{kind}", {kind: getattr(self, f"guided_{kind}")}))
        if not given:
            return None, None
        if len(given) > 1:
            raise ValidationError(f"{given[1][0]}: give one output constraint, not "
                                  f"{' and '.join(field for field, _ in given)}",
                                  parameter=given[1][0])
        field, kw = given[0]
        if self.guided_whitespace_pattern is not None:
            kw.setdefault("whitespace_pattern", self.guided_whitespace_pattern)
        try:
            return StructuredOutputsParams(**kw), field
        except ValidationError as e:
            raise ValidationError(f"{field}: {str(e).removeprefix('structured_outputs: ')}",
                                  parameter=field) from None

    def sampling_params(self, max_tokens: int | None, defaults: dict,
                        structured_outputs: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        """The request's SamplingParams; fields of GENERATION_DEFAULTS it leaves out come from
        ``defaults`` (the model's generation config), then SamplingParams' own defaults.
        ``structured_outputs``: from ``structured_outputs_params``.

        Raises:
          ValidationError: on the field out of range (SamplingParams' names).
        """
        kw: dict[str, Any] = {"max_tokens": max_tokens, "structured_outputs": structured_outputs}
        for name in GENERATION_DEFAULTS:
            value = kw.get(name, getattr(self, name, None))
            kw[name] = defaults.get(name) if value is None else value
        for name in ("n", "presence_penalty", "frequency_penalty", "seed", "stop_token_ids",
                     "allowed_token_ids"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        if self.stop is not None:
            kw["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.logit_bias:
            kw["logit_bias"] = {_token_id_key(k): v for k, v in self.logit_bias.items()}
        kw["logprobs"], kw["prompt_logprobs"] = self._logprobs()
        for name in ("min_tokens", "include_stop_str_in_output", "ignore_eos",
                     "skip_special_tokens", "spaces_between_special_tokens"):
            kw[name] = getattr(self, name)
        return SamplingParams(**{k: v for k, v in kw.items() if v is not None or k in (
            "max_tokens", "logprobs", "prompt_logprobs")})


def _token_id_key(key: str) -> int:
    """A logit_bias key: a token id written as a JSON object key (a string of ASCII digits,
    as OpenAI takes them: no sign, spaces, underscores or other scripts' digits)."""
    if key.isascii() and key.isdigit():
        return int(key)
    raise ValidationError(f"logit_bias: {key[:40]!r} is not a token id (keys are token ids, "
                          "as strings of ASCII digits)", parameter="logit_bias")


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt`` is a string, a list of token ids, or a list of either
    (one prompt each: the response has ``n`` choices per prompt, prompt after prompt)."""

    prompt: Text | Items(TokenId) | Items(Text) | Items(Items(TokenId))
    max_tokens: Int32 | None = 16
    logprobs: Int32 | None = None
    echo: bool | None = False
    best_of: Int32 | None = None
    suffix: Text | None = None

    def unsupported_field(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of not in (None, 1):  # vLLM V1 dropped best_of too
            return "best_of"
        return None

    def _logprobs(self) -> tuple[int | None, int | None]:
        # Echoed prompt tokens carry their log-probabilities too (OpenAI's legacy format).
        prompt = self._prompt_logprobs()
        if self.echo and self.logprobs is not None:
            prompt = max(prompt or 0, self.logprobs)
        return self.logprobs, prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one list entry each. Raises ValidationError on ``prompt`` for none."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValidationError("prompt: the prompt is empty", parameter="prompt")
        return list(p)


class TextPart(_Base):
    """A content part of a chat message. Only ``text`` parts are supported; any other type
    (``image_url``, ``input_audio``, ``file``) is refused by ``ChatCompletionMessageParam.text``."""

    type: Text
    text: Text | None = None


class FunctionCallParam(_Base):
    name: Text
    arguments: Text  # JSON text, as the model (or the client) wrote it


class ToolCallParam(_Base):
    """A call in an earlier assistant message of the conversation."""

    id: Text
    type: Literal["function"]
    function: FunctionCallParam


# Roles whose messages carry content; other roles (vLLM's custom ones) may leave it null.
CONTENT_REQUIRED = ("system", "developer", "user", "tool")


class ChatCompletionMessageParam(_Base):
    """One message of a chat request: system / developer / user text, an assistant message
    (its ``content`` may be null when it carries ``tool_calls``; its ``reasoning``, or the
    older ``reasoning_content``, goes to the template as templates of reasoning models read
    it), a ``tool`` message with the result of the call ``tool_call_id``, or a message of any
    other role, handed to the chat template as it is (vLLM's custom roles)."""

    role: Text
    content: Text | Items(TextPart) | None = None
    name: Text | None = None
    tool_calls: Items(ToolCallParam) | None = None
    tool_call_id: Text | None = None
    reasoning: Text | None = None
    reasoning_content: Text | None = None

    def text(self, where: str) -> str:
        """The message's text (its text parts joined).

        Raises:
          ValidationError: on ``messages``, naming ``where`` and the part, for a part that
            is not text.
        """
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                kind = "images" if part.type == "image_url" else f"{part.type!r} content parts"
                raise ValidationError(f"{where}.content.{j}: {kind} are not supported: this server "
                                      "serves a text-only model (send text parts)",
                                      parameter="messages")
        return "".join(p.text for p in self.content)

    def template_message(self, where: str) -> dict:
        """The message in the transformers chat format: ``{"role", "content"}`` ("developer"
        is OpenAI's new name for "system"), plus an assistant's ``tool_calls`` (each call's
        arguments as a dict where they are a JSON object, as chat templates expect: vLLM
        does the same), a tool message's ``tool_call_id``, or the message's reasoning (as
        ``reasoning_content``, the key Qwen3's and DeepSeek-R1's templates read, and
        ``reasoning``).

        Raises:
          ValidationError: on ``messages``, naming ``where``: a part that is not text, no
            ``content`` on a system, developer, user or tool message (or on an assistant
            message without ``tool_calls`` or reasoning: OpenAI's rule), ``tool_calls`` on a
            message that is not the assistant's, a tool message without ``tool_call_id``.
        """
        if self.content is None and (self.role in CONTENT_REQUIRED or self.role == "assistant"
                                     and not (self.tool_calls or self.reasoning is not None
                                              or self.reasoning_content is not None)):
            raise ValidationError(f"{where}.content: field required in a message of role "
                                  f"{self.role!r}", parameter="messages")
        out = {"role": "system" if self.role == "developer" else self.role,
               "content": self.text(where)}
        if self.tool_calls is not None:
            if self.role != "assistant":
                raise ValidationError(f"{where}.tool_calls: only assistant messages carry tool calls",
                                      parameter="messages")
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_object(c.function.arguments)}}
                for c in self.tool_calls]
        if self.role == "tool":
            if self.tool_call_id is None:
                raise ValidationError(f"{where}.tool_call_id: a tool message needs the id of the "
                                      "call it answers", parameter="messages")
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            out["reasoning_content"] = out["reasoning"] = reasoning
        return out


def _json_object(text: str) -> dict | str:
    """``text`` decoded when it is a JSON object, else ``text`` itself."""
    value = json_as(text, dict)
    return text if value is None else value


# OpenAI's rule for function names.
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


def _json_text(value: dict) -> dict:
    """A JSON value that can be written as JSON text for the prompt and the grammar: no
    NaN / Infinity (``1e400`` parses to inf) and no lone surrogate."""
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        raise ValueError("it holds a number out of range or a lone UTF-16 surrogate") from None
    return value


# vLLM's chat_template_kwargs: JSON values the template may write into the prompt.
TemplateKwargs = Annotated[dict[str, Any], AfterValidator(_json_text)]


class FunctionDefinition(_Base):
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: Text | None = None
    # A JSON schema of the arguments object; None: the function takes no arguments.
    parameters: Annotated[dict[str, Any], AfterValidator(_json_text)] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(_Base):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Base):
    name: Text


class ChatCompletionNamedToolChoiceParam(_Base):
    """``tool_choice`` naming the function the model must call."""

    type: Literal["function"]
    function: NamedFunction


# A chat's messages: at least one, checked until the first bad one.
Messages = Annotated[list[ChatCompletionMessageParam], Field(min_length=1, fail_fast=True)]


class ChatMessages(_Base):
    """A conversation given as plain dicts (``LLM.chat``'s), read as a chat request's."""

    messages: Messages


def parse_messages(messages: list[dict]) -> list[dict]:
    """Messages as dicts (OpenAI's format) -> messages for the chat template, read as a chat
    request's ``messages`` are (``ChatCompletionMessageParam.template_message``: text content
    parts joined, ``developer`` as ``system``, tool call arguments as dicts): ``LLM.chat``
    takes what the server takes.

    Raises:
      ValidationError: on ``messages``, naming the message's field at fault.
    """
    try:
        parsed = ChatMessages.model_validate({"messages": messages}).messages
    except pydantic.ValidationError as e:
        raise field_error(e) from None
    return template_messages(parsed)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions: messages, text content only, and vLLM's chat template
    options: ``add_generation_prompt`` (open the assistant's turn, the default),
    ``continue_final_message`` (leave the last message open for the model to continue; not
    with ``add_generation_prompt``), ``chat_template_kwargs`` (more variables for the
    template, as ``enable_thinking``), ``add_special_tokens`` (the tokenizer's on top of the
    template's), ``echo`` (the reply starts with the last message's content when that message
    has the reply's role) and ``include_reasoning`` (false drops the reasoning a
    ``--reasoning-parser`` separates)."""

    messages: Messages
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Items(ChatCompletionToolsParam) | None = None
    tool_choice: (Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam
                  | None) = None
    parallel_tool_calls: bool | None = None  # None: OpenAI's default, true
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: TemplateKwargs | None = None
    include_reasoning: bool = True

    def check(self) -> None:
        """_SamplingFields.check, and vLLM's: ``continue_final_message`` and
        ``add_generation_prompt`` exclude each other."""
        super().check()
        if self.continue_final_message and self.add_generation_prompt:
            raise ValidationError("continue_final_message: cannot be true together with "
                                  "add_generation_prompt (set add_generation_prompt to false)",
                                  parameter="continue_final_message")

    def _logprobs(self) -> tuple[int | None, int | None]:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValidationError("top_logprobs: set logprobs to true to use it",
                                      parameter="top_logprobs")
            return None, self._prompt_logprobs()
        return self.top_logprobs or 0, self._prompt_logprobs()

    def response_role(self) -> str:
        """The reply's role (vLLM's): the assistant's, or without a generation prompt the
        last message's (the model continues it)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echo_text(self) -> str | None:
        """With ``echo``, the text the reply starts with: the last message's content when that
        message has the reply's role (vLLM's rule), else ""; None without ``echo``."""
        if not self.echo:
            return None
        last = self.messages[-1]
        return last.text(f"messages.{len(self.messages) - 1}") if (
            last.role == self.response_role()) else ""

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        return template_messages(self.messages)

    def template_tools(self) -> list[dict] | None:
        return template_tools(self.tools)

    def effective_tool_choice(self) -> str | None:
        """What the model is asked to do with tools: None (no tools, or ``none``: no
        parsing), ``auto``, ``required``, or the name of the function it must call. OpenAI's
        default is ``auto`` when tools are given.

        Raises:
          ValidationError: on ``tool_choice``: ``required`` or a function without tools, or a
            function that is not among them.
        """
        choice = self.tool_choice
        if isinstance(choice, ChatCompletionNamedToolChoiceParam):
            choice = choice.function.name
            if not any(t.function.name == choice for t in self.tools or ()):
                raise ValidationError(f"tool_choice: function {choice!r} is not among the request's "
                                      "tools", parameter="tool_choice")
        if not self.tools:
            if choice not in (None, "none", "auto"):
                raise ValidationError(f"tool_choice: {choice!r} needs tools (the request has none)",
                                      parameter="tool_choice")
            return None
        choice = choice or "auto"
        return None if choice == "none" else choice


def template_tools(tools: list[ChatCompletionToolsParam] | None) -> list[dict] | None:
    """The tools for the chat template (OpenAI's definitions, as JSON values)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def template_messages(messages: list[ChatCompletionMessageParam]) -> list[dict]:
    """Messages for the chat template (``ChatCompletionMessageParam.template_message``).

    Raises:
      ValidationError: on ``messages``, naming the message's field at fault.
    """
    return [m.template_message(f"messages.{i}") for i, m in enumerate(messages)]


class TokenizeRequest(_Base):
    """POST /tokenize (vLLM's shapes): a ``prompt``, or chat ``messages`` rendered through the
    chat template (with chat's template options)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatCompletionMessageParam], Field(fail_fast=True)] | None = None
    tools: Items(ChatCompletionToolsParam) | None = None  # rendered with the messages
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: TemplateKwargs | None = None
    return_token_strs: bool = False

    def template_messages(self) -> list[dict]:
        return template_messages(self.messages or [])

    def template_tools(self) -> list[dict] | None:
        return template_tools(self.tools)


class LoadLoRAAdapterRequest(_Base):
    """POST /v1/load_lora_adapter (vLLM's): a PEFT folder served as ``lora_name``; with
    ``load_inplace`` a name already served takes the folder's weights (docs/lora.md)."""

    lora_name: Text
    lora_path: Text
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Base):
    """POST /v1/unload_lora_adapter (vLLM's); ``lora_int_id`` is accepted and not needed."""

    lora_name: Text
    lora_int_id: int | None = None


class DetokenizeRequest(_Base):
    """POST /detokenize."""

    model: Text | None = None
    tokens: Items(TokenId)


# -- responses --------------------------------------------------------------------------------


class OpenAIBaseModel(BaseModel):
    """Base of the response bodies; an unknown field is a bug here, not a client's extension."""

    model_config = ConfigDict(extra="forbid")


def _is_none(value: Any) -> bool:
    return value is None


def _omitted_if_none():
    """A field absent from the JSON when None (OpenAI's bodies leave these out, not null)."""
    return Field(default=None, exclude_if=_is_none)


class _NotGiven:
    def __repr__(self):
        return "NOT_GIVEN"


NOT_GIVEN = _NotGiven()


def _omitted_unless_given():
    """A field absent from the JSON unless given, None included (vLLM's chunks set
    ``stop_reason`` on a choice's finishing chunk only, null at EOS)."""
    return Field(default=NOT_GIVEN, exclude_if=lambda value: value is NOT_GIVEN)


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    """Every error: an HTTP error response, or an SSE event when a stream fails midway."""

    error: ErrorInfo


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class CompletionLogProbs(OpenAIBaseModel):
    """OpenAI's legacy completions log-probabilities of a choice's tokens (or of a chunk's);
    an echoed prompt's first token has null for both its log-probability and its top ones."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's ``Logprob`` as its ``prompt_logprobs`` send it."""

    logprob: float  # at least -9999.0
    rank: int
    decoded_token: str


# vLLM's ``prompt_logprobs``: per prompt token, null for the first, then {token id (a JSON key):
# PromptLogprob} holding the token and its most likely alternatives.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionResponseChoice(OpenAIBaseModel):
    """A choice of a whole completions response; vLLM's fields are null when not asked for."""

    index: int = 0
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    # vLLM's return_token_ids: the prompt's ids and the generated ids (EOS / stop token included).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    """A streamed completion choice: the text and token ids new since the last chunk (the
    prompt's ids ride along in the first chunk with generated ids)."""

    index: int = 0
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = _omitted_unless_given()
    token_ids: list[int] | None = _omitted_if_none()
    prompt_token_ids: list[int] | None = _omitted_if_none()


class CompletionStreamResponse(OpenAIBaseModel):
    """One SSE chunk of /v1/completions; the usage chunk has no choices."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = _omitted_if_none()


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float  # at least -9999.0 (OpenAI's value for "very unlikely"; JSON has no -inf)
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    """A chat choice's log-probabilities: one entry per generated token."""

    content: list[ChatCompletionLogProbsContent] | None = None
    refusal: list[ChatCompletionLogProbsContent] | None = None  # jaxserve never refuses


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(OpenAIBaseModel):
    id: str  # call_ and 24 characters, unique
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    """The reply's message in a non-streamed chat completion (``refusal`` is required and
    nullable in OpenAI's schema; ``content`` is null when the message is only tool calls).
    ``role`` is the assistant's unless the request had no generation prompt (vLLM's rule).
    ``reasoning`` (vLLM's current name) and ``reasoning_content`` (its older one) hold the
    text a ``--reasoning-parser`` separated, both null without it, as vLLM sends them."""

    role: str = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = _omitted_if_none()
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    token_ids: list[int] | None = None  # vLLM's return_token_ids; null when not asked for


class ChatCompletionResponse(OpenAIBaseModel):
    """A whole chat completion; vLLM's ``prompt_logprobs`` and ``prompt_token_ids`` (top
    level, one prompt) are null when not asked for."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = _omitted_if_none()
    arguments: str | None = _omitted_if_none()


class DeltaToolCall(OpenAIBaseModel):
    """A fragment of call ``index``: the first carries ``id``, ``type`` and the function's
    name (arguments ""), the next ones argument text."""

    index: int
    id: str | None = _omitted_if_none()
    type: Literal["function"] | None = _omitted_if_none()
    function: DeltaFunctionCall


class DeltaMessage(OpenAIBaseModel):
    """What a chat chunk adds: the role once (first chunk), then reasoning, text or tool-call
    fragments; ``{}`` when none. Reasoning goes under both of vLLM's names."""

    role: str | None = _omitted_if_none()
    content: str | None = _omitted_if_none()
    reasoning: str | None = _omitted_if_none()
    reasoning_content: str | None = _omitted_if_none()
    tool_calls: list[DeltaToolCall] | None = _omitted_if_none()


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = _omitted_unless_given()
    token_ids: list[int] | None = _omitted_if_none()


class ChatCompletionStreamResponse(OpenAIBaseModel):
    """One SSE chunk of /v1/chat/completions; the usage chunk has no choices. With
    ``return_token_ids`` a choice's first chunk carries the prompt's ids (vLLM's top-level
    ``prompt_token_ids``); with ``continuous_usage_stats`` every chunk has ``usage``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = _omitted_if_none()
    prompt_token_ids: list[int] | None = _omitted_if_none()


class ModelCard(OpenAIBaseModel):
    id: str  # the served model name, or a LoRA adapter's
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxserve"
    root: str  # the model's name (--model as given), or a LoRA adapter's folder
    parent: str | None = None  # a LoRA adapter's base: the served model name
    max_model_len: int


class ModelList(OpenAIBaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIBaseModel):
    """POST /tokenize: the ids, their count, the model's context length and, when asked, each
    token's vocabulary string."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
