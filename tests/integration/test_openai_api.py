"""The API surface over the real server (default model) and the official ``openai`` client:
the sampling set, ``n``, log-probabilities, generation defaults, /tokenize, /detokenize,
models.retrieve, content parts, prompt lists, 400s naming the field, and every body on the wire
valid against OpenAI's OpenAPI schema.

One server for the module, with prefix caching off (the n tests count the prompt tokens an
``n=8`` request computes). The client's HTTP transport (conftest.py's ``transport``) records
every response body as it arrives (whole JSON bodies and each SSE chunk); the last test
validates all of them against the schema objects in tests/data/openai_openapi_subset.yaml. The
tests run in file order.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import openai
import pytest
from server_utils import Server, get

from tests.conftest import SMALL_ENGINE, SMALL_ENGINE_FLAGS
from tests.openai_schema import CHAT, CHAT_CHUNK, COMPLETION, COMPLETION_CHUNK, errors

try:  # the HTTP library the openai client is built on (httpx2 in its 3.x releases)
    import httpx2 as httpx
except ImportError:
    import httpx

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = SMALL_ENGINE["max_model_len"]
PARIS_Q = [{"role": "user", "content": "What is the capital of France?"}]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    srv = Server(*SMALL_ENGINE_FLAGS, "--no-enable-prefix-caching")
    yield srv
    srv.stop()


def _post(server, path, body):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=600)
    return r.status_code, r.json()


# -- generation defaults ------------ ---------------------------------------------------------


def test_defaults_sample_and_answer_paris(server, client):
    """No sampling field but ``seed``: the default model's chat defaults apply (printed at
    start-up, temperature > 0) and the README's question is answered with Paris for at least 9
    of 10 seeds."""
    line = re.search(r"sampling defaults for requests that leave them out: (.*)", server.output())
    assert line, server.output()[-2000:]
    temperature = float(re.search(r"temperature ([0-9.]+)", line.group(1)).group(1))
    assert temperature > 0
    answers = [client.chat.completions.create(model=MODEL, messages=PARIS_Q, seed=seed)
               .choices[0].message.content for seed in range(10)]
    assert sum("Paris" in a for a in answers) >= 9, answers


# -- log-probabilities ------------ ------------------------------------------------------------


def _hf_log_softmax(hf, ids):
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def test_chat_logprobs_equal_hf_and_streaming(client, hf_smollm):
    """Chat ``logprobs`` + ``top_logprobs``: each token's value equals the log-softmax of HF
    transformers' logits (1e-3), the top list is sorted and holds the token when it ranks, and
    the streamed entries equal the non-streamed ones."""
    kw = dict(model=MODEL, messages=PARIS_Q, max_tokens=12, seed=7, temperature=1.0,
              logprobs=True, top_logprobs=5, extra_body={"return_token_ids": True})
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    ids = r.prompt_token_ids + choice.token_ids  # vLLM's: the prompt's at the top level
    ref = _hf_log_softmax(hf_smollm, ids)
    entries = choice.logprobs.content
    assert len(entries) == len(choice.token_ids)
    p = len(r.prompt_token_ids)
    for k, (token_id, e) in enumerate(zip(choice.token_ids, entries)):
        assert abs(e.logprob - ref[p - 1 + k, token_id]) < 1e-3
        values = [t.logprob for t in e.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        best = np.sort(ref[p - 1 + k])[::-1][:5]
        assert np.allclose(values, best, atol=1e-3)
        if e.logprob >= values[-1] + 1e-6:  # it ranks: it is in the list
            assert e.token in [t.token for t in e.top_logprobs]
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]


def test_completion_logprobs_and_echo_equal_hf(client, hf_smollm):
    """Completions ``logprobs: int`` with ``echo``: the prompt tokens come first with their own
    log-probabilities (the first has none: null, and null top ones, as OpenAI and vLLM send
    them), then the generated ones; values equal HF's log-softmax; text offsets count the
    token texts; streamed equals non-streamed."""
    prompt = "The quick brown fox jumps over the lazy dog because"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, echo=True,
              extra_body={"return_token_ids": True})
    r = client.completions.create(**kw)
    c = r.choices[0]
    ids = c.prompt_token_ids + c.token_ids
    assert c.text.startswith(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _hf_log_softmax(hf_smollm, ids)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]]) < 1e-3, i
        # The token and the 3 most likely (OpenAI: up to logprobs + 1 entries), sorted.
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and len(top) <= 4
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert max(top.values()) == pytest.approx(ref[i - 1].max(), abs=1e-3)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    assert "".join(lp.tokens).startswith(prompt)
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for ch in chunks:
        if ch.choices and ch.choices[0].logprobs:
            for k in streamed:
                streamed[k] += getattr(ch.choices[0].logprobs, k)
    assert streamed == {k: getattr(lp, k) for k in streamed}
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text


# -- n -----------------------------------------------------------------------------------------


def test_n_choices_follow_the_distribution_and_share_the_prompt(server, client, hf_smollm):
    """Seeded n=8 requests: the first tokens' frequencies pass a chi-square test against HF's
    softmax at the prompt's end; with prefix caching off each request computes its prompt once
    (the engine's prompt-token counter grows by the prompt's length, the request counter too)."""
    messages = [{"role": "user", "content": "Tell me one word."}]
    before = server.metrics()
    first, prompt_ids = [], None
    num_requests = 30
    for k in range(num_requests):
        # Every filter off explicitly: the model's defaults would fill in what is left out.
        r = client.chat.completions.create(
            model=MODEL, messages=messages, n=8, max_tokens=1, temperature=1.0, top_p=1.0,
            seed=1000 + 8 * k, extra_body={"return_token_ids": True, "top_k": -1})
        assert sorted(c.index for c in r.choices) == list(range(8))
        first += [c.token_ids[0] for c in r.choices]
        prompt_ids = r.prompt_token_ids
    after = server.metrics()
    p = len(prompt_ids)
    computed = after["jaxserve:prompt_tokens_computed_total"] - before["jaxserve:prompt_tokens_computed_total"]
    assert computed == num_requests * p
    assert after["jaxserve:prompt_tokens_total"] - before["jaxserve:prompt_tokens_total"] == num_requests * p

    probs = np.exp(_hf_log_softmax(hf_smollm, prompt_ids)[-1])
    n = len(first)
    counts = np.bincount(first, minlength=len(probs))
    # Categories expected at least 5 times, the rest pooled into one.
    big = np.flatnonzero(probs * n >= 5)
    obs = np.append(counts[big], n - counts[big].sum())
    exp = np.append(probs[big] * n, n - probs[big].sum() * n)
    keep = exp > 0
    stat = float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
    df = int(keep.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square quantile at a one-sided level of ~1e-4.
    critical = df * (1 - 2 / (9 * df) + 3.72 * math.sqrt(2 / (9 * df))) ** 3
    assert stat < critical, (stat, critical, df)


def test_n_streamed_with_indices(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=PARIS_Q, n=3, max_tokens=8, temperature=1.0, seed=5, stream=True,
        stream_options={"include_usage": True}))
    texts, finished = {}, set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finished.add(ch.index)
    assert set(texts) == finished == {0, 1, 2}
    whole = client.chat.completions.create(model=MODEL, messages=PARIS_Q, n=3, max_tokens=8,
                                           temperature=1.0, seed=5)
    assert [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)] == \
        [texts[i] for i in range(3)]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


# -- penalties, logit bias, min_tokens ------------- --------------------------------------------


def _repeats(ids):
    """Tokens that repeat an earlier token of the sequence."""
    return len(ids) - len(set(ids))


def test_frequency_penalty_repeats_less(client):
    kw = dict(model=MODEL, prompt="Repeat after me: the cat, the cat, the cat, the cat, the cat,",
              max_tokens=32, temperature=0, extra_body={"return_token_ids": True})
    plain = client.completions.create(**kw).choices[0].token_ids
    penalized = client.completions.create(**kw, frequency_penalty=2.0).choices[0].token_ids
    assert _repeats(penalized) < _repeats(plain) / 2, (plain, penalized)
    presence = client.completions.create(**kw, presence_penalty=2.0).choices[0].token_ids
    assert _repeats(presence) < _repeats(plain)
    kw["extra_body"] = {"return_token_ids": True, "repetition_penalty": 1.5}
    rep = client.completions.create(**kw).choices[0].token_ids
    assert _repeats(rep) < _repeats(plain)


def test_logit_bias_forces_a_token_and_min_tokens_holds_eos_back(server, client):
    token = _post(server, "/tokenize", {"prompt": " banana"})[1]["tokens"][0]
    for stream in (False, True):
        kw = dict(model=MODEL, messages=PARIS_Q, max_tokens=5, logit_bias={str(token): 100},
                  extra_body={"return_token_ids": True})
        if stream:
            ids = [t for c in client.chat.completions.create(**kw, stream=True) if c.choices
                   for t in getattr(c.choices[0], "token_ids", None) or []]
        else:
            ids = client.chat.completions.create(**kw).choices[0].token_ids
        assert ids == [token] * 5
    short = client.chat.completions.create(model=MODEL, messages=PARIS_Q, temperature=0,
                                           max_tokens=64)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens
    held = client.chat.completions.create(model=MODEL, messages=PARIS_Q, temperature=0,
                                          max_tokens=64, extra_body={"min_tokens": n + 10})
    assert held.usage.completion_tokens >= n + 10
    assert held.choices[0].message.content.startswith(short.choices[0].message.content)


# -- every field, and 400s naming it ------------- -----------------------------------------------


def test_sampling_fields_through_the_client(client):
    base = dict(model=MODEL, messages=PARIS_Q, max_tokens=12, seed=11)
    greedy = client.chat.completions.create(**base, temperature=0).choices[0].message.content
    # min_p 1 keeps only the most likely token: greedy, whatever the temperature.
    for stream in (False, True):
        kw = dict(base, temperature=1.5, extra_body={"min_p": 1.0})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(**kw, stream=True) if c.choices)
        else:
            text = client.chat.completions.create(**kw).choices[0].message.content
        assert text == greedy
    # max_completion_tokens is max_tokens' newer name; user is accepted.
    r = client.chat.completions.create(model=MODEL, messages=PARIS_Q, max_completion_tokens=3,
                                       user="user-1", temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    # stop_token_ids, include_stop_str_in_output, skip_special_tokens
    eos = client.chat.completions.create(model=MODEL, messages=PARIS_Q, temperature=0,
                                         max_tokens=64, extra_body={"return_token_ids": True})
    eos_id = eos.choices[0].token_ids[-1]
    kept = client.chat.completions.create(
        model=MODEL, messages=PARIS_Q, temperature=0, max_tokens=64,
        extra_body={"include_stop_str_in_output": True, "skip_special_tokens": False,
                    "spaces_between_special_tokens": False})
    assert kept.choices[0].message.content == eos.choices[0].message.content + "<|im_end|>"
    stop_at = eos.choices[0].token_ids[2]
    stopped = client.chat.completions.create(
        model=MODEL, messages=PARIS_Q, temperature=0, max_tokens=64,
        extra_body={"stop_token_ids": [stop_at], "return_token_ids": True})
    assert stopped.choices[0].token_ids[-1] == stop_at and stopped.choices[0].finish_reason == "stop"
    assert eos_id == 2
    # vLLM's stop_reason: the stop token id or string that ended the choice, null at EOS
    assert (stopped.choices[0].stop_reason, eos.choices[0].stop_reason) == (stop_at, None)
    # include_stop_str_in_output with a stop string, streamed
    word = eos.choices[0].message.content.split()[2]
    chunks = [c for c in client.chat.completions.create(
        model=MODEL, messages=PARIS_Q, temperature=0, max_tokens=64, stop=[word], stream=True,
        extra_body={"include_stop_str_in_output": True}) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text.endswith(word) and word in eos.choices[0].message.content
    assert [getattr(c.choices[0], "stop_reason", None) for c in chunks][-1] == word


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"n": 129}, "n"),
    # over the server's limit (--max-num-seqs)
    ("/v1/chat/completions", {"n": SMALL_ENGINE["max_num_seqs"] + 1}, "n"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ("/v1/chat/completions", {"logit_bias": {"abc": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"1.5": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"99999999": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/chat/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/chat/completions", {"min_p": -0.1}, "min_p"),
    ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": 5000}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]},
     "messages"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi " * 1100}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
])
def test_out_of_range_is_a_400_naming_the_field(server, path, body, param):
    if path.endswith("chat/completions"):
        body = {"messages": PARIS_Q, **body}
    status, err = _post(server, path, {"model": MODEL, **body})
    assert status == 400, err
    assert err["error"]["param"] == param, err
    assert "Traceback" not in json.dumps(err)
    if param == "messages":
        assert "images are not supported" in err["error"]["message"]


def test_openai_client_sees_the_field_as_param(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=PARIS_Q, max_completion_tokens=5000)
    assert e.value.param == "max_completion_tokens", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, presence_penalty=2.5)
    assert e.value.param == "presence_penalty", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    assert e.value.param == "messages", e.value.body


# -- endpoints, content parts, prompt lists -------------------------------------------------------


def test_tokenize_detokenize_and_models_retrieve(server, client):
    status, tok = _post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert status == 200 and tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
    assert tok["max_model_len"] == MAX_MODEL_LEN
    assert _post(server, "/detokenize", {"tokens": tok["tokens"]}) == (200, {"prompt": "Hello world"})
    status, chat_tok = _post(server, "/tokenize", {"model": MODEL, "messages": PARIS_Q})
    r = client.chat.completions.create(model=MODEL, messages=PARIS_Q, max_tokens=1)
    assert status == 200 and chat_tok["count"] == r.usage.prompt_tokens
    status, err = _post(server, "/detokenize", {"tokens": [10**6]})
    assert status == 400 and err["error"]["param"] == "tokens"
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.max_model_len == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    status, body = get(f"{server.url}/v1/models/{MODEL}")
    assert status == 200 and json.loads(body)["id"] == MODEL


def test_content_parts_and_prompt_lists(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                          {"type": "text", "text": "of France?"}]}]
    a = client.chat.completions.create(model=MODEL, messages=parts, temperature=0, max_tokens=8)
    b = client.chat.completions.create(model=MODEL, messages=PARIS_Q, temperature=0, max_tokens=8)
    assert a.choices[0].message.content == b.choices[0].message.content
    ids = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=1,
                                    extra_body={"return_token_ids": True}).choices[0].prompt_token_ids
    for prompts in (["The capital of France is", "One, two,", "Once upon a time"],
                    [ids, ids[:2], ids[1:]]):
        r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=4,
                                      temperature=0, extra_body={"return_token_ids": True})
        assert [c.index for c in r.choices] == list(range(6))  # n choices per prompt, in order
        for i, p in enumerate(prompts):
            alone = client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
            assert r.choices[2 * i].text == r.choices[2 * i + 1].text == alone.choices[0].text
        assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)
        assert r.usage.prompt_tokens == sum(len(r.choices[2 * i].prompt_token_ids)
                                            for i in range(3))
    assert r.choices[0].prompt_token_ids == ids
    streamed = list(client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=3,
                                              temperature=0, stream=True))
    assert {c.choices[0].index for c in streamed if c.choices} == {0, 1}


# -- vLLM's request extensions and shapes ---------------------------------------------------------


def _ranks_ok(position: dict, ref_row) -> bool:
    """A prompt_logprobs position's alternatives have ranks 1, 2, ... in order of value, and
    each value is HF's (1e-3)."""
    entries = sorted(position.values(), key=lambda e: -e["logprob"])
    values_ok = all(abs(e["logprob"] - ref_row[int(t)]) < 1e-3 for t, e in position.items())
    return values_ok and [e["rank"] for e in entries][: len(entries) - 1] == list(
        range(1, len(entries)))


def test_prompt_logprobs_and_vllm_nulls(server, client, hf_smollm):
    """vLLM's ``prompt_logprobs``: in each completions choice, at the top level of a chat
    completion; null for the first prompt token, then the token and the k most likely with
    their ranks and texts, HF's values. Fields not asked for are null in whole bodies, as
    vLLM sends them; a stream refuses prompt log-probabilities above 0 (a 400), as vLLM does."""
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1,
                                  temperature=0,
                                  extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    c = r.choices[0]
    ids, plp = c.prompt_token_ids, c.prompt_logprobs
    ref = _hf_log_softmax(hf_smollm, ids)
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        assert str(ids[i]) in plp[i] and len(plp[i]) in (2, 3), plp[i]
        assert _ranks_ok(plp[i], ref[i - 1]), (i, plp[i])
    texts = [plp[i][str(ids[i])]["decoded_token"] for i in range(1, len(ids))]
    assert "".join(texts) == " capital of France is"

    chat = client.chat.completions.create(model=MODEL, messages=PARIS_Q, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0,
                                                      "return_token_ids": True})
    assert len(chat.prompt_logprobs) == len(chat.prompt_token_ids)
    assert all(len(p) == 1 for p in chat.prompt_logprobs[1:])  # the token alone
    status, body = _post(server, "/v1/chat/completions",
                         {"model": MODEL, "messages": PARIS_Q, "max_tokens": 1})
    assert status == 200 and body["prompt_token_ids"] is None and body["prompt_logprobs"] is None
    choice = body["choices"][0]
    assert choice["token_ids"] is None and "prompt_token_ids" not in choice
    assert choice["message"]["reasoning"] is None and choice["message"]["reasoning_content"] is None
    status, body = _post(server, "/v1/completions",
                         {"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert [body["choices"][0][k] for k in ("prompt_token_ids", "token_ids", "prompt_logprobs")] \
        == [None] * 3
    for path, extra in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": PARIS_Q})):
        status, err = _post(server, path, {"model": MODEL, "stream": True, "prompt_logprobs": 1,
                                           **extra})
        assert status == 400 and err["error"]["param"] == "prompt_logprobs", err
        status, err = _post(server, path, {"model": MODEL, "prompt_logprobs": -1, **extra})
        assert status == 400 and err["error"]["param"] == "prompt_logprobs", err


def test_return_tokens_as_token_ids(client):
    """vLLM's ``return_tokens_as_token_ids``: log-probability tokens are ``token_id:{id}``
    (an emoji split over tokens stays apart), in completions with echo and in chat."""
    prompt = "Say 'Hello, world! 🎉'"
    c = client.completions.create(
        model=MODEL, prompt=prompt, echo=True, temperature=0, max_tokens=6, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True}).choices[0]
    assert c.logprobs.tokens == [f"token_id:{t}" for t in c.prompt_token_ids + c.token_ids]
    for token, top in zip(c.logprobs.tokens[1:], c.logprobs.top_logprobs[1:]):
        assert token in top and all(k.startswith("token_id:") for k in top)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=6,
        logprobs=True, top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    entries = r.choices[0].logprobs.content
    assert [int(e.token.removeprefix("token_id:")) for e in entries] == r.choices[0].token_ids
    assert all(bytes(e.bytes).decode() == e.token for e in entries)
    assert all(t.token.startswith("token_id:") for e in entries for t in e.top_logprobs)


def test_allowed_token_ids_only_those_are_drawn(server, client):
    """vLLM's ``allowed_token_ids``: sampled at temperature 1, every token is one of them
    (EOS too is not allowed unless listed: the choices run to max_tokens), streamed or not;
    an empty list or an id outside the vocabulary is a 400 naming the field."""
    allowed = _post(server, "/tokenize", {"prompt": " red green blue"})[1]["tokens"]
    kw = dict(model=MODEL, prompt="My favourite colours are", n=2, max_tokens=6,
              temperature=1.0, seed=3,
              extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "top_k": -1})
    r = client.completions.create(**kw)
    assert all(set(c.token_ids) <= set(allowed) and c.finish_reason == "length"
               for c in r.choices)
    streamed = [t for ch in client.completions.create(**kw, stream=True) for c in ch.choices
                for t in c.model_extra.get("token_ids") or ()]
    assert len(streamed) == 12 and set(streamed) <= set(allowed)
    for bad in ([], [10**6]):
        status, err = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi",
                                                        "allowed_token_ids": bad})
        assert status == 400 and err["error"]["param"] == "allowed_token_ids", err


def test_stream_options_and_continuous_usage_stats(server, client):
    """``continuous_usage_stats`` (vLLM's, with ``include_usage``): every chunk carries its
    choice's usage so far, the usage chunk the total; given ``stream_options`` without
    ``include_usage`` asks for the usage chunk (vLLM's default); ``stream_options`` without
    ``stream`` is a 400 (an empty object passes, as in vLLM)."""
    for create, kw in ((client.completions.create, {"prompt": "One, two,"}),
                       (client.chat.completions.create, {"messages": PARIS_Q})):
        kw = dict(kw, model=MODEL, max_tokens=5, temperature=0, stream=True)
        chunks = list(create(**kw, stream_options={"include_usage": True,
                                                   "continuous_usage_stats": True}))
        assert all(c.usage is not None for c in chunks) and chunks[-1].choices == []
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 5 and counts[-2] == 5
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
                   for c in chunks)
        # Cached tokens are stated once the engine has looked the prompt up, and never change
        # (a chat's opening role chunk, sent before, leaves them out).
        cached = {c.usage.prompt_tokens_details.cached_tokens for c in chunks
                  if c.usage.prompt_tokens_details is not None}
        assert cached == {chunks[-1].usage.prompt_tokens_details.cached_tokens}
        chunks = list(create(**kw, stream_options={"include_usage": False,
                                                   "continuous_usage_stats": True}))
        assert all(c.usage is None for c in chunks)
        assert list(create(**kw, stream_options={}))[-1].usage.completion_tokens == 5
    for path, extra in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": PARIS_Q})):
        body = {"model": MODEL, "max_tokens": 1, **extra}
        for options in ({"include_usage": True}, {"continuous_usage_stats": True}):
            status, err = _post(server, path, {**body, "stream_options": options})
            assert status == 400 and err["error"]["param"] == "stream_options", err
        assert _post(server, path, {**body, "stream_options": {}})[0] == 200


SAYING = "Here is a common saying about apple. An apple a day, keeps"


def test_continue_final_message_echo_and_generation_prompt(server, client):
    """vLLM's chat template options: ``continue_final_message`` (with ``add_generation_prompt``
    false) leaves the last message open, and the reply continues it as a completion of that
    prompt would; ``echo`` starts the reply with that message (its own chunk in a stream);
    without a generation prompt the reply takes the last message's role; both options at once
    are a 400."""
    messages = [{"role": "user", "content": "tell me a common saying"},
                {"role": "assistant", "content": SAYING}]
    options = {"continue_final_message": True, "add_generation_prompt": False}
    ids = _post(server, "/tokenize", {"messages": messages, **options})[1]["tokens"]
    assert _post(server, "/detokenize", {"tokens": ids})[1]["prompt"].endswith(SAYING)
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(
        **kw, extra_body={**options, "return_token_ids": True})
    echoed = client.chat.completions.create(**kw, extra_body={**options, "echo": True})
    assert plain.prompt_token_ids == ids
    assert plain.choices[0].message.role == "assistant"
    text = plain.choices[0].message.content
    assert SAYING not in text
    assert text == client.completions.create(model=MODEL, prompt=ids, max_tokens=8,
                                             temperature=0).choices[0].text
    assert echoed.choices[0].message.content == SAYING + text
    chunks = list(client.chat.completions.create(
        **kw, stream=True, extra_body={**options, "echo": True}))
    assert chunks[1].choices[0].delta.content == SAYING
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == SAYING + text
    status, body = _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": PARIS_Q, "add_generation_prompt": False, "max_tokens": 2})
    assert status == 200 and body["choices"][0]["message"]["role"] == "user"
    status, err = _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "continue_final_message": True})
    assert status == 400 and err["error"]["param"] == "continue_final_message", err


def test_custom_roles_and_chat_template_kwargs_reach_the_template(server, client):
    """A message of a role OpenAI does not define goes to the chat template as it is (vLLM's
    custom roles); ``chat_template_kwargs`` keys the template does not read are dropped, and
    ``tokenize`` / ``chat_template`` are a 400."""
    messages = [{"role": "narrator", "content": "Once upon a time"}, *PARIS_Q]
    ids = _post(server, "/tokenize", {"messages": messages})[1]["tokens"]
    text = _post(server, "/detokenize", {"tokens": ids})[1]["prompt"]
    assert "<|im_start|>narrator\nOnce upon a time<|im_end|>" in text
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body={"return_token_ids": True})
    assert r.prompt_token_ids == ids
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2,
        extra_body={"return_token_ids": True, "chat_template_kwargs": {"not_read": 1}})
    assert r.prompt_token_ids == ids
    for key in ("tokenize", "chat_template"):
        status, err = _post(server, "/v1/chat/completions", {
            "model": MODEL, "messages": PARIS_Q, "chat_template_kwargs": {key: "x"}})
        assert status == 400 and err["error"]["param"] == "chat_template_kwargs", err


def _reference_beams(hf, prompt: list[int], width: int, steps: int, eos: int) -> list[list[int]]:
    """Beam search over HF transformers' log-probabilities, by vLLM's rule (beam_search.py)."""
    import torch

    def score(tokens, cum):
        return cum / (len(prompt) + len(tokens) - (tokens[-1:] == [eos]))

    live, done = [([], 0.0)], []
    for _ in range(steps):
        grown = []
        for tokens, cum in live:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + tokens])).logits[0, -1].double()
            lps = torch.log_softmax(logits, -1)
            top = torch.topk(lps, 2 * width)
            for t, lp in zip(top.indices.tolist(), top.values.tolist()):
                (done if t == eos else grown).append((tokens + [t], cum + lp))
        live = sorted(grown, key=lambda b: score(*b), reverse=True)[:width]
    return [t for t, _ in sorted(done + live, key=lambda b: score(*b), reverse=True)[:width]]


def test_beam_search(server, client, hf_smollm):
    """``use_beam_search`` with n beams (vLLM's): the beams HF's log-probabilities give, best
    first; the same prompt twice gives the same beams (vLLM's test); chat and streams too;
    what beam search cannot honour is a 400."""
    prompt = "Hello, my name is"
    r = client.completions.create(model=MODEL, prompt=[prompt, prompt], n=2, max_tokens=5,
                                  temperature=0, extra_body={"use_beam_search": True,
                                                             "return_token_ids": True})
    c = r.choices
    assert len(c) == 4 and c[0].text != c[1].text
    assert (c[0].text, c[1].text) == (c[2].text, c[3].text)
    ref = _reference_beams(hf_smollm, c[0].prompt_token_ids, 2, 5, eos=2)
    assert [c[0].token_ids, c[1].token_ids] == ref
    kw = dict(model=MODEL, messages=PARIS_Q, n=2, max_tokens=6,
              extra_body={"use_beam_search": True})
    whole = client.chat.completions.create(**kw)
    texts = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert [texts[0], texts[1]] == [ch.message.content for ch in whole.choices]
    for extra, param in (({"n": 11}, "n"), ({"logprobs": 1}, "logprobs"),
                         ({"stop": ["x"]}, "stop"), ({"stop_token_ids": [30]}, "stop_token_ids")):
        status, err = _post(server, "/v1/completions", {
            "model": MODEL, "prompt": prompt, "use_beam_search": True, **extra})
        assert status == 400 and err["error"]["param"] == param, err


# -- every body on the wire (last) ------------- -------------------------------------------------


def test_every_body_validates_against_the_openapi_schema(transport):
    checked = {"whole": 0, "chunks": 0}
    for path, status, raw in transport.records:
        if status != 200 or not path.endswith("completions"):
            continue
        chat = path.endswith("chat/completions")
        text = raw.decode()
        if text.startswith("data: "):
            for block in text.split("\n\n"):
                data = block.removeprefix("data: ")
                if not block or data == "[DONE]":
                    continue
                body = json.loads(data)
                problems = errors(CHAT_CHUNK if chat else COMPLETION_CHUNK, body)
                assert not problems, (problems, body)
                checked["chunks"] += 1
        else:
            body = json.loads(text)
            problems = errors(CHAT if chat else COMPLETION, body)
            assert not problems, (problems, body)
            checked["whole"] += 1
    assert checked["whole"] > 50 and checked["chunks"] > 50, checked
