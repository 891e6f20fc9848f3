"""llguidance grammars (vLLM V1's ``backend_guidance``): a StructuredOutputsParams -> the
grammar text llguidance takes, the LLTokenizer built from the tokenizer, and compiling a
grammar into an ``LLMatcher`` within fixed resource limits.

Used by both processes: the API process compiles a request's grammar once to refuse a bad one
with a 400 (``validator.py``); the engine compiles it for real (``manager.py``). Neither
imports JAX.

JSON schemas compile without flexible whitespace (``{"a":1}``, no spaces or newlines between
tokens): a model could otherwise emit whitespace until max_tokens, and a bounded schema then
no longer bounds the output's length (vLLM's ``disable_any_whitespace``, on by default here).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import llguidance

from jaxserve.exceptions import ValidationError
from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.tokenizer_io import TokenizerVocab

# llguidance's own bounds on the work of compiling a grammar and of each mask (its defaults,
# with a smaller grammar size: a request's spec is at most MAX_STRUCTURED_OUTPUT_CHARS).
# Compiling past them fails the grammar instead of running on; the API process adds a
# wall-clock limit on top (validator.py).
LIMITS = dict(max_grammar_size=200_000, verbose_errors=False)
_JSON_OPTIONS = {"whitespace_flexible": False}

# The token sets ("slices") llguidance precomputes (LLTokenizer's ``slices``): llguidance's
# general_slices() (whitespace; 1-10, 1-30 and any number of JSON string characters) plus
# 1-8, 1-12 and 1-15 characters. A mask inside a string takes whole the largest slice that the
# lexer state contains (a regex-containment check) and walks the token trie for the tokens
# outside it (parser/src/earley/slicer.rs in guidance-ai/llguidance). An unbounded string
# contains every slice; a string with a maxLength (a counted regex, ``(?s:.{0,n})`` in
# parser/src/json/compiler.rs) with r characters left contains only the slices of at most r
# characters, and the defaults jump from 10 to 30: with 10 <= r < 30 every token of 11-30
# characters was walked (~30k trie nodes for SmolLM2's vocabulary), with r < 10 the whole trie.
# The extra slices shrink those walks (tokens longer than 15 characters are few): 15-25%
# off the masks of bounded-string schemas (scripts/bench_structured.py mask); they cannot do
# more: a token longer than r characters never lies in a slice that applies, so llguidance
# always walks those to depth r + 1 (15k-40k nodes for 3 <= r <= 10). Slices only speed up
# the mask; which tokens it allows is the same.
_STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'
SLICES = [r"[\x20\x0A\x0D\x09]+",
          *(f"{_STRING_CHAR}{{1,{n}}}" for n in (8, 10, 12, 15, 30)),
          f"{_STRING_CHAR}+"]


# llguidance's compiler recurses in native code along the grammar's rule chains and a schema's
# $ref chains: at MAX_STRUCTURED_OUTPUT_CHARS (100,000 characters) the deepest specs measured
# (chains of rules `a: b`, of `{"items": {"$ref": ...}}` definitions) overflow 16 MiB of stack
# and compile in 32 MiB, where a thread's default is 8 MiB (a segfault of the whole process).
# Every compile runs on one thread of GRAMMAR_STACK_BYTES (address space: only the pages used
# become memory), 8 x the deepest measured; schemas are also refused past MAX_SCHEMA_DEPTH.
GRAMMAR_STACK_BYTES = 256 << 20
# Nesting of a JSON schema counted through subschemas and local $refs (a recursive $ref counts
# once): pydantic models and OpenAI's strict mode stay far below (OpenAI allows 10 levels).
MAX_SCHEMA_DEPTH = 128

_compiler: ThreadPoolExecutor | None = None
_compiler_lock = threading.Lock()


def _compiler_thread() -> ThreadPoolExecutor:
    """The process's one grammar-compiling thread, with GRAMMAR_STACK_BYTES of stack."""
    global _compiler
    with _compiler_lock:
        if _compiler is None:
            previous = threading.stack_size(GRAMMAR_STACK_BYTES)
            try:
                pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxserve-grammar")
                pool.submit(int).result()  # starts its thread now, with that stack size
            finally:
                threading.stack_size(previous)
            _compiler = pool
    return _compiler


class _TooDeep(Exception):
    pass


def schema_depth(schema) -> int:
    """Levels of nested JSON objects and arrays in ``schema``, a local ``$ref`` ("#/...")
    counted as the depth of what it points at (each target measured once; a $ref met again
    inside itself, recursion, adds nothing). Past MAX_SCHEMA_DEPTH it stops: MAX_SCHEMA_DEPTH
    + 1 then. Linear in the schema's size; recurses at most MAX_SCHEMA_DEPTH + 1 frames."""
    measured: dict[str, int] = {}
    open_refs: set[str] = set()

    def depth(node, level: int) -> int:
        if level > MAX_SCHEMA_DEPTH:
            raise _TooDeep
        deepest = 1
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                deepest = max(deepest, 1 + depth(child, level + 1))
        ref = node.get("$ref") if isinstance(node, dict) else None
        if isinstance(ref, str) and ref.startswith("#") and ref not in open_refs:
            if ref not in measured:
                target = _resolve_pointer(schema, ref)
                open_refs.add(ref)
                measured[ref] = (depth(target, level + 1)
                                 if isinstance(target, (dict, list)) else 0)
                open_refs.discard(ref)
            if level + measured[ref] > MAX_SCHEMA_DEPTH:
                raise _TooDeep
            deepest = max(deepest, 1 + measured[ref])
        return deepest

    try:
        return depth(schema, 1)
    except _TooDeep:
        return MAX_SCHEMA_DEPTH + 1


def _resolve_pointer(document, ref: str):
    """The value a local JSON pointer ("#/a/b", RFC 6901) names in ``document``, or None."""
    node = document
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


def build_ll_tokenizer(vocab: TokenizerVocab, vocab_size: int,
                       eos_token_ids) -> llguidance.LLTokenizer:
    """The LLTokenizer of a fast tokenizer (about 0.4 s for SmolLM2's 49,152 tokens; build it
    once), as ``llguidance.hf.from_tokenizer`` builds it, without transformers.

    Args:
      vocab: the model's fast tokenizer (``TokenizerVocab.of`` one, or ``.read`` its folder).
      vocab_size: the model's vocabulary size (rows of its logits). The LLTokenizer covers
        max(vocab_size, vocab.size) ids; ids the tokenizer does not define (a model's
        padded vocabulary) are never allowed by a mask.
      eos_token_ids: the ids that end generation; a grammar that is complete allows them.
        llguidance refuses an EOS id the tokenizer does not define, which a dummy model's
        borrowed tokenizer can lack (Llama-3.1's 128001 against SmolLM2's 49,152 tokens): such
        ids are left out, and with none left the tokenizer's own EOS stands in.
    """
    eos = sorted(i for i in eos_token_ids if i < vocab.size)
    return llguidance.LLTokenizer(vocab.json, n_vocab=max(vocab_size, vocab.size),
                                  eos_token=eos or vocab.eos_token_id, slices=SLICES)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint.

    Raises:
      ValidationError: on ``structured_outputs``, naming the constraint's kind, for a spec that is not even well-formed (a
        schema that is not JSON, a GBNF grammar that does not convert); deeper errors surface
        when the grammar is compiled (``compile_matcher``).
    """
    kind, _ = params.key
    try:
        if kind == "json":
            schema = _checked_schema(params.json)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if kind == "structural_tag":
            return _structural_tag_grammar(params.structural_tag)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                 defaults=_JSON_OPTIONS)
        if kind == "regex":
            return llguidance.grammar_from("regex", params.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", params.choice)
        return llguidance.grammar_from("grammar", params.grammar)
    except (ValueError, TypeError) as e:
        raise ValidationError(f"{kind}: {e}", parameter="structured_outputs") from None
    except RecursionError:  # GBNF's conversion to Lark, a schema's JSON text: recursive parsers
        raise ValidationError(f"{kind}: the spec nests too deeply to read",
                              parameter="structured_outputs") from None


def _checked_schema(schema) -> dict:
    """A JSON schema (a dict or its text) as a dict, within MAX_SCHEMA_DEPTH. Raises
    ValueError."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema is a JSON object")
    if schema_depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the schema nests more than {MAX_SCHEMA_DEPTH} levels deep "
                         "(objects and arrays, through local $refs)")
    return schema


def _structural_tag_grammar(text: str) -> str:
    """The Lark grammar of vLLM's structural tag (its JSON text: ``{"structures": [{"begin",
    "schema", "end"}], "triggers": [...]}``), as vLLM's llguidance backend builds it: one
    ``llguidance.StructTag`` per structure, under the trigger its ``begin`` starts with; the
    text around the tags is free. Its JSON is compact, as every JSON constraint's here.
    Raises ValueError naming what is malformed."""
    tag = json.loads(text)
    if not isinstance(tag, dict) or "format" in tag:
        raise ValueError('a structural tag is a JSON object {"structures": [...], "triggers": '
                         "[...]} (xgrammar's newer form, with \"format\", is not supported)")
    triggers, structures = tag.get("triggers"), tag.get("structures")
    if not (isinstance(triggers, list) and triggers
            and all(isinstance(t, str) and t for t in triggers)):
        raise ValueError("triggers: a list of one or more non-empty strings")
    if not (isinstance(structures, list) and structures):
        raise ValueError("structures: a list of one or more {begin, schema, end} objects")
    tags = []
    for i, st in enumerate(structures):
        if not (isinstance(st, dict) and isinstance(st.get("begin"), str)
                and isinstance(st.get("end"), str)):
            raise ValueError(f"structures[{i}]: an object with begin and end strings and a "
                             "schema")
        schema = _checked_schema(st.get("schema") or {})
        schema = {**schema, "x-guidance": {**_JSON_OPTIONS, **schema.get("x-guidance", {})}}
        trigger = next((t for t in triggers if st["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structures[{i}]: begin {st['begin']!r} starts with none of the "
                             "triggers")
        tags.append(llguidance.StructTag(trigger=trigger, begin=st["begin"], grammar=schema,
                                         end=st["end"]))
    return llguidance.StructTag.to_grammar(tags)


def compile_matcher(ll_tokenizer: llguidance.LLTokenizer,
                    params: StructuredOutputsParams) -> llguidance.LLMatcher:
    """A fresh LLMatcher of the constraint, at its start state, compiled on the grammar thread
    (GRAMMAR_STACK_BYTES of stack; the caller waits; llguidance drops the GIL while it
    compiles: typically well under 10 ms; bounded by LIMITS).

    Raises:
      ValidationError: on ``structured_outputs``, "<kind>: <llguidance's error>", for a spec that does not compile (an invalid
        schema, regex or grammar, one past LIMITS or nested past MAX_SCHEMA_DEPTH).
    """
    return _compiler_thread().submit(_compile, ll_tokenizer, params).result()


def _compile(ll_tokenizer: llguidance.LLTokenizer,
             params: StructuredOutputsParams) -> llguidance.LLMatcher:
    text = grammar_text(params)
    matcher = llguidance.LLMatcher(ll_tokenizer, text, log_level=0, limits=limits())
    if matcher.is_error():
        raise ValidationError(f"{params.key[0]}: {matcher.get_error().strip()}",
                              parameter="structured_outputs")
    return matcher
