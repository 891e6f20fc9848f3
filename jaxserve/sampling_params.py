"""SamplingParams: how to pick each next token and when to stop (vLLM's names and defaults).

Validation lives here, in one place, for the offline API, the HTTP server and the engine. A
msgspec Struct (as in vLLM V1), so it crosses the engine pipe as is; ``__post_init__`` also runs
when a frame is decoded, so the engine process re-checks every request it receives.

Bounds keep every value inside what the engine's arrays hold (int32 top_k, float32 temperature,
top_p, min_p and penalties, fixed-size per-request tables of logit biases and stop token ids,
at most ``MAX_LOGPROBS`` log-probabilities a token) and what the API process can afford per
token (stop strings are matched in Python on every delta, so their number and length are
capped). An out-of-range value raises ValidationError naming its field (``parameter``), and
so does a value of the wrong type; integer fields take numpy's integers (stored as Python ints)
but no float, 3.0 included, and no bool, as the HTTP API's typed bodies refuse them.
"""

import copy
import json as _json  # a field of StructuredOutputsParams is named json
import math
import numbers
import typing

import msgspec

from jaxserve.exceptions import ValidationError

INT32_MAX = 2**31 - 1
MAX_TEMPERATURE = 2.0  # OpenAI's documented range is [0, 2]
# vLLM's floor: 0 < temperature < 0.01 is raised to 0.01 (dividing logits by a smaller one
# overflows float32 and turns sampling into NaNs).
MIN_TEMPERATURE = 0.01
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries; the device keeps a table of this width per request
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's documented range is [-100, 100]
MAX_PENALTY = 2.0  # presence / frequency: OpenAI's range [-2, 2]
MAX_REPETITION_PENALTY = 100.0  # vLLM asks only > 0; bounded so logits * it stays finite
MAX_LOGPROBS = 20  # OpenAI's top_logprobs range is [0, 20]; vLLM's default max_logprobs
MAX_N = 128  # OpenAI's range for n is [1, 128]; the server may lower it (max_num_seqs)
# A grammar spec (schema, regex, grammar or choices) bounds what one request may hand the
# grammar compiler; llguidance's own limits bound the work (jaxserve/structured_output).
MAX_STRUCTURED_OUTPUT_CHARS = 100_000


def _in_range(x: float, lo: float, hi: float) -> bool:
    # NaN fails every comparison, so each check passes only for good values.
    return math.isfinite(x) and lo <= x <= hi


def _as_int(x):
    """``x`` as a Python int where it is an integer of another type (numpy's), else ``x``.
    A bool stays a bool and a float a float, 3.0 too: the HTTP API refuses both for an
    integer field, and so does ``SamplingParams``."""
    if isinstance(x, numbers.Integral) and not isinstance(x, bool):
        return int(x)
    return x


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):
    """A constraint on the generated text (vLLM V1's name and fields): exactly one of

    Attributes:
      json: a JSON schema (a dict, or its JSON text); the output is one JSON value it accepts.
      regex: a regular expression (Rust ``regex`` syntax) the whole output matches.
      choice: the output is exactly one of these strings (1 to 1024 of them).
      grammar: a Lark grammar as llguidance takes it (a GBNF grammar is converted); Lark
        rules may embed a JSON schema with ``%json { ... }``.
      json_object: True: the output is one JSON object (OpenAI's ``json_object`` mode).
      structural_tag: vLLM's structural tag, as JSON text: ``{"structures": [{"begin",
        "schema", "end"}, ...], "triggers": [...]}``: free text in which each ``begin`` (it
        starts with one of the triggers) is followed by JSON of its ``schema``, then ``end``.

    and vLLM's options of a JSON constraint (json or json_object; the others ignore them):
      disable_any_whitespace: None or True: JSON is written compactly (no whitespace between
        tokens; this server's default, where vLLM's is False); False: any JSON whitespace.
      whitespace_pattern: a regex of the whitespace allowed between JSON tokens.
      disable_additional_properties: True: an object schema with ``properties`` (or
        ``patternProperties``) and no ``additionalProperties`` gets ``"additionalProperties":
        false`` (vLLM's walk of the schema).
      disable_fallback: accepted and without effect: there is one grammar backend.

    The options are folded into the schema when it is made (``additionalProperties``, and
    llguidance's ``x-guidance`` whitespace settings where the schema has none of its own), so
    ``json`` holds the constraint as compiled; json_object with an option becomes that schema
    of ``{"type": "object"}``. The engine compiles it with llguidance
    (``jaxserve.structured_output``); here only its shape and size are checked.

    Raises:
      ValidationError: from ``__post_init__``, on ``structured_outputs``, for none or
        several constraints, or a spec over MAX_STRUCTURED_OUTPUT_CHARS characters.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool | None = None
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False
    disable_fallback: bool = False

    def __post_init__(self):
        given = [k for k in _CONSTRAINTS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValidationError("structured_outputs: give exactly one of "
                                  f"{', '.join(_CONSTRAINTS[:-1])} and {_CONSTRAINTS[-1]}, got "
                                  f"{given or 'none'}", parameter="structured_outputs")
        if self.choice is not None and not 0 < len(self.choice) <= 1024:
            raise ValidationError("structured_outputs: choice needs 1 to 1024 strings",
                                  parameter="structured_outputs")
        self._fold_json_options()
        if len(self.key[1]) > MAX_STRUCTURED_OUTPUT_CHARS:
            raise ValidationError(f"structured_outputs: the {given[0]} spec exceeds "
                                  f"{MAX_STRUCTURED_OUTPUT_CHARS} characters",
                                  parameter="structured_outputs")

    def _fold_json_options(self) -> None:
        """Write the JSON options into the schema (idempotent: a decoded copy folds again)."""
        guidance = {}
        if self.disable_any_whitespace is False:
            guidance["whitespace_flexible"] = True
        if self.whitespace_pattern is not None:
            guidance["whitespace_pattern"] = self.whitespace_pattern
        if not (guidance or self.disable_additional_properties):
            return
        if self.json_object:
            self.json, self.json_object = {"type": "object"}, None
        if self.json is None:
            return
        schema = self.json
        try:  # a copy (JSON text round trip: as deep as the key's own dumps allows)
            schema = _json.loads(schema if isinstance(schema, str) else _json.dumps(schema))
        except ValueError:
            return  # not JSON: the compiler's error names it
        if not isinstance(schema, dict):
            return
        if self.disable_additional_properties:
            _close_objects(schema)
        if guidance:
            own = schema.setdefault("x-guidance", {})
            if isinstance(own, dict):
                for k, v in guidance.items():
                    own.setdefault(k, v)
        self.json = schema

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec as text): the grammar cache key. A dict schema is written as compact
        JSON with sorted keys, so equal schemas share an entry."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else _json.dumps(
                self.json, sort_keys=True, separators=(",", ":"))
            return "json", text
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", _json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        if self.structural_tag is not None:
            return "structural_tag", self.structural_tag
        return "json_object", ""


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _close_objects(schema: dict) -> None:
    """vLLM's ``disable_additional_properties``: every dict in ``schema`` with ``properties``
    or ``patternProperties`` and no ``additionalProperties`` gets it false. In place, without
    recursion (a schema may nest as deep as JSON parsing allows)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "additionalProperties" not in node and (
                    "properties" in node or "patternProperties" in node):
                node["additionalProperties"] = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Per-request sampling and stopping settings.

    Attributes:
      n: choices generated for the prompt, in [1, 128]; they share the prompt's KV pages.
      max_tokens: most tokens to generate per choice, in [1, 2**31 - 1]; None means up to
        max_model_len.
      min_tokens: EOS and ``stop_token_ids`` cannot be sampled, and stop strings are not
        matched, before this many tokens (at most max_tokens); a ``structured_outputs``
        grammar that is complete (allows nothing but EOS) ends the output all the same.
      temperature: in [0, 2]; 0 means greedy (argmax); values in (0, 0.01) act as 0.01.
      top_p: nucleus sampling mass in (0, 1].
      top_k: keep the k most likely tokens, at most 2**31 - 1; 0 or -1 disables it.
      min_p: in [0, 1]; drop tokens whose probability (after temperature) is below min_p times
        the most likely one's.
      presence_penalty: in [-2, 2]; subtracted from the logit of every token already generated.
      frequency_penalty: in [-2, 2]; times a token's count among the generated ones,
        subtracted from its logit.
      repetition_penalty: in (0, 100]; a token seen in the prompt or the output has its logit
        divided by it when positive, multiplied when negative (1 disables it).
      logit_bias: token id -> bias in [-100, 100] added to its logit, at most 1024 entries.
      allowed_token_ids: only these tokens can be drawn (EOS too only when listed), a
        non-empty list; applied as a bitmask with the structured outputs' (the InputProcessor
        checks the ids against the vocabulary).
      seed: per-request RNG seed for reproducible sampling, a 64-bit integer (negative ones
        too, as OpenAI and vLLM take them); None draws one at random. Choice i of a request with
        n > 1 uses seed + i.
      stop: up to 16 strings of 1..256 characters that end generation.
      stop_token_ids: up to 1024 non-negative token ids that end generation (besides EOS)
        (the InputProcessor also checks them against the vocabulary).
      include_stop_str_in_output: keep the matched stop string, or the stop token's text, in
        the output text (by default both are left out).
      ignore_eos: keep generating past EOS (benchmarks).
      logprobs: return the log-probabilities of each generated token and of this many most
        likely alternatives, in [0, 20]; None returns none.
      prompt_logprobs: the same for every prompt token after the first, in [0, 20].
      skip_special_tokens: leave special tokens out of the output text.
      spaces_between_special_tokens: vLLM's flag for slow tokenizers' decoding; jaxserve's
        tokenizers are all fast ones, which put no spaces there (vLLM V1's fast detokenizer
        ignores it the same way).
      structured_outputs: constrain the output to a JSON schema, regex, choice or grammar
        (StructuredOutputsParams, or a dict of its fields, converted to one); each choice of
        an ``n`` request is constrained alone.

    Log-probabilities are log-softmax values of the model's raw logits (before penalties,
    biases and temperature), as vLLM V1 returns them by default.

    Raises:
      ValidationError: from ``__post_init__``, with the field as ``parameter``, when a value
        is out of range or of the wrong type.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        self.verify()

    def verify(self) -> None:
        """Check and normalize every field, as construction does: ``LLM`` calls it again when
        it adds a request, since a field may have been changed since then.

        Raises:
          ValidationError: with the field as ``parameter``, for a value out of range or of
            the wrong type.
        """
        try:
            self._check()
        except TypeError:  # a value of the wrong type (the API's bodies are typed; LLM's not)
            for name, hint in typing.get_type_hints(SamplingParams).items():
                try:
                    msgspec.convert(getattr(self, name), hint)
                except msgspec.ValidationError as e:
                    raise ValidationError(f"{name} {getattr(self, name)!r}: {e}",
                                          parameter=name) from None
            raise

    def _check(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self._check_integers()
        self._check_structured_outputs()
        if not 1 <= self.n <= MAX_N:
            raise ValidationError(f"n must be in [1, {MAX_N}], got {self.n}", parameter="n")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= INT32_MAX:
            raise ValidationError(f"max_tokens must be in [1, {INT32_MAX}], got {self.max_tokens}",
                                  parameter="max_tokens")
        if not 0 <= self.min_tokens <= (self.max_tokens or INT32_MAX):
            raise ValidationError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}",
                                  parameter="min_tokens")
        if not _in_range(self.temperature, 0, MAX_TEMPERATURE):
            raise ValidationError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}",
                                  parameter="temperature")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if not (_in_range(self.top_p, 0, 1) and self.top_p > 0):
            raise ValidationError(f"top_p must be in (0, 1], got {self.top_p}", parameter="top_p")
        if not -1 <= self.top_k <= INT32_MAX:
            raise ValidationError(f"top_k must be -1 (disable), 0 (disable) or in [1, {INT32_MAX}], "
                                  f"got {self.top_k}", parameter="top_k")
        if self.top_k == -1:
            self.top_k = 0
        if not _in_range(self.min_p, 0, 1):
            raise ValidationError(f"min_p must be in [0, 1], got {self.min_p}", parameter="min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _in_range(getattr(self, name), -MAX_PENALTY, MAX_PENALTY):
                raise ValidationError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                                      f"got {getattr(self, name)}", parameter=name)
        if not (_in_range(self.repetition_penalty, 0, MAX_REPETITION_PENALTY)
                and self.repetition_penalty > 0):
            raise ValidationError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                                  f"got {self.repetition_penalty}", parameter="repetition_penalty")
        self._check_logit_bias()
        allowed = self.allowed_token_ids
        if allowed is not None and not (allowed and all(0 <= t <= INT32_MAX for t in allowed)):
            raise ValidationError("allowed_token_ids: give a non-empty list of token ids",
                                  parameter="allowed_token_ids")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValidationError(f"seed must be a 64-bit integer, got {self.seed}",
                                  parameter="seed")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValidationError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}",
                                  parameter="stop")
        if any(not 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            raise ValidationError(f"stop strings must have 1 to {MAX_STOP_CHARS} characters",
                                  parameter="stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValidationError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got "
                                  f"{len(self.stop_token_ids)}", parameter="stop_token_ids")
        if any(not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise ValidationError("stop_token_ids must be non-negative token ids",
                                  parameter="stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValidationError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}",
                                      parameter=name)

    def _check_integers(self) -> None:
        """Integer fields, token id lists and logit_bias keys hold Python ints: numpy's
        integers are converted; anything else raises TypeError, which ``verify`` turns
        into the field's ValidationError (comparisons alone would let 2.5 or True through)."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None and type(value) is not int:
                value = _as_int(value)
                if type(value) is not int:
                    raise TypeError(name)
                setattr(self, name, value)
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if ids is not None and any(type(t) is not int for t in ids):
                setattr(self, name, ids := [_as_int(t) for t in ids])
                if any(type(t) is not int for t in ids):
                    raise TypeError(name)
        if self.logit_bias and any(type(t) is not int for t in self.logit_bias):
            self.logit_bias = bias = {_as_int(t): b for t, b in self.logit_bias.items()}
            if any(type(t) is not int for t in bias):
                raise TypeError("logit_bias")

    def _check_structured_outputs(self) -> None:
        """A dict of StructuredOutputsParams' fields (as the HTTP API's ``structured_outputs``)
        becomes one; any other type is a ValidationError."""
        so = self.structured_outputs
        if so is None or isinstance(so, StructuredOutputsParams):
            return
        if not isinstance(so, dict):
            raise ValidationError(f"structured_outputs: expected a StructuredOutputsParams or a "
                                  f"dict of its fields, got {type(so).__name__}",
                                  parameter="structured_outputs")
        unknown = sorted(set(so) - set(StructuredOutputsParams.__struct_fields__), key=str)
        if unknown:
            raise ValidationError(f"structured_outputs: unknown field {unknown[0]!r} (fields: "
                                  f"{', '.join(StructuredOutputsParams.__struct_fields__)})",
                                  parameter="structured_outputs")
        try:
            self.structured_outputs = msgspec.convert(so, StructuredOutputsParams)
        except msgspec.ValidationError as e:  # __post_init__'s ValidationError comes wrapped
            message = str(e).removeprefix("structured_outputs: ")
            raise ValidationError(f"structured_outputs: {message}",
                                  parameter="structured_outputs") from None

    def _check_logit_bias(self) -> None:
        if not self.logit_bias:
            self.logit_bias = None
            return
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValidationError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got "
                                  f"{len(self.logit_bias)}", parameter="logit_bias")
        for token, bias in self.logit_bias.items():
            if not 0 <= token <= INT32_MAX:
                raise ValidationError(f"logit_bias: {token} is not a token id",
                                      parameter="logit_bias")
            if not _in_range(bias, -MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE):
                raise ValidationError(f"logit_bias: the bias of token {token} must be in "
                                      f"[-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}], got {bias}",
                                      parameter="logit_bias")

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's ``SamplingParams.clone``): changing the copy's lists, dicts or
        structured outputs leaves this one as it is."""
        return copy.deepcopy(self)

    @property
    def penalized(self) -> bool:
        """Whether any of the three penalties applies (the sampler then needs token counts)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


# The integer fields (``int`` or ``int | None``), as annotated.
_INT_FIELDS = tuple(name for name, hint in typing.get_type_hints(SamplingParams).items()
                    if hint in (int, int | None))


def describe_sampling_defaults(defaults: dict) -> str:
    """One line for the start-up logs: the sampling defaults requests that leave a field out
    get (the model's generation config, ``--generation-config``), or SamplingParams' own."""
    if not defaults:
        return "none (SamplingParams' own: temperature 1.0, no top-p / top-k)"
    return (", ".join(f"{k} {v}" for k, v in defaults.items())
            + " (the model's generation config; --generation-config vllm turns them off)")
