"""Prometheus metrics for ``GET /metrics`` (docs/architecture.md, "Engine stats").

Engine gauges come from the latest SchedulerStats the engine sent over the pipe (it sends them
with every step and whenever they change while idle); request counters and histograms are
recorded by the API process's OutputProcessor. Generated tokens, time to first token and
inter-token latency are recorded as the tokens arrive (as vLLM does), so that a dashboard polling
them sees a long request's progress, not one jump when it ends; an aborted request's tokens count
too. Each Metrics object has its own registry.

When the engine process dies its gauges drop to 0 (nothing runs any more) and
``jaxserve:engine_alive`` reads 0 until a restarted engine is ready; the engine's cumulative
counters (preemptions, prefix cache) carry the dead engine's totals over, so they never go back.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.engine import SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Finer at the low end: a GPU decode step takes milliseconds.
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineStatsCollector:
    def __init__(self, metrics: "Metrics"):
        self.metrics = metrics

    def collect(self):
        s = self.metrics.stats
        labels = ["model_name"]
        name = [self.metrics.model_name]

        def gauge(metric, doc, value):
            g = GaugeMetricFamily(metric, doc, labels=labels)
            g.add_metric(name, value)
            return g

        def counter(metric, doc, value):
            c = CounterMetricFamily(metric, doc, labels=labels)
            c.add_metric(name, value)
            return c

        yield gauge("jaxserve:num_requests_running", "Requests in the engine's running batch.",
                    s.num_running_reqs)
        yield gauge("jaxserve:num_requests_waiting", "Requests waiting to be scheduled.",
                    s.num_waiting_reqs)
        yield gauge("jaxserve:kv_cache_usage_perc",
                    "Fraction of usable KV pages referenced by live requests (0..1).",
                    s.kv_cache_usage)
        base = self.metrics.dead_engines_totals
        yield counter("jaxserve:num_preemptions", "Requests preempted (recompute).",
                      base.num_preemptions_total + s.num_preemptions_total)
        yield counter("jaxserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      base.prefix_cache_queries + s.prefix_cache_queries)
        yield counter("jaxserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      base.prefix_cache_hits + s.prefix_cache_hits)
        yield counter("jaxserve:prompt_tokens_computed", "Prompt tokens whose K/V the engine "
                      "computed (prefix-cache hits and the shared prompt of a request's other "
                      "choices excluded; recomputation after preemption included).",
                      base.prompt_tokens_computed + s.prompt_tokens_computed)
        yield gauge("jaxserve:engine_alive", "1 while the engine process serves, 0 after it died "
                    "(until a restarted one is ready).", 1 if self.metrics.engine_alive else 0)
        yield counter("jaxserve:engine_restarts", "Times the engine process was restarted after "
                      "it died.", self.metrics.engine_restarts)


class Metrics:
    """The server's metrics. ``render()`` gives the Prometheus text exposition."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats = SchedulerStats()
        self.dead_engines_totals = SchedulerStats()  # cumulative counters of engines that died
        self.engine_alive = True
        self.engine_restarts = 0
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(self))
        labels = ["model_name"]
        self.request_success = Counter(
            "jaxserve:request_success", "Finished requests, by finish reason.",
            labels + ["finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter("jaxserve:prompt_tokens", "Prompt tokens of finished "
                                     "requests (once per request, whatever its n).",
                                     labels, registry=self.registry)
        self.generation_tokens = Counter("jaxserve:generation_tokens",
                                         "Generated tokens, counted as they arrive.",
                                         labels, registry=self.registry)
        self.ttft = Histogram("jaxserve:time_to_first_token_seconds",
                              "Time from arrival to the first token, seconds.", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("jaxserve:inter_token_latency_seconds",
                             "Time between a sequence's consecutive outputs (one step's new "
                             "tokens), seconds.", labels, buckets=_ITL_BUCKETS,
                             registry=self.registry)
        self.e2e = Histogram("jaxserve:e2e_request_latency_seconds",
                             "Time from arrival to the last token, seconds.", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.rejected = Counter(
            "jaxserve:request_rejected", "Requests refused or cut short by a limit: overloaded "
            "(503 past --max-waiting-requests) or timeout (--request-timeout).",
            labels + ["reason"], registry=self.registry)
        # Create the labelled series now, so that they read 0 (not absent) before the first
        # request finishes: a client diffing the counters sees 0 tokens, not a missing metric.
        for metric in (self.prompt_tokens, self.ttft, self.e2e):
            metric.labels(model_name)
        # The series recorded once per output, looked up once.
        self._generation_tokens = self.generation_tokens.labels(model_name)
        self._itl = self.itl.labels(model_name)
        for reason in ("overloaded", "timeout"):
            self.rejected.labels(model_name, reason)

    def update_stats(self, stats: SchedulerStats) -> None:
        self.stats = stats

    def engine_down(self) -> None:
        """The engine process died: nothing runs, waits or holds KV pages any more."""
        s, b = self.stats, self.dead_engines_totals
        self.dead_engines_totals = SchedulerStats(
            num_preemptions_total=b.num_preemptions_total + s.num_preemptions_total,
            prefix_cache_queries=b.prefix_cache_queries + s.prefix_cache_queries,
            prefix_cache_hits=b.prefix_cache_hits + s.prefix_cache_hits,
            prompt_tokens_computed=b.prompt_tokens_computed + s.prompt_tokens_computed)
        self.stats = SchedulerStats()
        self.engine_alive = False

    def engine_up(self, restarts: int) -> None:
        """A restarted engine is serving; ``restarts`` counts restarts so far."""
        self.engine_alive = True
        self.engine_restarts = restarts

    def record_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def record_first_token(self, ttft_s: float) -> None:
        """A request's first token arrived ``ttft_s`` seconds after the request."""
        self.ttft.labels(self.model_name).observe(ttft_s)

    def record_output(self, num_tokens: int, gap_s: float | None) -> None:
        """A sequence's new tokens arrived, ``gap_s`` seconds after its previous ones (None for
        its first)."""
        self._generation_tokens.inc(num_tokens)
        if gap_s is not None:
            self._itl.observe(gap_s)

    def record_finished(self, finish_reason: str, prompt_tokens: int, e2e_s: float) -> None:
        """A request ended with ``finish_reason``, ``e2e_s`` seconds after it arrived."""
        m = self.model_name
        self.request_success.labels(m, finish_reason).inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.e2e.labels(m).observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
