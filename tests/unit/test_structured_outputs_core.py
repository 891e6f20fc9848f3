"""Structured outputs below the server: StructuredOutputsParams' checks, the request fields
that make one, llguidance compilation (errors name the kind), the manager's cache and
bitmasks, the API process's validator (cache, time limit), and the sampler's mask."""

import asyncio
import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from jaxserve.sampling_params import StructuredOutputsParams as SO
from jaxserve.tokenizer_io import TokenizerVocab
from jaxserve.worker.sampler import apply_grammar_bitmask, sample_filtered
from jaxserve.worker.sampling_fields import SamplingMetadata

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.model_loader.loader import load_tokenizer_of

    return load_tokenizer_of(None)  # the default model's (SmolLM2, 49,152 tokens)


@pytest.fixture(scope="module")
def manager(tokenizer):
    from jaxserve.structured_output.manager import StructuredOutputManager

    return StructuredOutputManager(TokenizerVocab.of(tokenizer), 49152, [tokenizer.eos_token_id])


@pytest.mark.parametrize("kw", [{}, {"regex": "a", "choice": ["a"]}, {"json_object": False},
                                {"choice": []}, {"grammar": "x" * 100_001}])
def test_params_need_exactly_one_bounded_constraint(kw):
    with pytest.raises(ValueError, match="^structured_outputs"):
        SO(**kw)


def test_params_key_is_canonical():
    assert SO(json={"b": 1, "a": 2}).key == SO(json={"a": 2, "b": 1}).key == ("json", '{"a":2,"b":1}')
    assert SO(choice=["x", "y"]).key == ("choice", '["x", "y"]')
    assert SO(json_object=True).key == ("json_object", "")


def _chat(**body):
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **body})


@pytest.mark.parametrize("body,field,expected", [
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, "response_format", SO(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                 "strict": True}}},
     "response_format", SO(json=SCHEMA)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", SO(json={})),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs", SO(regex="[0-9]+")),
    ({"guided_choice": ["a", "b"]}, "guided_choice", SO(choice=["a", "b"])),
    ({"guided_json": json.dumps(SCHEMA)}, "guided_json", SO(json=json.dumps(SCHEMA))),
    ({"guided_grammar": 'start: "x"'}, "guided_grammar", SO(grammar='start: "x"')),
    ({"structured_outputs": {"json": SCHEMA, "disable_fallback": True, "unknown": 1}},
     "structured_outputs", SO(json=SCHEMA, disable_fallback=True)),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": "[ ]?"}, "guided_json",
     SO(json=SCHEMA, whitespace_pattern="[ ]?")),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f="], "structures": [
        {"begin": "<f=a>", "schema": SCHEMA, "end": "</f>"}]}}, "response_format",
     SO(structural_tag=json.dumps({"structures": [{"begin": "<f=a>", "schema": SCHEMA,
                                                   "end": "</f>"}], "triggers": ["<f="]}))),
])
def test_request_fields_make_one_constraint(body, field, expected):
    for req in (_chat(**body), CompletionRequest.model_validate({"prompt": "x", **body})):
        so, got_field = req.structured_outputs_params()
        assert (so, got_field) == (expected, field)
        assert req.sampling_params(16, {}, so).structured_outputs == expected


@pytest.mark.parametrize("body,field", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"disable_any_whitespace": False}}, "structured_outputs"),
    ({"response_format": {"type": "structural_tag", "format": {}}}, "response_format"),
])
def test_bad_constraint_fields_name_the_field(body, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        _chat(**body).structured_outputs_params()


@pytest.mark.parametrize("so,kind", [
    (SO(json={"type": "nope"}), "json"), (SO(json="{not json"), "json"),
    (SO(json="[1, 2]"), "json"), (SO(regex="[a-"), "regex"),
    (SO(grammar="start: missing_rule"), "grammar"),
])
def test_compile_errors_name_the_kind(tokenizer, manager, so, kind):
    with pytest.raises(ValueError, match=f"^{kind}: "):
        manager.grammar_init(so)


def _accepts(tokenizer, manager, so: SO, text: str) -> bool:
    """Whether the constraint's matcher takes ``text`` whole (tokenized as the model would)."""
    m = manager.grammar_init(so)
    return m.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and not m.is_error()


def test_json_options_as_vllm(tokenizer, manager):
    """vLLM's options of a JSON constraint: compact JSON by default, any whitespace with
    disable_any_whitespace false, a whitespace_pattern, disable_additional_properties closing
    the objects that list properties (folded into the schema, idempotently)."""
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [({}, '{"a":1}', True), ({}, '{ "a": 1}', False),
             ({"disable_any_whitespace": False}, '{\n  "a": 1\n}', True),
             ({"whitespace_pattern": "[ ]?"}, '{ "a": 1}', True),
             ({"whitespace_pattern": "[ ]?"}, '{\n"a":1}', False),
             ({}, '{"a":1,"b":2}', True), ({"disable_additional_properties": True}, '{"a":1,"b":2}', False),
             ({"disable_any_whitespace": False}, '{ }', False)]
    for options, text, ok in cases:
        assert _accepts(tokenizer, manager, SO(json=open_schema, **options), text) == ok, (options, text)
    assert _accepts(tokenizer, manager, SO(json_object=True, disable_any_whitespace=False), '{ }')
    folded = SO(json=open_schema, disable_additional_properties=True, whitespace_pattern=" ")
    assert folded.json["additionalProperties"] is False and "additionalProperties" not in open_schema
    import msgspec
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(folded), type=SO) == folded


def test_structural_tag_as_vllm(tokenizer, manager):
    """Free text around tags; after a trigger, the tag's begin, JSON of its schema, its end."""
    tag = json.dumps({"triggers": ["<function="], "structures": [
        {"begin": "<function=add>", "schema": SCHEMA, "end": "</function>"},
        {"begin": "<function=now>", "schema": None, "end": "</function>"}]})
    so = SO(structural_tag=tag)
    assert _accepts(tokenizer, manager, so, 'Sure. <function=add>{"a":3}</function> Done.')
    assert _accepts(tokenizer, manager, so, "No call at all.")
    assert not _accepts(tokenizer, manager, so, '<function=add>{"a":30}</function>')
    assert not _accepts(tokenizer, manager, so, "<function=sub>")
    for bad, why in [('{"format": {}}', "format"), ('{"structures": [], "triggers": ["<"]}',
                                                     "structures"),
                     ('{"structures": [{"begin": "<x>", "end": ""}], "triggers": ["<f"]}',
                      "none of the triggers"), ("[1]", "JSON object")]:
        with pytest.raises(ValueError, match=f"^structural_tag: .*{why}"):
            manager.grammar_init(SO(structural_tag=bad))


def _allowed(row: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])


def test_manager_caches_grammars_and_fills_masks(tokenizer, manager):
    """One compile per spec, a matcher per sequence; the masks follow each matcher, a
    complete grammar allows only EOS."""
    a, b = manager.grammar_init(SO(choice=["yes", "no"])), manager.grammar_init(SO(choice=["yes", "no"]))
    assert len([k for k in manager._compiled if k[0] == "choice"]) == 1 and a is not b
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert all(a.consume_token(t) for t in yes)
    mask = manager.grammar_bitmask([a, b])
    assert mask.shape == (2, 49152 // 32) and mask.dtype == np.int32
    assert list(_allowed(mask[0], 49152)) == [tokenizer.eos_token_id]
    first = set(_allowed(mask[1], 49152))
    assert yes[0] in first and tokenizer.eos_token_id not in first


def test_manager_rows_after_each_draft(tokenizer, manager):
    """With drafts, a matcher's rows are the tokens it allows next, then after each draft in
    turn while it accepts them; the rows after a draft it rejects allow every token; the
    matcher itself is not advanced."""
    g = manager.grammar_init(SO(regex="(cat|dog)s are (nice|bad)"))
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    plain = manager.grammar_init(SO(choice=["yes", "no"]))
    cats, bad = [*ids("cat"), *ids("s are")], [*ids("cat"), *ids("mouse"), *ids(" are")]
    mask = manager.grammar_bitmask([g, plain, g.deep_copy()], [cats, [], bad])
    assert mask.shape == (1 + len(cats) + 1 + 1 + len(bad), 49152 // 32)
    rows = [set(_allowed(row, 49152)) for row in mask]
    assert cats[0] in rows[0] and ids("dog")[0] in rows[0]
    for j, draft in enumerate(cats):  # row j allows draft j (it is accepted)
        assert draft in rows[j] and len(rows[j]) < 100
    assert ids(" nice")[0] in rows[len(cats)]
    assert ids("yes")[0] in rows[len(cats) + 1]
    b = len(cats) + 2
    assert ids("mouse")[0] not in rows[b + 1]  # rejected after "cat": later rows allow all
    assert all(len(r) == 49152 for r in rows[b + 2 :])
    assert manager.grammar_bitmask([g]).tolist() == mask[:1].tolist()  # g not advanced


def test_scheduler_rows_allowed_token_ids_and_a_grammar_after_the_reasoning(tokenizer, manager):
    """The scheduler's bitmask rows: a request's ``allowed_token_ids`` row (token_bitmask) holds
    exactly those tokens; a grammar whose request starts in the model's reasoning allows every
    token until the token that ends the reasoning is drawn, and constrains from the next."""
    from jaxserve.core.kv_cache_manager import KVCacheManager
    from jaxserve.core.request import Request
    from jaxserve.core.scheduler import Scheduler
    from jaxserve.core.scheduler_output import ModelRunnerOutput
    from jaxserve.engine import EngineCoreRequest
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.structured_output.manager import token_bitmask

    vocab, end, eos = 49152, 100, tokenizer.eos_token_id  # end: the reasoning's end token
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64,
                      max_model_len=128, eos_token_ids=(eos,), structured_output_manager=manager)
    so = SO(choice=["yes", "no"])
    sched.add_request(Request(EngineCoreRequest(
        "g", [1, 2, 3], SamplingParams(max_tokens=10, structured_outputs=so), end), seed=0,
        grammar=manager.grammar_init(so)))
    allowed = [5, 7, 40000, eos]
    sched.add_request(Request(EngineCoreRequest(
        "a", [1, 2], SamplingParams(max_tokens=10, allowed_token_ids=allowed)), seed=0,
        allowed_bitmask=token_bitmask(allowed, vocab)))

    def step(tokens: dict) -> dict:
        out = sched.schedule()
        sched.grammar_bitmask(out)
        rows = {rid: list(_allowed(row, vocab))
                for rid, row in zip(out.structured_output_request_ids, out.grammar_bitmask)}
        sched.update(out, ModelRunnerOutput(tokens, {}, {}))
        return rows

    yes = tokenizer.encode("yes", add_special_tokens=False)
    for token in (42, end):  # reasoning, then its end: every token allowed
        rows = step({"g": token, "a": 5})
        assert len(rows["g"]) == vocab and rows["a"] == sorted(allowed)
    rows = step({"g": yes[0], "a": 7})
    assert yes[0] in rows["g"] and eos not in rows["g"] and len(rows["g"]) < 100


def test_borrowed_tokenizer_without_the_models_eos(tokenizer):
    """A dummy Llama-3.1 (128,256 logits, EOS 128001) with the default model's tokenizer: the
    manager starts, and a complete grammar allows the tokenizer's EOS."""
    from jaxserve.structured_output.manager import StructuredOutputManager

    m = StructuredOutputManager(TokenizerVocab.of(tokenizer), 128256, [128001, 128009])
    g = m.grammar_init(SO(choice=["yes"]))
    assert all(g.consume_token(t) for t in tokenizer.encode("yes", add_special_tokens=False))
    assert list(_allowed(m.grammar_bitmask([g])[0], 128256)) == [tokenizer.eos_token_id]


def test_bounded_string_masks_walk_fewer_tokens(tokenizer, manager):
    """A string with a maxLength and 20 characters left: llguidance's own slices (1-10 and
    1-30 characters) leave every token of 11-30 characters to a trie walk, ours (grammar.SLICES)
    only those of 16-30 characters; the allowed tokens are the same."""
    import json as _json

    import llguidance
    import llguidance.hf

    from jaxserve.structured_output.grammar import grammar_text, limits

    text = grammar_text(SO(json={"type": "object", "properties": {"s": {
        "type": "string", "maxLength": 24}}, "required": ["s"], "additionalProperties": False}))
    prefix = '{"s":"abcd'

    def walk(lt):
        it = llguidance.LLInterpreter(lt, text, enable_backtrack=False, enable_ff_tokens=False,
                                      log_level=0, limits=limits())
        it.start_without_prompt()
        nodes = 0
        for t in [*lt.tokenize_str(prefix), None]:
            mask, info = it.compute_mask()
            nodes += sum(p["stats"]["trie_nodes_walked"] for p in _json.loads(info)["progress"]
                         if "stats" in p)
            if t is not None:
                it.commit_token(t)
        return mask, nodes

    default = llguidance.hf.from_tokenizer(tokenizer, n_vocab=49152,
                                           eos_token=[tokenizer.eos_token_id])
    ours_mask, ours = walk(manager.ll_tokenizer)
    default_mask, theirs = walk(default)
    assert ours_mask == default_mask
    assert ours < theirs / 2, (ours, theirs)


def test_validator_caches_and_limits_time(tokenizer):
    from jaxserve.structured_output.validator import GrammarValidator

    async def run():
        v = GrammarValidator(tokenizer, 49152, [tokenizer.eos_token_id])
        await v.check(SO(json=SCHEMA))
        with pytest.raises(ValueError, match="^regex: "):
            await v.check(SO(regex="(a"))
        assert sorted(v._verdicts.values()) == ["", v._verdicts[next(
            k for k in v._verdicts if k[0] == "regex")]]
        v.timeout_s = 0.0  # every compile is now "too slow", cached or not
        with pytest.raises(ValueError, match="did not compile within"):
            await v.check(SO(regex="b+"))
        await v.check(SO(json=SCHEMA))  # cached verdicts stand
        v.shutdown()

    asyncio.run(run())


def test_sampler_mask_only_allowed_tokens_and_masked_logprobs():
    """A constrained row draws among its allowed tokens alone, greedy or sampled; the other
    rows are untouched; log-probabilities are those of the masked logits (vLLM V1)."""
    s, vocab = 3, 70  # 3 words per row; bits past V are ignored
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(s, vocab)), jnp.float32)
    bitmask = np.zeros((s, 3), np.int32)
    bitmask[0, 1] = 1 << 3  # token 35 only
    bitmask[1, 0] = 0b1010  # tokens 1 and 3
    bitmask[1, 2] = -1  # tokens 64..69 (and 70..95, past V)
    bitmask[2] = -1
    structured = np.array([True, True, False])
    masked = apply_grammar_bitmask(logits, jnp.asarray(bitmask), jnp.asarray(structured))
    assert np.isfinite(np.asarray(masked[0])).sum() == 1
    assert set(np.flatnonzero(np.isfinite(np.asarray(masked[1])))) == {1, 3, *range(64, 70)}
    assert np.array_equal(masked[2], logits[2])
    from tests.unit.test_sampler import fmeta

    for temperature in (0.0, 1.0):
        sm = SamplingMetadata(temperature=np.full(s, temperature, np.float32),
                              top_k=np.zeros(s, np.int32), top_p=np.ones(s, np.float32),
                              seeds=np.arange(s, dtype=np.uint32), steps=np.zeros(s, np.int32))
        fm = fmeta(s, structured=structured, logprobs=np.ones(s, bool))
        for seed in range(5):
            sm = SamplingMetadata(sm.temperature, sm.top_k, sm.top_p,
                                  np.full(s, seed, np.uint32), sm.steps)
            tokens, _, lp = sample_filtered(logits, jnp.zeros(s, jnp.int32), sm, fm, None,
                                            jnp.asarray(bitmask))
            assert int(tokens[0]) == 35 and int(tokens[1]) in {1, 3, *range(64, 70)}
            assert abs(float(lp.token_logprobs[0])) < 1e-6  # the only allowed token


def test_schema_depth_follows_refs_once():
    from jaxserve.structured_output.grammar import MAX_SCHEMA_DEPTH, schema_depth
    from tests.grammar_bombs import ref_chain

    assert schema_depth(SCHEMA) == 3  # the schema, its properties, "a"
    tree = {"$defs": {"n": {"type": "object", "properties": {"kids": {
        "type": "array", "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"}
    assert schema_depth(tree) < 20  # recursion counts once
    assert schema_depth(ref_chain(1500)) == MAX_SCHEMA_DEPTH + 1
    # a chain of definitions that each name the next twice: 2^40 paths, measured once each
    dag = ref_chain(40, lambda r: {"anyOf": [r, dict(r)]})
    assert 3 * 40 < schema_depth(dag) <= 3 * 40 + 3


def test_grammar_bombs_compile_or_fail_without_crashing_the_process():
    """Each bomb in a child process (a native stack overflow kills the process, not a test):
    the Lark chains compile and give masks on the calling thread, the $ref chains are
    ValueErrors naming the depth limit."""
    import subprocess
    import sys

    child = """
import llguidance, llguidance.numpy as lln
from jaxserve.model_loader.loader import load_tokenizer_of
from jaxserve.sampling_params import StructuredOutputsParams as SO
from jaxserve.tokenizer_io import TokenizerVocab
from jaxserve.structured_output.grammar import build_ll_tokenizer, compile_matcher
from jaxserve.tokenizer_io import TokenizerVocab
from tests.grammar_bombs import lark_bombs, schema_bombs
llt = build_ll_tokenizer(TokenizerVocab.of(load_tokenizer_of(None)), 49152, [2])
mask = lln.allocate_token_bitmask(1, llt.vocab_size)
for g in lark_bombs():
    m = compile_matcher(llt, SO(grammar=g))
    lln.fill_next_token_bitmask_par(llguidance.LLExecutor(), [(m, 0)], mask)
    assert mask.any() and not m.is_error()
for s in schema_bombs():
    try:
        compile_matcher(llt, SO(json=s))
        raise AssertionError("a $ref chain compiled")
    except ValueError as e:
        assert "levels deep" in str(e), e
print("survived")
"""
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                       timeout=600, cwd=__import__("pathlib").Path(__file__).parents[2])
    assert r.returncode == 0 and "survived" in r.stdout, (r.returncode, r.stderr[-2000:])
