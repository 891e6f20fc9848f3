"""jaxserve.LLM as vLLM's users call it: prompt dicts, an interrupted generate, stop_reason."""

import numpy as np
import pytest

from jaxserve.exceptions import ValidationError
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def test_prompt_dicts_equal_text_and_token_ids(smollm_llm):
    """vLLM's TextPrompt / TokensPrompt dicts give what the text and its ids give."""
    text = "The capital of France is"
    ids = smollm_llm.get_tokenizer().encode(text)
    outs = smollm_llm.generate([text, {"prompt": text}, {"prompt_token_ids": ids}, ids], GREEDY,
                               use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert outs[1].prompt == text and outs[2].prompt_token_ids == ids
    single = smollm_llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.parametrize("prompts", [5, [3.5], [{"text": "x"}], [{"prompt": "x", "seed": 1}],
                                     [{"prompt": 7}], [["a", "b"]]])
def test_other_prompt_types_are_a_type_error(smollm_llm, prompts):
    with pytest.raises(TypeError, match="prompt"):
        smollm_llm.generate(prompts, GREEDY, use_tqdm=False)


def test_an_interrupted_generate_leaves_no_request_behind(smollm_llm, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) in the middle of generate aborts its requests: the next
    generate runs as if it had not happened."""
    prompts = ["Tell me a story about a dragon.", "List three colours."]
    params = SamplingParams(temperature=0, max_tokens=12)
    before = smollm_llm.generate(prompts, params, use_tqdm=False)
    engine, step, calls = smollm_llm.engine, smollm_llm.engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        smollm_llm.generate(prompts * 4, SamplingParams(max_tokens=200, ignore_eos=True),
                            use_tqdm=False)
    monkeypatch.undo()
    assert not engine.scheduler.has_unfinished_requests()
    after = smollm_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
    assert not smollm_llm.output_processor.requests


def test_stop_reason_is_the_stop_token_not_eos(smollm_llm):
    """vLLM's stop_reason: the stop_token_ids entry that ended a choice, None at EOS."""
    chat = [{"role": "user", "content": "Say hello."}]
    out = smollm_llm.chat(chat, SamplingParams(temperature=0, max_tokens=200),
                          use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in smollm_llm.engine.eos_token_ids
    assert out.stop_reason is None
    second = out.token_ids[1]
    assert second != out.token_ids[0]
    stopped = smollm_llm.chat(chat, SamplingParams(temperature=0, max_tokens=200,
                                                   stop_token_ids=[second]),
                              use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == second
    assert stopped.token_ids == out.token_ids[:2]


def test_sampling_params_clone_is_deep():
    """vLLM's SamplingParams.clone: an equal copy whose lists and dicts are its own."""
    a = SamplingParams(n=2, temperature=0.5, stop=["x"], logit_bias={3: 1.0},
                       structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    b = a.clone()
    assert b == a and b is not a
    b.stop.append("y")
    b.logit_bias[4] = 2.0
    b.structured_outputs.json["type"] = "array"
    assert a.stop == ["x"] and a.logit_bias == {3: 1.0}
    assert a.structured_outputs.json == {"type": "object"}


def test_every_bit_of_a_64_bit_seed_counts(smollm_llm):
    """OpenAI and vLLM take any 64-bit seed: -1 is a seed like any other (reproducible), and
    seeds that differ only above bit 31 draw differently."""
    def tokens(seed):
        sp = SamplingParams(temperature=1.5, max_tokens=12, seed=seed)
        return smollm_llm.generate("Tell me a story.", sp, use_tqdm=False)[0].outputs[0].token_ids

    assert tokens(-1) == tokens(-1)
    assert len(tokens(-(2**63))) == 12
    outs = {tuple(tokens(s)) for s in (1, 2**32 + 1, 2**40 + 1, -(2**32) + 1)}
    assert len(outs) == 4


def test_numpy_integers_sample_as_the_ints_they_are(smollm_llm):
    """A seed or max_tokens drawn with numpy is stored as a Python int: same tokens."""
    def tokens(seed, max_tokens):
        sp = SamplingParams(temperature=1, seed=seed, max_tokens=max_tokens)
        return smollm_llm.generate("Hi", sp, use_tqdm=False)[0].outputs[0].token_ids

    assert tokens(np.int64(5), np.int64(3)) == tokens(5, 3)


@pytest.mark.parametrize("field,value", [("n", 0), ("max_tokens", -5), ("seed", 1.5)])
def test_sampling_params_changed_after_construction_are_checked_again(smollm_llm, field, value):
    sp = SamplingParams(temperature=0, max_tokens=3)
    setattr(sp, field, value)
    with pytest.raises(ValidationError) as e:
        smollm_llm.generate(["Hi", "Hello"], sp, use_tqdm=False)
    assert e.value.parameter == field and str(e.value).startswith("prompt 0: ")
    assert not smollm_llm.engine.scheduler.has_unfinished_requests()


@pytest.mark.parametrize("params", [{"temperature": 0}, "greedy", [GREEDY, {"temperature": 0}]])
def test_sampling_params_of_another_type_are_a_type_error(smollm_llm, params):
    with pytest.raises(TypeError, match="^sampling_params: expected a SamplingParams"):
        smollm_llm.generate(["Hi", "Hello"], params, use_tqdm=False)


def test_structured_outputs_as_a_dict_of_its_fields(smollm_llm):
    """vLLM's HTTP ``structured_outputs`` shape: converted to StructuredOutputsParams."""
    sp = SamplingParams(temperature=0, max_tokens=5, structured_outputs={"choice": ["yes", "no"]})
    assert sp.structured_outputs == StructuredOutputsParams(choice=["yes", "no"])
    (out,) = smollm_llm.generate("Is the sky blue?", sp, use_tqdm=False)
    assert out.outputs[0].text in ("yes", "no")
    for bad, match in [({"choise": ["a"]}, "unknown field 'choise'"),
                       ({"choice": "ab"}, "Expected `array"), ("json", "got str")]:
        with pytest.raises(ValidationError, match=match) as e:
            SamplingParams(structured_outputs=bad)
        assert e.value.parameter == "structured_outputs"


def test_chat_reads_messages_as_the_server_does(smollm_llm):
    """OpenAI's content parts and the developer role, as /v1/chat/completions takes them
    (protocol.parse_messages): the same prompt as plain text and the system role."""
    plain = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "What is 2+2?"}]
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be "},
                                               {"type": "text", "text": "brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}]
    a, b = smollm_llm.chat([plain, parts], SamplingParams(temperature=0, max_tokens=2),
                           use_tqdm=False)
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValidationError, match=r"^prompt 1: messages\.0\.content\.0: images") as e:
        smollm_llm.chat([plain, image], GREEDY, use_tqdm=False)
    assert e.value.parameter == "messages"


@pytest.mark.parametrize("messages", ["Hello", [["user", "hi"]], 5, [{"role": "user"}, "hi"]])
def test_chat_messages_of_another_shape_are_a_type_error(smollm_llm, messages):
    with pytest.raises(TypeError, match="^messages: expected a conversation"):
        smollm_llm.chat(messages, GREEDY, use_tqdm=False)


def test_text_too_long_to_fit_is_refused_before_it_is_tokenized(smollm_llm, monkeypatch):
    """The server's byte-size bound (InputProcessor.check_text_size), offline too."""
    ip = smollm_llm.input_processor
    text = "a" * (ip.max_text_bytes + 1)

    def never(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(ip, "tokenize_prompt", never)
    monkeypatch.setattr(ip, "tokenize_chat", never)
    with pytest.raises(ValidationError, match=r"^prompt 0: prompt: \d+ bytes of text") as e:
        smollm_llm.generate([text, "Hi"], GREEDY, use_tqdm=False)
    assert e.value.parameter == "prompt"
    with pytest.raises(ValidationError, match=r"^prompt 0: messages: \d+ bytes of text") as e:
        smollm_llm.chat([{"role": "user", "content": text}], GREEDY, use_tqdm=False)
    assert e.value.parameter == "messages"


def test_vllm_prompt_dict_keys_that_carry_nothing_are_taken(smollm_llm):
    ids = smollm_llm.get_tokenizer().encode("The capital of France is")
    outs = smollm_llm.generate(
        [{"prompt_token_ids": ids},
         {"prompt_token_ids": ids, "multi_modal_data": None, "mm_processor_kwargs": {}},
         {"prompt_token_ids": ids, "multi_modal_uuids": {}, "cache_salt": "tenant-1"}],
        GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    with pytest.raises(ValidationError, match="^prompt 1: multi_modal_data: multimodal") as e:
        smollm_llm.generate(["Hi", {"prompt": "Hi", "multi_modal_data": {"image": b"png"}}],
                            GREEDY, use_tqdm=False)
    assert e.value.parameter == "multi_modal_data"
    for salt in (5, ""):
        with pytest.raises(TypeError, match="cache_salt: expected a non-empty string"):
            smollm_llm.generate({"prompt": "Hi", "cache_salt": salt}, GREEDY, use_tqdm=False)


def test_cache_salt_shares_prefix_pages_only_within_the_salt(smollm_llm):
    """vLLM's cache_salt: a prompt is served from the prefix cache only after one with the
    same salt (the salt roots the pages' hash chain)."""
    text = "Count with me: " + " ".join(str(i) for i in range(100, 120))
    one = SamplingParams(temperature=0, max_tokens=1)

    def cached(**salt):
        (out,) = smollm_llm.generate({"prompt": text, **salt}, one, use_tqdm=False)
        return out.num_cached_tokens

    assert cached(cache_salt="a") == 0
    assert cached(cache_salt="b") == 0 and cached() == 0
    assert cached(cache_salt="a") > 0 and cached() > 0


def test_outputs_carry_vllm_s_fields(smollm_llm):
    """cumulative_logprob (the sampled tokens' log-probabilities summed, None without
    logprobs), lora_request (None: the base model), and vLLM V1's metrics / encoder prompt
    fields (None)."""
    sp = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5, logprobs=0)
    (out,) = smollm_llm.generate("Tell me a story.", sp, use_tqdm=False)
    for c in out.outputs:
        expected = sum(pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs))
        assert c.cumulative_logprob == pytest.approx(expected) and c.cumulative_logprob < 0
        assert c.lora_request is None
    assert (out.lora_request, out.metrics, out.encoder_prompt,
            out.encoder_prompt_token_ids) == (None,) * 4
    (plain,) = smollm_llm.generate("Tell me a story.", GREEDY, use_tqdm=False)
    assert plain.outputs[0].cumulative_logprob is None
