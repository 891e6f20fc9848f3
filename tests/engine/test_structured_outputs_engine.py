"""Structured outputs in the offline engine (default model): constrained sequences stay valid
through preemption (recompute replays tokens the matcher has consumed), each choice of an
``n`` request has its own matcher, async and synchronous scheduling both keep every output
valid, min_tokens gives way to a complete grammar, and a constraint that does not compile fails
before any work."""

import json

import jsonschema
import msgspec
import pytest

from jaxserve import SamplingParams, StructuredOutputsParams
from jaxserve.engine import EngineCoreRequest

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 30},
    "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}},
    "score": {"type": "integer", "minimum": 0, "maximum": 10}},
    "required": ["title", "tags", "score"], "additionalProperties": False}


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_constrained_outputs_survive_preemption(smollm_llm):
    """16 constrained requests in a pool squeezed to 40 free pages: requests are preempted and
    recomputed, and every output still ends with "stop" and validates."""
    engine = smollm_llm.engine
    pool = engine.scheduler.kv.block_pool
    before = engine.get_stats().num_preemptions_total
    ballast = pool.allocate(pool.num_free_pages - 40)
    try:
        sp = [SamplingParams(max_tokens=120, temperature=0.8, seed=i, structured_outputs=
                             StructuredOutputsParams(json=SCHEMA)) for i in range(16)]
        convs = [[{"role": "user", "content": f"Invent a blog post number {i} as JSON. " * 4}]
                 for i in range(16)]
        outs = smollm_llm.chat(convs, sp, use_tqdm=False)
    finally:
        pool.free(ballast)
    assert engine.get_stats().num_preemptions_total > before
    for o in outs:
        assert o.outputs[0].finish_reason == "stop" and _valid(o.outputs[0].text), o.outputs[0]


def test_n_choices_each_constrained_under_async_scheduling(smollm_llm):
    """A constrained n=4 request added while an unconstrained one is in flight: steps stay
    in flight (async scheduling) with the constrained rows' bitmasks filled after the previous
    step's update; the choices are each valid, the unconstrained one unaffected."""
    engine = smollm_llm.engine
    assert engine.config.async_scheduling
    tok = smollm_llm.tokenizer
    prompt = tok.encode("Write a story about a cat.")
    engine.add_request(EngineCoreRequest("plain", prompt, SamplingParams(max_tokens=20,
                                                                          temperature=0)))
    engine.step()
    engine.add_request(EngineCoreRequest("so", prompt, SamplingParams(
        n=4, max_tokens=120, temperature=1.0, seed=3,
        structured_outputs=StructuredOutputsParams(json=SCHEMA))))
    tokens, finish, overlapped = {}, {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            finish[o.request_id] = o.finish_reason
        inflight = engine._in_flight
        overlapped += bool(inflight and inflight[0].structured_output_request_ids)
    assert overlapped > 10
    for i in range(4):
        rid = f"{i}_so"
        assert finish[rid] == "stop" and _valid(tok.decode(tokens[rid][:-1])), tok.decode(tokens[rid])
    alone = smollm_llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0),
                                use_tqdm=False)[0].outputs[0].token_ids
    assert tokens["plain"] == alone


def test_synchronous_steps_give_valid_outputs(smollm_llm):
    """The same constraint with async scheduling off (the bitmask filled before dispatch)."""
    engine = smollm_llm.engine
    engine.config = msgspec.structs.replace(engine.config, async_scheduling=False)
    try:
        outs = smollm_llm.chat([[{"role": "user", "content": "A blog post as JSON."}]] * 3,
                               [SamplingParams(max_tokens=120, temperature=1.0, seed=i,
                                               structured_outputs=StructuredOutputsParams(
                                                   json=SCHEMA)) for i in range(3)],
                               use_tqdm=False)
    finally:
        engine.config = msgspec.structs.replace(engine.config, async_scheduling=True)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop" and _valid(o.outputs[0].text), o.outputs[0]


def test_min_tokens_gives_way_to_a_complete_grammar(smollm_llm):
    """min_tokens past the grammar's end: the output stops where the grammar does (EOS, "stop"),
    greedy and sampled; where the grammar can go on, min_tokens still holds EOS back."""
    eos = smollm_llm.tokenizer.eos_token_id
    choice = StructuredOutputsParams(choice=["yes", "no"])
    sps = [SamplingParams(max_tokens=30, min_tokens=10, temperature=t, seed=1,
                          structured_outputs=choice) for t in (0.0, 1.0)]
    sps.append(SamplingParams(max_tokens=30, min_tokens=10, temperature=0, structured_outputs=
                              StructuredOutputsParams(regex="[0-9]+")))
    outs = smollm_llm.generate(["Is Paris in France? Answer:"] * 3, sps, use_tqdm=False)
    for o in outs[:2]:
        c = o.outputs[0]
        assert c.text in ("yes", "no") and c.finish_reason == "stop", c
        assert c.token_ids[-1] == eos and len(c.token_ids) < 10, c
    digits = outs[2].outputs[0]
    assert digits.text.isdigit() and len(digits.token_ids) >= 10, digits


@pytest.mark.parametrize("so", [StructuredOutputsParams(regex="(a"),
                                StructuredOutputsParams(grammar="start: nothing_here")])
def test_bad_constraint_fails_before_any_work(smollm_llm, so):
    with pytest.raises(ValueError, match=r"^prompt 1: (regex|grammar): "):
        smollm_llm.generate(["a", "b"], [SamplingParams(max_tokens=2),
                                         SamplingParams(max_tokens=2, structured_outputs=so)],
                            use_tqdm=False)
    assert not smollm_llm.engine.scheduler.has_unfinished_requests()  # nothing was added


def test_grammar_bombs_in_the_offline_engine(smollm_llm):
    """A 1,500-deep $ref chain is a ValueError before any work; a 3,000-rule Lark chain (valid)
    compiles and is met; the engine serves on."""
    from tests.grammar_bombs import ref_chain, rule_chain

    with pytest.raises(ValueError, match="levels deep"):
        smollm_llm.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs=
                                                   StructuredOutputsParams(json=ref_chain(1500))),
                            use_tqdm=False)
    out = smollm_llm.generate(["hi"], SamplingParams(max_tokens=8, structured_outputs=
                                                     StructuredOutputsParams(
                                                         grammar=rule_chain(3000, ' "0"'))),
                              use_tqdm=False)[0].outputs[0]
    assert out.text.startswith("x") and set(out.text) <= {"x", "0"}, out.text


def test_a_grammar_that_fails_while_generating_ends_with_error(smollm_llm, caplog):
    """The matcher fails after the first token: the choice ends with finish_reason "error"
    (not a "stop" whose text breaks the grammar), the message is logged, and the request
    beside it is unaffected."""
    from tests.grammar_bombs import wide_choice_grammar

    sps = [SamplingParams(max_tokens=8, temperature=0, structured_outputs=
                          StructuredOutputsParams(grammar=wide_choice_grammar())),
           SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)]
    with caplog.at_level("WARNING", logger="jaxserve.engine"):
        failed, other = smollm_llm.generate(["Pick one.", "Count: 1, 2,"], sps, use_tqdm=False)
    c = failed.outputs[0]
    assert c.finish_reason == "error" and c.text == "[", c
    assert "max is 2000" in caplog.text and "failed during generation" in caplog.text
    assert other.outputs[0].finish_reason == "length" and len(other.outputs[0].token_ids) == 8
    assert not smollm_llm.engine.scheduler.has_unfinished_requests()
