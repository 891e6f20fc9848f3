"""n-gram speculative decoding through the real server (127.0.0.1, the official ``openai``
client): greedy completions equal the plain offline engine's up to the near-tie rule
(docs/architecture.md, "Testing numerics"), streaming gives the same text, n=2, logprobs, a stop
string and max_tokens hold, ``/metrics`` carries vLLM's speculative decoding counters, and a bad
``--speculative-config`` is a usage error naming the flag."""

import subprocess
import sys

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.sampling_params import SamplingParams
from tests.greedy import compare_greedy
from tests.integration.server_utils import Server, get
from tests.spec_engine import SPEC_ENGINE_FLAGS, spec_prompts, top2_margin

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server():
    srv = Server(*SPEC_ENGINE_FLAGS, "--metrics-prefix", "vllm")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)


def complete(client, prompt, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=prompt,
                                     extra_body={"return_token_ids": True}, **kw)


def test_greedy_equals_plain_engine_and_counts_drafts(server, client, smollm_llm):
    prompts = spec_prompts()[::6]  # a repeat and a correct request
    ref = smollm_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                      logprobs=2), use_tqdm=False)
    for prompt, r in zip(prompts, ref):
        a = r.outputs[0]
        got = complete(client, prompt).choices[0].model_extra["token_ids"]
        same, n = compare_greedy(got, a.token_ids, [top2_margin(p) for p in a.logprobs])
        assert same, (n, a.token_ids, got)
    m = server.metrics()
    assert m["vllm:spec_decode_num_drafts_total"] > 0
    accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= m["vllm:spec_decode_num_draft_tokens_total"]
    per_pos = {s.labels["position"]: s.value
               for f in text_string_to_metric_families(get(f"{server.url}/metrics")[1])
               for s in f.samples if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert sorted(per_pos) == ["0", "1", "2", "3"] and sum(per_pos.values()) == accepted
    assert per_pos["0"] >= per_pos["3"] > 0


def test_streaming_logprobs_stop_and_max_tokens(client):
    prompt = spec_prompts()[0]
    full = complete(client, prompt).choices[0]
    stream = complete(client, prompt, stream=True)
    assert "".join(c.choices[0].text for c in stream) == full.text
    with_lp = complete(client, prompt, logprobs=2).choices[0]
    assert with_lp.text == full.text
    assert len(with_lp.logprobs.tokens) == len(full.model_extra["token_ids"])
    assert all(lp <= 0 for lp in with_lp.logprobs.token_logprobs)
    words = full.text.split()
    stop = words[len(words) // 2]
    cut = complete(client, prompt, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    short = complete(client, prompt, max_tokens=5)
    assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "length"


def test_two_sampled_choices(client):
    r = complete(client, spec_prompts()[1], n=2, temperature=0.8, top_p=0.95, seed=3,
                 presence_penalty=0.2)
    assert len(r.choices) == 2
    assert all(len(c.model_extra["token_ids"]) <= MAX_TOKENS for c in r.choices)
    assert r.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in r.choices)


def test_bad_speculative_config_is_a_usage_error():
    p = subprocess.run([sys.executable, "-m", "jaxserve.serve", "--speculative-config",
                        '{"method": "ngram", "num_speculative_tokens": 0}'],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "--speculative-config" in p.stderr and "num_speculative_tokens" in p.stderr
