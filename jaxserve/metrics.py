"""Prometheus metrics for ``GET /metrics`` (docs/architecture.md, "Engine stats").

Engine gauges come from the latest SchedulerStats the engine sent over the pipe (it sends them
with every step and whenever they change while idle); request counters and histograms are
recorded by the API process's OutputProcessor. Generated tokens, time to first token and
inter-token latency are recorded as the tokens arrive (as vLLM does), so that a dashboard polling
them sees a long request's progress, not one jump when it ends; an aborted request's tokens count
too. Each Metrics object has its own registry.

Names: ``jaxserve:<name>`` by default. With ``--metrics-prefix vllm`` the metrics vLLM has too
(``VLLM_NAMES``: the same name, the same meaning, as vLLM V1's ``vllm/v1/metrics/loggers.py``
defines them) are ``vllm:<name>`` with vLLM's labels ``model_name`` and ``engine`` (``"0"``: one
engine), so that a dashboard built for vLLM reads them; the others stay ``jaxserve:<name>``.

When the engine process dies its gauges drop to 0 (nothing runs any more) and
``jaxserve:engine_alive`` reads 0 until a restarted engine is ready; the engine's cumulative
counters (preemptions, prefix cache) carry the dead engine's totals over, so they never go back.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.engine import SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
METRICS_PREFIXES = ("jaxserve", "vllm")

# Latency histograms' buckets, seconds: vLLM's request-latency buckets (to 7,680 s: a queued
# request of a long burst stays below +Inf), finer below 0.3 s.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
                    15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
                    7680.0)
# The inter-token latency histogram's buckets, seconds: vLLM's (every bound a vLLM dashboard may
# query is there), finer below 10 ms, where a GPU decode step lands.
_INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                        0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# Metrics of the same name and meaning in vLLM V1.
VLLM_NAMES = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions",
    "prefix_cache_queries", "prefix_cache_hits", "request_success", "prompt_tokens",
    "generation_tokens", "time_to_first_token_seconds", "e2e_request_latency_seconds",
    "inter_token_latency_seconds", "request_prompt_tokens", "request_generation_tokens",
    "lora_requests_info", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
    "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
    "request_inference_time_seconds", "request_params_n", "request_params_max_tokens",
    "request_max_num_generation_tokens", "time_per_output_token_seconds",
    "request_time_per_output_token_seconds", "iteration_tokens_total", "cache_config_info"})
# The n parameter's histogram buckets (vLLM's).
_N_BUCKETS = (1, 2, 5, 10, 20)
# vLLM's buckets of ``iteration_tokens_total``, tokens an engine step.
_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def cache_config_labels(config, num_gpu_blocks: int) -> dict[str, str]:
    """The ``cache_config_info`` gauge's labels: vLLM's CacheConfig field names, from the
    engine's resolved config and its KV pool's pages (the null page included, as vLLM's)."""
    return {"block_size": str(config.page_size), "cache_dtype": str(config.kv_cache_dtype),
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "gpu_memory_utilization": str(config.gpu_memory_utilization),
            "num_gpu_blocks": str(num_gpu_blocks)}


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 buckets of token counts (1, 2, 5, 10, 20, ...) up to ``max_model_len``."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _EngineStatsCollector:
    def __init__(self, metrics: "Metrics"):
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        s = m.stats

        def gauge(name, doc, value):
            g = GaugeMetricFamily(m.name(name), doc, labels=m.label_names)
            g.add_metric(m.label_values, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(m.name(name), doc, labels=m.label_names)
            c.add_metric(m.label_values, value)
            return c

        yield gauge("num_requests_running", "Requests in the engine's running batch.",
                    s.num_running_reqs)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                    s.num_waiting_reqs)
        yield gauge("kv_cache_usage_perc",
                    "Fraction of usable KV pages referenced by live requests (0..1).",
                    s.kv_cache_usage)
        base = m.dead_engines_totals
        yield counter("num_preemptions", "Requests preempted (recompute).",
                      base.num_preemptions_total + s.num_preemptions_total)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      base.prefix_cache_queries + s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      base.prefix_cache_hits + s.prefix_cache_hits)
        yield counter("prompt_tokens_computed", "Prompt tokens whose K/V the engine "
                      "computed (prefix-cache hits and the shared prompt of a request's other "
                      "choices excluded; recomputation after preemption included).",
                      base.prompt_tokens_computed + s.prompt_tokens_computed)
        if m.max_loras:  # vLLM's: its labels say which adapters run and wait; its value when
            g = GaugeMetricFamily(m.name("lora_requests_info"), "LoRA adapters of the running "
                                  "and waiting requests (labels); the value is when the engine "
                                  "reported them, Unix seconds.",
                                  labels=["max_lora", "waiting_lora_adapters",
                                          "running_lora_adapters"])
            g.add_metric([str(m.max_loras), ",".join(s.waiting_lora_adapters),
                          ",".join(s.running_lora_adapters)], m.stats_time)
            yield g
        spec = base.spec_decoding.plus(s.spec_decoding)
        yield counter("spec_decode_num_drafts", "Sequence-steps that verified draft tokens "
                      "(speculative decoding).", spec.num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.",
                      spec.num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      spec.num_accepted_tokens)
        per_pos = CounterMetricFamily(m.name("spec_decode_num_accepted_tokens_per_pos"),
                                      "Draft tokens accepted, by position in the draft (0: "
                                      "the first).", labels=m.label_names + ["position"])
        for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
            per_pos.add_metric(m.label_values + [str(pos)], n)
        yield per_pos
        yield gauge("engine_alive", "1 while the engine process serves, 0 after it died "
                    "(until a restarted one is ready).", 1 if m.engine_alive else 0)
        yield counter("engine_restarts", "Times the engine process was restarted after "
                      "it died.", m.engine_restarts)


class Metrics:
    """The server's metrics. ``render()`` gives the Prometheus text exposition.

    Args:
      model_name: the ``model_name`` label's value.
      prefix: "jaxserve", or "vllm" for vLLM's names and labels (module docstring).
      max_model_len: the top of the per-request token-count histograms' buckets.
      max_loras: --max-loras with --enable-lora (the ``lora_requests_info`` gauge), else 0.
      cache_config: the KV cache's configuration, label name to value (vLLM's
        ``cache_config_info`` gauge, value 1); None: no such gauge.
    """

    def __init__(self, model_name: str, prefix: str = "jaxserve", max_model_len: int = 32768,
                 max_loras: int = 0, cache_config: dict[str, str] | None = None):
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {METRICS_PREFIXES}, got {prefix!r}")
        self.model_name = model_name
        self.prefix = prefix
        self.label_names = ["model_name"] + (["engine"] if prefix == "vllm" else [])
        self.label_values = [model_name] + (["0"] if prefix == "vllm" else [])
        self.stats = SchedulerStats()
        self.stats_time = time.time()  # when the engine sent them
        self.max_loras = max_loras
        self.dead_engines_totals = SchedulerStats()  # cumulative counters of engines that died
        self.engine_alive = True
        self.engine_restarts = 0
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(self))
        labels, reg = self.label_names, self.registry
        self.request_success = Counter(
            self.name("request_success"), "Finished requests, by finish reason.",
            labels + ["finished_reason"], registry=reg)
        self.prompt_tokens = Counter(self.name("prompt_tokens"), "Prompt tokens of finished "
                                     "requests (once per request, whatever its n).",
                                     labels, registry=reg)
        self.generation_tokens = Counter(self.name("generation_tokens"),
                                         "Generated tokens, counted as they arrive.",
                                         labels, registry=reg)
        self.request_prompt_tokens = Histogram(
            self.name("request_prompt_tokens"), "Prompt tokens of each finished request.",
            labels, buckets=token_buckets(max_model_len), registry=reg)
        self.request_generation_tokens = Histogram(
            self.name("request_generation_tokens"), "Generated tokens of each finished request "
            "(all its choices).", labels, buckets=token_buckets(max_model_len), registry=reg)
        self.ttft = Histogram(self.name("time_to_first_token_seconds"),
                              "Time from arrival to the first token, seconds.", labels,
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.inter_token = Histogram(
            self.name("inter_token_latency_seconds"), "Time between a choice's successive "
            "outputs of new tokens, seconds.", labels, buckets=_INTER_TOKEN_BUCKETS,
            registry=reg)
        # vLLM V1 records the same values under its older name, which dashboards built for
        # vLLM (its Grafana example's TPOT panel) still query.
        self.time_per_output_token = Histogram(
            self.name("time_per_output_token_seconds"), "inter_token_latency_seconds under "
            "vLLM's older name (the same values).", labels, buckets=_INTER_TOKEN_BUCKETS,
            registry=reg)
        self.request_tpot = Histogram(
            self.name("request_time_per_output_token_seconds"), "A choice's decode time over "
            "its tokens after the first, seconds (choices of two or more tokens).", labels,
            buckets=_INTER_TOKEN_BUCKETS, registry=reg)
        self.e2e = Histogram(self.name("e2e_request_latency_seconds"),
                             "Time from arrival to the last token, seconds.", labels,
                             buckets=_LATENCY_BUCKETS, registry=reg)
        # A choice's phases, measured in the engine (vLLM's intervals): queue (arrival at the
        # engine to its scheduling), prefill (to its first token), decode (first to last token),
        # inference (prefill + decode).
        self.phases = [Histogram(self.name(f"request_{phase}_time_seconds"), doc, labels,
                                 buckets=_LATENCY_BUCKETS, registry=reg) for phase, doc in (
            ("queue", "Time a choice waited in the engine before it was scheduled, seconds."),
            ("prefill", "Time from a choice's scheduling to its first token, seconds."),
            ("decode", "Time from a choice's first token to its last, seconds."),
            ("inference", "Time from a choice's scheduling to its last token, seconds."))]
        self.request_params_n = Histogram(
            self.name("request_params_n"), "The n parameter of each finished request.", labels,
            buckets=_N_BUCKETS, registry=reg)
        self.request_params_max_tokens = Histogram(
            self.name("request_params_max_tokens"), "The max_tokens parameter of each finished "
            "request (unset: max_model_len less the prompt).", labels,
            buckets=token_buckets(max_model_len), registry=reg)
        self.request_max_num_generation_tokens = Histogram(
            self.name("request_max_num_generation_tokens"), "The most tokens one choice of "
            "each finished request generated.", labels, buckets=token_buckets(max_model_len),
            registry=reg)
        # vLLM's count: per engine step, the prompt of each choice that got its first token
        # (the whole prompt, cached or not) and the tokens generated.
        self.iteration_tokens = Histogram(
            self.name("iteration_tokens_total"), "Tokens of each engine step: the prompts of "
            "the choices that got their first token, and the tokens generated.", labels,
            buckets=_ITERATION_TOKENS_BUCKETS, registry=reg)
        self.max_model_len = max_model_len
        self.rejected = Counter(
            self.name("request_rejected"), "Requests refused or cut short by a limit: "
            "overloaded (503 past --max-waiting-requests) or timeout (--request-timeout).",
            labels + ["reason"], registry=reg)
        # Create the labelled series now, so that they read 0 (not absent) before the first
        # request finishes: a client diffing the counters sees 0 tokens, not a missing metric.
        for metric in (self.prompt_tokens, self.request_prompt_tokens,
                       self.request_generation_tokens, self.ttft, self.e2e, *self.phases,
                       self.request_tpot, self.iteration_tokens,
                       self.request_params_n, self.request_params_max_tokens,
                       self.request_max_num_generation_tokens):
            metric.labels(*self.label_values)
        # The series recorded once per output, looked up once.
        self._generation_tokens = self.generation_tokens.labels(*self.label_values)
        self._inter_token = self.inter_token.labels(*self.label_values)
        self._time_per_output_token = self.time_per_output_token.labels(*self.label_values)
        for reason in ("overloaded", "timeout"):
            self.rejected.labels(*self.label_values, reason)
        if cache_config:
            info = Gauge(self.name("cache_config_info"), "The KV cache's configuration "
                         "(labels); the value is 1.", [*cache_config, *labels], registry=reg)
            info.labels(*cache_config.values(), *self.label_values).set(1)

    def name(self, base: str) -> str:
        """The exposed name of metric ``base`` (module docstring)."""
        return f"{self.prefix if base in VLLM_NAMES else 'jaxserve'}:{base}"

    def update_stats(self, stats: SchedulerStats) -> None:
        self.stats, self.stats_time = stats, time.time()

    def engine_down(self) -> None:
        """The engine process died: nothing runs, waits or holds KV pages any more."""
        s, b = self.stats, self.dead_engines_totals
        self.dead_engines_totals = SchedulerStats(
            num_preemptions_total=b.num_preemptions_total + s.num_preemptions_total,
            prefix_cache_queries=b.prefix_cache_queries + s.prefix_cache_queries,
            prefix_cache_hits=b.prefix_cache_hits + s.prefix_cache_hits,
            prompt_tokens_computed=b.prompt_tokens_computed + s.prompt_tokens_computed,
            spec_decoding=b.spec_decoding.plus(s.spec_decoding))
        self.stats = SchedulerStats()
        self.engine_alive = False

    def engine_up(self, restarts: int) -> None:
        """A restarted engine is serving; ``restarts`` counts restarts so far."""
        self.engine_alive = True
        self.engine_restarts = restarts

    def record_rejected(self, reason: str) -> None:
        self.rejected.labels(*self.label_values, reason).inc()

    def record_first_token(self, ttft_s: float) -> None:
        """A request's first token arrived ``ttft_s`` seconds after the request."""
        self.ttft.labels(*self.label_values).observe(ttft_s)

    def record_output(self, num_tokens: int, gap_s: float | None) -> None:
        """A choice's new tokens arrived, ``gap_s`` seconds after its previous ones (None for
        its first): generated tokens, and one inter-token latency value per engine output after
        the first (as vLLM records it)."""
        self._generation_tokens.inc(num_tokens)
        if gap_s is not None:
            self._inter_token.observe(gap_s)
            self._time_per_output_token.observe(gap_s)

    def record_iteration(self, num_tokens: int) -> None:
        """An engine step's outputs came: ``num_tokens`` as ``iteration_tokens_total`` counts
        them."""
        self.iteration_tokens.labels(*self.label_values).observe(num_tokens)

    def record_phases(self, queue_s: float, prefill_s: float, decode_s: float,
                      num_tokens: int) -> None:
        """A choice of ``num_tokens`` generated tokens ended: its queue, prefill and decode
        phases, seconds (the engine's clock), and its time per output token after the first
        (vLLM's mean_time_per_output_token)."""
        v = self.label_values
        for hist, value in zip(self.phases, (queue_s, prefill_s, decode_s, prefill_s + decode_s)):
            hist.labels(*v).observe(value)
        if num_tokens > 1:
            self.request_tpot.labels(*v).observe(decode_s / (num_tokens - 1))

    def record_finished(self, finish_reason: str, prompt_tokens: int, output_tokens: list[int],
                        e2e_s: float, max_tokens: int | None) -> None:
        """A request ended with ``finish_reason``, ``e2e_s`` seconds after it arrived, with
        ``output_tokens`` generated by each of its choices (their tokens were counted as they
        arrived: here only the per-request histograms); ``max_tokens``: its parameter (None:
        up to max_model_len)."""
        v = self.label_values
        self.request_success.labels(*v, finish_reason).inc()
        self.prompt_tokens.labels(*v).inc(prompt_tokens)
        self.request_prompt_tokens.labels(*v).observe(prompt_tokens)
        self.request_generation_tokens.labels(*v).observe(sum(output_tokens))
        self.e2e.labels(*v).observe(e2e_s)
        self.request_params_n.labels(*v).observe(len(output_tokens))
        self.request_params_max_tokens.labels(*v).observe(
            self.max_model_len - prompt_tokens if max_tokens is None else max_tokens)
        self.request_max_num_generation_tokens.labels(*v).observe(max(output_tokens))

    def render(self) -> bytes:
        return generate_latest(self.registry)
