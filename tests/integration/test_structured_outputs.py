"""Structured outputs over the real server (default model) and the official ``openai`` client:
JSON schemas, regex and choice constraints
always met, streamed and not; unconstrained requests unaffected by constrained neighbours;
``chat.completions.parse`` with a pydantic model; 400s naming the field.

One server, shared with test_tool_calling.py (conftest.py's ``small_server``)."""

from __future__ import annotations

import json
import pathlib
import re

import jsonschema
import openai
import pydantic
import pytest
from server_utils import in_parallel

from tests.conftest import sharegpt_prompts
from tests.greedy import compare_greedy, hf_greedy_margins

try:  # the HTTP library the openai client is built on (httpx2 in its 3.x releases)
    import httpx2 as httpx
except ImportError:
    import httpx

MODEL = "SmolLM2-135M-Instruct"
SCHEMAS = json.loads((pathlib.Path(__file__).parents[1] / "data" / "structured_schemas.json")
                     .read_text())
MAX_TOKENS = 200  # the longest schema's output took 57 tokens

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(small_server):
    return openai.OpenAI(base_url=f"{small_server.url}/v1", api_key="none", max_retries=0,
                         timeout=600)


def _chat(client, content, stream=False, **kw):
    """(text, finish_reason) of one chat request, streamed or not."""
    messages = [{"role": "user", "content": content}]
    if not stream:
        c = client.chat.completions.create(model=MODEL, messages=messages, **kw).choices[0]
        return c.message.content, c.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    return text, reason


def test_json_schemas_always_validate(client):
    """10 bounded schemas x 5 requests (seeds, the model's sampling defaults),
    alternately streamed: each ends with "stop", parses, and validates against its schema."""
    jobs = [(s, seed, seed % 2 == 1) for s in SCHEMAS for seed in range(5)]

    def one(job):
        s, seed, stream = job
        fmt = {"type": "json_schema",
               "json_schema": {"name": s["name"], "schema": s["schema"], "strict": True}}
        return _chat(client, s["prompt"] + " Answer in JSON.", stream, seed=seed,
                     max_tokens=MAX_TOKENS, response_format=fmt)

    for (s, seed, stream), (text, reason) in zip(jobs, in_parallel(one, jobs)):
        assert reason == "stop", (s["name"], seed, stream, text)
        jsonschema.validate(json.loads(text), s["schema"])


def test_regex_choice_and_json_object_are_met(client):
    """vLLM's ``structured_outputs`` and ``guided_*`` fields on both endpoints, streamed and
    not: the regex matches the whole output, the choice is one of the list, json_object gives
    an object."""
    regex = r"[A-Z][a-z]{2,8}, [0-9]{1,3}"
    choices = ["Paris", "London", "Berlin", "Madrid"]
    jobs = [(kind, stream, seed) for kind in ("regex", "choice") for stream in (False, True)
            for seed in range(4)]

    def one(job):
        kind, stream, seed = job
        extra = ({"structured_outputs": {"regex": regex}} if kind == "regex"
                 else {"guided_choice": choices})
        if seed % 2:  # completions
            kw = dict(model=MODEL, prompt="Name a city and a number:", max_tokens=30,
                      seed=seed, extra_body=extra, temperature=1.0)
            if not stream:
                c = client.completions.create(**kw).choices[0]
                return c.text, c.finish_reason
            parts = list(client.completions.create(**kw, stream=True))
            return ("".join(p.choices[0].text for p in parts if p.choices),
                    [p.choices[0].finish_reason for p in parts if p.choices][-1])
        return _chat(client, "Name a European capital.", stream, seed=seed, max_tokens=30,
                     extra_body=extra)

    for (kind, stream, seed), (text, reason) in zip(jobs, in_parallel(one, jobs)):
        assert reason == "stop", (kind, stream, seed, text)
        if kind == "regex":
            assert re.fullmatch(regex, text), text
        else:
            assert text in choices, text
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris in JSON."}],
        max_tokens=MAX_TOKENS, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # an object is unbounded; it may run out
        assert isinstance(json.loads(r.choices[0].message.content), dict)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: int = pydantic.Field(ge=0, le=50)


def test_parse_with_a_pydantic_model(client):
    """The client's ``chat.completions.parse`` returns a parsed object."""
    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, max_tokens=MAX_TOKENS)
    city = r.choices[0].message.parsed
    assert isinstance(city, City), r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/completions", {"guided_json": {"$ref": "#/missing"}}, "guided_json"),
    ("/v1/completions", {"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ("/v1/chat/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
    ("/v1/chat/completions", {"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ("/v1/completions", {"structured_outputs": {"grammar": "start: (((("}}, "structured_outputs"),
    ("/v1/chat/completions", {"structured_outputs": {"choice": []}}, "structured_outputs"),
    ("/v1/chat/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/chat/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_invalid_constraints_are_400s_naming_the_field(small_server, path, body, param):
    base = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
            else {"prompt": "hi"})
    r = httpx.post(f"{small_server.url}{path}", json={**base, **body, "max_tokens": 5},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_unconstrained_outputs_unchanged_by_constrained_neighbours(client, hf_smollm):
    """16 greedy unconstrained chats give the same tokens alone and sharing the
    batch with 16 constrained ones (up to near-ties, docs/architecture.md, "Testing numerics")."""
    prompts = sharegpt_prompts(16, max_chars=300, skip=500, min_chars=40)
    schema = SCHEMAS[0]

    def plain(p):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=24,
            temperature=0, extra_body={"return_token_ids": True})
        return r.prompt_token_ids, r.choices[0].token_ids

    def job(item):
        kind, p = item
        if kind == "plain":
            return plain(p)
        return _chat(client, p, seed=1, max_tokens=MAX_TOKENS, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema["schema"]}})

    alone = in_parallel(plain, prompts)
    mixed = in_parallel(job, [("plain", p) for p in prompts] + [("so", p) for p in prompts])
    full = 0
    for (prompt_ids, ref), (_, ours) in zip(alone, mixed[:16]):
        same, n = compare_greedy(ours, ref, hf_greedy_margins(hf_smollm, prompt_ids, ref))
        assert same
        full += n == len(ref)
    assert full >= 12, full
    for text, reason in mixed[16:]:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), schema["schema"])


def test_grammar_bombs_get_a_400_or_an_answer_and_the_server_serves_on(small_server, client):
    """The reported bodies (3,000 chained Lark rules, 1,500 chained $defs) and their variants
    at the size limit: each a 400 naming the field or a 200 that meets the grammar, while a
    stream runs beside them and another request is answered after them."""
    from tests.grammar_bombs import lark_bombs, schema_bombs

    bodies = ([{"structured_outputs": {"grammar": g}} for g in lark_bombs()]
              + [{"response_format": {"type": "json_schema", "json_schema": {
                  "name": "b", "schema": s}}} for s in schema_bombs()])
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to twenty."}], stream=True,
        max_tokens=60, temperature=0)
    for body in bodies:
        r = httpx.post(f"{small_server.url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            **body})
        if "grammar" in json.dumps(body)[:40]:
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"], r.text
        else:
            assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
            assert "levels deep" in r.json()["error"]["message"]
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert _chat(client, "Say hi.", max_tokens=4)[0]


def test_a_grammar_that_fails_while_generating_is_an_error(small_server, client):
    """A valid grammar whose matcher fails after "[" (a limit of llguidance's): a 400 naming
    the failure, and in a stream an error event after the "[" (the openai client raises it),
    never a "stop" whose text breaks the grammar; the server serves on."""
    from tests.grammar_bombs import wide_choice_grammar

    body = {"structured_outputs": {"grammar": wide_choice_grammar()}, "max_tokens": 8,
            "temperature": 0}
    with pytest.raises(openai.BadRequestError, match="failed during generation"):
        _chat(client, "Pick one.", extra_body=body)
    streamed = ""
    with pytest.raises(openai.APIError, match="max is 2000"):
        for chunk in client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Pick one."}], stream=True,
                extra_body=body):
            streamed += "".join(c.delta.content or "" for c in chunk.choices)
    assert streamed == "["
    assert _chat(client, "Say hi.", max_tokens=4)[0]


def test_structural_tag_and_json_options_over_the_server(client):
    """vLLM's structural tag (response_format, completions): after the trigger the text is the
    tag's begin, JSON of its schema and its end; free text elsewhere. vLLM's JSON options in
    structured_outputs reach the grammar (disable_additional_properties closes the object)."""
    tag = {"type": "structural_tag", "triggers": ["The"], "structures": [
        {"begin": "The answer is ", "schema": {"type": "integer", "minimum": 0,
                                                "maximum": 99}, "end": "."}]}
    texts = [c.text for c in client.completions.create(
        model=MODEL, prompt="Q: What is 2 + 2?\nA:", max_tokens=24, n=4, seed=3,
        temperature=0.8, extra_body={"response_format": tag}).choices]
    assert any("The" in t for t in texts), texts  # the tag is exercised
    for t in texts:
        for after in t.split("The")[1:]:
            assert re.match(r" answer is [0-9]{1,2}\.", after), t
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
              "required": ["name"]}
    text, reason = _chat(client, "Give a name as JSON.", max_tokens=40, temperature=0,
                         extra_body={"structured_outputs": {
                             "json": schema, "disable_additional_properties": True}})
    assert reason == "stop" and list(json.loads(text)) == ["name"], text
