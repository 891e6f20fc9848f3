"""n-gram speculative decoding in the offline engine (docs/spec_decode.md) on the default model:
greedy outputs equal the plain engine's up to the near-tie rule (docs/architecture.md, "Testing
numerics"), on input-grounded requests where drafts are accepted, under chunked prefill,
prefix caching and preemption (the engine's pool is too small for its batch), with async
scheduling kept (a sequence gets drafts while its step that verified drafts is in flight); seeded
sampled outputs (top-p, penalties, n=2) equal the plain engine's, since each verified row draws
with the key of its output position; logprobs, stop token ids and max_tokens hold."""

import pytest

from jaxserve.sampling_params import SamplingParams
from tests.greedy import compare_greedy
from tests.spec_engine import SPEC_CONFIG, SPEC_ENGINE, spec_prompts, top2_margin

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def spec_llm():
    from jaxserve import LLM

    return LLM(log=lambda s: None, speculative_config=SPEC_CONFIG, **SPEC_ENGINE)


def chats(prompts):
    return [[{"role": "user", "content": p}] for p in prompts]


def test_greedy_equals_plain_engine(spec_llm, smollm_llm):
    prompts = chats(spec_prompts()[::3])  # repeat, correct and summarise requests
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2)
    ref = smollm_llm.chat(prompts, sp, use_tqdm=False)
    before = spec_llm.engine.scheduler.num_preemptions
    ours = spec_llm.chat(prompts, sp, use_tqdm=False)
    stats = spec_llm.engine.get_stats().spec_decoding
    assert stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens > 0
    assert spec_llm.engine.scheduler.num_preemptions > before  # the batch preempted
    full = 0
    for r, o in zip(ref, ours):
        a, b = r.outputs[0], o.outputs[0]
        margins = [top2_margin(p) for p in a.logprobs]
        same, n = compare_greedy(b.token_ids, a.token_ids, margins)
        assert same, (n, a.token_ids, b.token_ids)
        full += n == len(a.token_ids)
        for i in range(n):  # logprobs of the emitted tokens, accepted drafts' included
            tok = b.token_ids[i]
            assert abs(b.logprobs[i][tok].logprob - a.logprobs[i][tok].logprob) < 1e-2
    assert full >= len(ref) - 1, "most comparisons ran to the end without a near-tie"


def test_seeded_sampling_equals_plain_engine(spec_llm, smollm_llm):
    prompts = chats(spec_prompts()[:2])
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, presence_penalty=0.3,
                        frequency_penalty=0.1, n=2, seed=7, max_tokens=MAX_TOKENS)
    ref = smollm_llm.chat(prompts, sp, use_tqdm=False)
    ours = spec_llm.chat(prompts, sp, use_tqdm=False)
    for r, o in zip(ref, ours):
        assert [c.token_ids for c in o.outputs] == [c.token_ids for c in r.outputs]


def test_stop_token_and_max_tokens_cut_accepted_drafts(spec_llm, smollm_llm):
    prompt = chats(spec_prompts()[:1])
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    tokens = smollm_llm.chat(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop = next(t for i, t in enumerate(tokens) if i >= 8 and t not in tokens[:i])
    cut = tokens[: tokens.index(stop) + 1]
    before = spec_llm.engine.get_stats().spec_decoding.num_accepted_tokens
    out = spec_llm.chat(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                               stop_token_ids=[stop]), use_tqdm=False)
    assert out[0].outputs[0].token_ids == cut
    assert out[0].outputs[0].finish_reason == "stop"
    for n in (1, 3, 6):
        out = spec_llm.chat(prompt, SamplingParams(temperature=0, max_tokens=n),
                            use_tqdm=False)[0].outputs[0]
        assert out.token_ids == tokens[:n] and out.finish_reason == "length"
    assert spec_llm.engine.get_stats().spec_decoding.num_accepted_tokens > before


def test_drafts_are_scheduled_past_a_verify_step_in_flight(spec_llm, smollm_llm):
    """Async scheduling holds with n-gram drafts: the engine schedules a sequence's next drafts
    before the tokens of its step that verified drafts are known (the step settles them)."""
    scheduler = spec_llm.engine.scheduler
    past_in_flight = []

    def schedule(schedule=scheduler.schedule):
        in_flight = {rid: r.num_output_placeholders for rid, r in scheduler.requests.items()}
        out = schedule()
        past_in_flight.extend(in_flight.get(rid, 0) > 1
                              for rid in out.scheduled_spec_decode_tokens)
        return out

    scheduler.schedule = schedule
    prompt = chats(spec_prompts()[:1])
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    try:
        out = spec_llm.chat(prompt, greedy, use_tqdm=False)
    finally:
        del scheduler.schedule
    assert sum(past_in_flight) > len(past_in_flight) // 2
    assert out[0].outputs[0].token_ids == smollm_llm.chat(
        prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids


def test_a_constrained_request_beside_speculating_ones(spec_llm, smollm_llm):
    """A constrained sequence shares steps with sequences that verify drafts (async: its
    bitmask is filled while the step runs, its filter reads the step's drafts): its output is
    in its language, the others' equal the plain engine's."""
    import re

    from jaxserve.sampling_params import StructuredOutputsParams

    prompts = chats(spec_prompts()[:2])
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2)
    constrained = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=
                                 StructuredOutputsParams(regex=r"[a-z]+( [a-z]+){2,5}\."))
    ref = smollm_llm.chat(prompts, greedy, use_tqdm=False)
    before = spec_llm.engine.get_stats().spec_decoding.num_drafts
    out = spec_llm.chat([*prompts, chats(["Describe the sea."])[0]],
                        [greedy, greedy, constrained], use_tqdm=False)
    for r, o in zip(ref, out):
        a = r.outputs[0]
        same, n = compare_greedy(o.outputs[0].token_ids, a.token_ids,
                                 [top2_margin(p) for p in a.logprobs])
        assert same, (n, a.token_ids, o.outputs[0].token_ids)
    assert re.fullmatch(r"[a-z]+( [a-z]+){2,5}\.", out[2].outputs[0].text)
    assert spec_llm.engine.get_stats().spec_decoding.num_drafts > before


def test_constrained_sequences_verify_drafts_against_their_grammar(spec_llm, smollm_llm):
    """Constrained sequences speculate too: each of a sequence's draft rows is masked by its
    grammar after the drafts before it. Here the n-gram drafts keep offering "cat" where the
    grammar's last line has "dog": masked, that draft is rejected and the grammar holds (with
    the draft rows unmasked the model takes "cat" and the output leaves the language). A
    looser language alongside: greedy outputs equal the plain engine's, and drafts were
    verified and accepted."""
    import re

    from jaxserve.sampling_params import StructuredOutputsParams

    lines = r"(the cat sat on the mat\. ){4}the dog sat on the mat\."
    prompts = chats(["Repeat this line five times: the cat sat on the mat.",
                     spec_prompts()[0]])
    params = [SamplingParams(temperature=0, max_tokens=60, logprobs=2,
                             structured_outputs=StructuredOutputsParams(regex=rx))
              for rx in (lines, r"[A-Za-z0-9 ,.;:'()\n-]{1,300}")]
    ref = smollm_llm.chat(prompts, params, use_tqdm=False)
    before = spec_llm.engine.get_stats().spec_decoding
    before = (before.num_drafts, before.num_accepted_tokens)
    out = spec_llm.chat(prompts, params, use_tqdm=False)
    after = spec_llm.engine.get_stats().spec_decoding
    assert re.fullmatch(lines, out[0].outputs[0].text), out[0].outputs[0].text
    for r, o in zip(ref, out):
        a = r.outputs[0]
        same, n = compare_greedy(o.outputs[0].token_ids, a.token_ids,
                                 [top2_margin(p) for p in a.logprobs])
        assert same, (n, a.text, o.outputs[0].text)
    assert after.num_drafts > before[0] and after.num_accepted_tokens > before[1]


def test_start_up_checks_the_fields_that_must_agree_with_the_flags():
    """``LLM`` has no argument parsing: the engine checks vLLM's max_model_len against the
    resolved --max-model-len before it compiles anything."""
    from jaxserve import LLM

    with pytest.raises(ValueError, match=r"^--speculative-config: max_model_len must be "
                                         r"--max-model-len \(256\) or null"):
        LLM(log=lambda s: None, speculative_config={**SPEC_CONFIG, "max_model_len": 512},
            **SPEC_ENGINE)
