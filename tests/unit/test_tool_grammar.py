"""The grammar that enforces tool_choice (jaxserve/entrypoints/tool_grammar.py), compiled as the
engine compiles it (llguidance, ``compile_matcher``) against the default model's tokenizer: it
compiles; what it accepts is what the server's parser reads back as calls whose arguments
validate against the function's parameters (``jsonschema``); what it refuses, it refuses.
Random walks through its token masks sample what a model could be made to write."""

import json

import jsonschema
import llguidance.numpy
import numpy as np
import pytest

from jaxserve.entrypoints.tool_grammar import call_schema, tool_call_grammar
from jaxserve.entrypoints.tool_parsers import TOOL_PARSERS
from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured_output.grammar import build_ll_tokenizer, compile_matcher
from jaxserve.tokenizer_io import TokenizerVocab

WEATHER = {"name": "get_weather", "description": "Current weather in a city.", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
ADD = {"name": "add", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                     "y": {"type": "integer", "minimum": -99, "maximum": 99}},
    "required": ["x", "y"], "additionalProperties": False}}
NOW = {"name": "now"}  # no parameters: an empty object
FUNCTIONS = [WEATHER, ADD, NOW]
PARAMETERS = {f["name"]: f.get("parameters", {"type": "object", "maxProperties": 0})
              for f in FUNCTIONS}


@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.model_loader.dummy import default_tokenizer

    return default_tokenizer()


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    return build_ll_tokenizer(TokenizerVocab.of(tokenizer), len(tokenizer), [tokenizer.eos_token_id])


def _matcher(ll_tokenizer, grammar):
    """The grammar compiled as the engine compiles it (raises ValueError if it does not)."""
    return compile_matcher(ll_tokenizer, StructuredOutputsParams(grammar=grammar))


def accepts(tokenizer, ll_tokenizer, grammar, text) -> bool:
    m = _matcher(ll_tokenizer, grammar)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def sample(tokenizer, ll_tokenizer, grammar, seed, max_tokens=200) -> str:
    """A random text the grammar allows: uniform over the allowed tokens at each step."""
    rng = np.random.default_rng(seed)
    m = _matcher(ll_tokenizer, grammar)
    mask = llguidance.numpy.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
    ids = []
    for _ in range(max_tokens):
        llguidance.numpy.fill_next_token_bitmask(m, mask)
        allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")
                                 [:ll_tokenizer.vocab_size])
        token = int(rng.choice(allowed))
        if token == ll_tokenizer.eos_token:
            break
        assert m.consume_token(token), m.get_error()
        ids.append(token)
        if m.is_stopped():
            break
    assert m.is_accepting(), tokenizer.decode(ids)
    return tokenizer.decode(ids)


def _valid_calls(parser, text):
    parsed = TOOL_PARSERS[parser]().extract_tool_calls(text)
    for call in parsed.tool_calls:
        jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    return parsed


def _call(parser, name, args):
    key = TOOL_PARSERS[parser].arguments_keys[0]
    body = json.dumps({"name": name, key: args})
    return f"<tool_call>\n{body}\n</tool_call>" if parser == "hermes" else body


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_named_function_gives_one_valid_call(tokenizer, ll_tokenizer, parser):
    grammar = tool_call_grammar(TOOL_PARSERS[parser], FUNCTIONS, "get_weather")
    for seed in range(8):
        parsed = _valid_calls(parser, sample(tokenizer, ll_tokenizer, grammar, seed))
        assert [c.name for c in parsed.tool_calls] == ["get_weather"], parsed
    ok = {"city": "Paris", "unit": "celsius"}
    assert accepts(tokenizer, ll_tokenizer, grammar, _call(parser, "get_weather", ok))
    sep = TOOL_PARSERS[parser].call_separator
    for bad in [_call(parser, "add", {"x": 1, "y": 2}),
                _call(parser, "get_weather", {"city": "Paris"}),  # a required field missing
                _call(parser, "get_weather", {**ok, "unit": "kelvin"}),
                _call(parser, "get_weather", {**ok, "city": "Llanfairpwllgwyngyll"}),
                _call(parser, "get_weather", ok) + sep + _call(parser, "get_weather", ok),
                "Sure! " + _call(parser, "get_weather", ok), "It is sunny."]:
        assert not accepts(tokenizer, ll_tokenizer, grammar, bad), bad


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_required_gives_valid_calls_to_any_tool(tokenizer, ll_tokenizer, parser):
    grammar = tool_call_grammar(TOOL_PARSERS[parser], FUNCTIONS, "required")
    names = set()
    for seed in range(12):
        parsed = _valid_calls(parser, sample(tokenizer, ll_tokenizer, grammar, seed))
        assert parsed.tool_calls and parsed.content is None, parsed
        names |= {c.name for c in parsed.tool_calls}
    assert len(names) >= 2, names
    sep = TOOL_PARSERS[parser].call_separator
    two = _call(parser, "add", {"x": 1, "y": 2}) + sep + _call(parser, "now", {})
    assert accepts(tokenizer, ll_tokenizer, grammar, two)
    assert not accepts(tokenizer, ll_tokenizer, grammar, "No tool needed.")
    assert not accepts(tokenizer, ll_tokenizer, grammar, _call(parser, "now", {"x": 1}))
    single = tool_call_grammar(TOOL_PARSERS[parser], FUNCTIONS, "required",
                               parallel_tool_calls=False)
    assert not accepts(tokenizer, ll_tokenizer, single, two)
    assert accepts(tokenizer, ll_tokenizer, single, _call(parser, "now", {}))


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_auto_with_a_strict_tool_allows_text_and_enforces_calls(tokenizer, ll_tokenizer, parser):
    parsers = TOOL_PARSERS[parser]
    assert tool_call_grammar(parsers, FUNCTIONS, "auto") is None  # nothing strict
    grammar = tool_call_grammar(parsers, [{**WEATHER, "strict": True}, ADD], "auto")
    ok = {"city": "Paris", "unit": "celsius"}
    assert accepts(tokenizer, ll_tokenizer, grammar, "The weather is fine, no call needed.")
    assert accepts(tokenizer, ll_tokenizer, grammar, _call(parser, "get_weather", ok))
    # add is not strict: any object passes; get_weather's must match its parameters.
    assert accepts(tokenizer, ll_tokenizer, grammar, _call(parser, "add", {"z": "?"}))
    assert not accepts(tokenizer, ll_tokenizer, grammar, _call(parser, "get_weather", {"c": 1}))
    assert not accepts(tokenizer, ll_tokenizer, grammar, _call(parser, "other", {}))
    if parser == "hermes":  # calls may follow text; text after a call may not open another
        call = _call(parser, "get_weather", ok)
        assert accepts(tokenizer, ll_tokenizer, grammar, f"Let me check.\n{call}\nDone.")
        assert not accepts(tokenizer, ll_tokenizer, grammar, "Hi <tool_call>\n{}")


def test_special_token_delimiters_are_token_references():
    grammar = tool_call_grammar(TOOL_PARSERS["hermes"], [NOW], "now",
                                special_tokens=["<tool_call>", "</tool_call>", "<|im_end|>"])
    assert 'call: <tool_call> "\\n" (fn_0) "\\n" </tool_call>' in grammar.splitlines()


def test_parameters_local_refs_resolve_inside_the_call_schema(tokenizer, ll_tokenizer):
    """A reference resolves against the whole schema, the call object's: pydantic's ``$defs``
    (and ``#`` itself) are rebased onto where the parameters sit; data is left as it is."""
    place = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
             "required": ["city"], "additionalProperties": False}
    parameters = {"$defs": {"Place": place}, "type": "object", "properties": {
        "to": {"$ref": "#/$defs/Place"}, "tag": {"const": {"$ref": "#/x"}},
        "then": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["to"], "additionalProperties": False}
    arguments = call_schema({"name": "go", "parameters": parameters},
                            "arguments")["properties"]["arguments"]
    assert arguments["properties"]["to"] == {"$ref": "#/properties/arguments/$defs/Place"}
    assert arguments["properties"]["tag"] == {"const": {"$ref": "#/x"}}
    assert arguments["properties"]["then"]["anyOf"][0] == {"$ref": "#/properties/arguments"}
    grammar = tool_call_grammar(TOOL_PARSERS["hermes"], [{"name": "go", "parameters": parameters}],
                                "go")
    ok = {"to": {"city": "Paris"}, "then": {"to": {"city": "Rome"}, "then": None}}
    assert accepts(tokenizer, ll_tokenizer, grammar, _call("hermes", "go", ok))
    assert not accepts(tokenizer, ll_tokenizer, grammar,
                       _call("hermes", "go", {"to": {"town": "Paris"}}))
