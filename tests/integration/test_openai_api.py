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
    log-probabilities (the first is given: 0.0), then the generated ones; values equal HF's
    log-softmax; text offsets count the token texts; streamed equals non-streamed."""
    prompt = "The quick brown fox jumps over the lazy dog because"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, echo=True,
              extra_body={"return_token_ids": True})
    r = client.completions.create(**kw)
    c = r.choices[0]
    ids = c.prompt_token_ids + c.token_ids
    assert c.text.startswith(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] == 0.0
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
    # include_stop_str_in_output with a stop string, streamed
    word = eos.choices[0].message.content.split()[2]
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=PARIS_Q, temperature=0, max_tokens=64, stop=[word], stream=True,
        extra_body={"include_stop_str_in_output": True}) if c.choices)
    assert text.endswith(word) and word in eos.choices[0].message.content


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
