"""/metrics names (jaxserve/metrics.py): jaxserve's by default; with the ``vllm`` prefix, vLLM's
names and labels for the metrics vLLM has too, jaxserve's for the rest; the inter-token latency
histogram fed by the OutputProcessor."""

from prometheus_client.parser import text_string_to_metric_families

from jaxserve.engine import EngineCoreOutput
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.metrics import VLLM_NAMES, Metrics, token_buckets
from jaxserve.sampling_params import SamplingParams


def _samples(m: Metrics) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}


def test_prefixes_and_labels():
    plain, vllm = _samples(Metrics("m")), _samples(Metrics("m", "vllm"))
    assert all(name.startswith("jaxserve:") for name, _ in plain)
    for name, labels in vllm:
        base = name.split(":", 1)[1].removesuffix("_total").removesuffix("_created")
        base = base.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
        assert name.startswith("vllm:" if base in VLLM_NAMES else "jaxserve:"), name
        assert dict(labels)["model_name"] == "m" and dict(labels)["engine"] == "0"
    # The names a vLLM dashboard queries.
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_prompt_tokens_bucket",
                 "vllm:request_generation_tokens_bucket", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert any(n == name for n, _ in vllm), name


def test_inter_token_latency_per_output_after_the_first():
    from jaxserve.model_loader import default_tokenizer

    m = Metrics("m", "vllm")
    proc = OutputProcessor(default_tokenizer(), eos_token_ids=[2], metrics=m)
    proc.add_request("r", None, [1, 2], SamplingParams(max_tokens=3))
    for i, reason in enumerate((None, None, "length")):
        proc.process_outputs([EngineCoreOutput("r", [5 + i], reason, num_prompt_tokens=2)])
    s = _samples(m)
    labels = (("engine", "0"), ("model_name", "m"))
    assert s[("vllm:inter_token_latency_seconds_count", labels)] == 2
    assert s[("vllm:request_generation_tokens_count", labels)] == 1
    assert s[("vllm:request_generation_tokens_sum", labels)] == 3


def test_token_buckets():
    assert token_buckets(1024) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def test_iteration_tokens_histogram_and_cache_config_info():
    """vLLM's ``iteration_tokens_total``: per engine step's outputs, the whole prompt of each
    choice that got its first token (cached or not) and the tokens generated; and
    ``cache_config_info`` (value 1, the config as labels)."""
    from jaxserve.model_loader import default_tokenizer

    m = Metrics("m", "vllm", cache_config={"block_size": "16", "num_gpu_blocks": "100"})
    labels = (("engine", "0"), ("model_name", "m"))
    info = {"block_size": "16", "num_gpu_blocks": "100", "engine": "0", "model_name": "m"}
    assert _samples(m)[("vllm:cache_config_info", tuple(sorted(info.items())))] == 1
    proc = OutputProcessor(default_tokenizer(), eos_token_ids=[2], metrics=m)
    proc.add_request("a", None, [1] * 7, SamplingParams(max_tokens=3))
    proc.add_request("b", None, [1] * 300, SamplingParams(max_tokens=3))
    steps = [[EngineCoreOutput("a", [5], num_prompt_tokens=7)],  # a's first token: 7 + 1
             [EngineCoreOutput("a", [6]), EngineCoreOutput("b", [5], num_prompt_tokens=300)],
             [EngineCoreOutput("a", [7], "length"), EngineCoreOutput("b", [6, 7], "length")]]
    for outputs in steps:
        proc.process_outputs(outputs)
    s = _samples(m)

    def bucket(le):
        return s[("vllm:iteration_tokens_total_bucket", labels[:1] + (("le", le),) + labels[1:])]

    assert (bucket("1.0"), bucket("8.0"), bucket("256.0"), bucket("512.0"), bucket("+Inf")) == \
        (0, 2, 2, 3, 3)  # steps of 8, 3 and 302 tokens
    assert s[("vllm:iteration_tokens_total_sum", labels)] == 8 + 3 + 302
