"""GET /metrics/summary (entrypoints/metrics_summary.py): the dashboard's JSON equals what
GET /metrics says in Prometheus text, after requests, under either metrics prefix (jaxserve's,
and vLLM's names with ``--metrics-prefix vllm``); it needs no API key (like /metrics), and
answers 503 with the OpenAI error body before the engine's metrics exist. The playground's files
are served (and nothing beside them); OutputProcessor records tokens as they arrive."""

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.engine import EngineCoreOutput, SchedulerStats
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.entrypoints.api_server import build_app
from jaxserve.metrics import Metrics
from jaxserve.sampling_params import SamplingParams
from tests.unit.test_openai_serving import FakeLLM


def _get(llm, *paths):
    """[(status, headers, body text)] of GETs to the app (with an API key set)."""

    async def go():
        async with TestClient(TestServer(build_app(llm, api_key="secret"))) as client:
            out = []
            for path in paths:
                resp = await client.get(path)
                out.append((resp.status, resp.headers, await resp.text()))
            return out

    return asyncio.run(go())


def _prometheus(text):
    """{(sample name, le or finished_reason or None): value} of the Prometheus text."""
    return {(s.name, s.labels.get("le", s.labels.get("finished_reason"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.model_loader import default_tokenizer

    return default_tokenizer()


def _serve_requests(llm, tokenizer):
    """Two requests through an OutputProcessor with the app's Metrics: one of 3 tokens that
    stops, one of 2 choices that runs out of length; engine stats with prefix-cache hits."""
    op = OutputProcessor(tokenizer, eos_token_ids=[tokenizer.eos_token_id], metrics=llm.metrics)
    op.add_request("a", None, [1, 2, 3], SamplingParams(), asyncio.Queue())
    op.add_request("b", None, [1, 2], SamplingParams(n=2, max_tokens=2), asyncio.Queue())
    op.process_outputs([EngineCoreOutput("a", [5], None, None, 3, 0),
                        EngineCoreOutput("0_b", [6], None, None, 2, 0),
                        EngineCoreOutput("1_b", [7], None, None, 2, 0)])
    op.process_outputs([EngineCoreOutput("a", [8, 9], None, None, 3, 0),
                        EngineCoreOutput("0_b", [6], "length", None, 2, 0),
                        EngineCoreOutput("1_b", [7], "length", None, 2, 0)])
    op.process_outputs([EngineCoreOutput("a", [tokenizer.eos_token_id], "stop", None, 3, 0)])
    llm.metrics.update_stats(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1,
                                            kv_cache_usage=0.125, num_preemptions_total=2,
                                            prefix_cache_queries=64, prefix_cache_hits=16))


@pytest.mark.parametrize("prefix", ["jaxserve", "vllm"])
def test_summary_equals_the_prometheus_text(tokenizer, prefix):
    llm = FakeLLM()
    llm.metrics = m = Metrics(llm.model_name, prefix)
    _serve_requests(llm, tokenizer)
    (status, _, text), (summary_status, _, summary) = _get(llm, "/metrics", "/metrics/summary")
    assert status == summary_status == 200
    prom, s = _prometheus(text), json.loads(summary)
    assert m.name("num_requests_running") == f"{prefix}:num_requests_running"
    assert s["requests_running"] == prom[m.name("num_requests_running"), None] == 3
    assert s["requests_waiting"] == prom[m.name("num_requests_waiting"), None] == 1
    assert s["kv_cache_usage"] == prom[m.name("kv_cache_usage_perc"), None] == 0.125
    assert s["preemptions"] == prom[m.name("num_preemptions") + "_total", None] == 2
    assert s["prefix_cache_queries"] == 64 and s["prefix_cache_hits"] == 16
    assert s["prefix_cache_hit_rate"] == 0.25
    assert s["engine_alive"] is True  # jaxserve:engine_alive under either prefix
    success = m.name("request_success") + "_total"
    assert s["requests_finished"] == (prom[success, "stop"] + prom[success, "length"]) == 2
    assert s["prompt_tokens"] == prom[m.name("prompt_tokens") + "_total", None] == 5
    # a: 1 + 2 + 1 tokens, b: 2 choices of 2.
    assert s["generation_tokens"] == prom[m.name("generation_tokens") + "_total", None] == 8
    for name, firsts, laters in (("time_to_first_token_seconds", 2, 0),
                                 ("inter_token_latency_seconds", 0, 4)):
        h, base = s[name], m.name(name)
        assert base == f"{prefix}:{name}"
        assert h["count"] == prom[f"{base}_count", None] == firsts + laters
        assert h["sum"] == prom[f"{base}_sum", None]
        assert len(h["counts"]) == len(h["le"]) + 1 and sum(h["counts"]) == h["count"]
        cumulative = 0
        for le, count in zip(h["le"], h["counts"]):
            cumulative += count
            assert cumulative == prom[f"{base}_bucket", repr(float(le))]


def test_before_the_engine_is_ready():
    llm = FakeLLM()
    llm.metrics = None
    ((status, _, text),) = _get(llm, "/metrics/summary")
    assert status == 503
    assert json.loads(text)["error"]["code"] == "engine_unavailable"


def test_playground_files_need_no_key_and_nothing_else_is_served():
    page, script, style, bad, missing, guarded = _get(
        FakeLLM(), "/", "/static/main.js", "/static/playground.css", "/static/..%2Fplayground.py",
        "/static/nope.js", "/v1/models")
    assert page[0] == script[0] == style[0] == 200
    assert page[1]["Content-Type"].startswith("text/html") and "<canvas" in page[2]
    assert page[1]["Content-Security-Policy"] == "default-src 'self'"
    assert "javascript" in script[1]["Content-Type"] and style[1]["Content-Type"].startswith("text/css")
    for status, headers, text in (bad, missing):
        assert status == 404 and json.loads(text)["error"]["type"] == "invalid_request_error"
    assert guarded[0] == 401


def test_tokens_are_counted_as_they_arrive(tokenizer):
    """A dashboard sees a long request's tokens and TTFT before it ends."""
    llm = FakeLLM()
    op = OutputProcessor(tokenizer, metrics=llm.metrics)
    op.add_request("r", None, [1], SamplingParams(max_tokens=10), asyncio.Queue())
    op.process_outputs([EngineCoreOutput("r", [5])])
    op.process_outputs([EngineCoreOutput("r", [6, 7])])
    s = json.loads(_get(llm, "/metrics/summary")[0][2])
    assert s["generation_tokens"] == 3 and s["requests_finished"] == 0
    assert s["time_to_first_token_seconds"]["count"] == 1
    assert s["inter_token_latency_seconds"]["count"] == 1
