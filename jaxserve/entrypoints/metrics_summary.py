"""GET /metrics/summary: the metrics behind GET /metrics as one small JSON object, for the
dashboard at / (docs/architecture.md, "The playground"), which then parses no Prometheus text.

Every value is read from the Metrics registry's ``collect()`` when asked: the samples /metrics
renders, summed over their labels (finish reasons), with no state of its own, under whichever
names the registry uses (``jaxserve:<name>``, or ``vllm:<name>`` for vLLM's metrics with
``--metrics-prefix vllm``: jaxserve/metrics.py). Like /metrics it needs no API key, and before
the engine's first start it answers 503.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict

from aiohttp import web
from prometheus_client import CollectorRegistry

from jaxserve.entrypoints.app_state import LLM_KEY
from jaxserve.entrypoints.errors import APIError
from jaxserve.metrics import METRICS_PREFIXES

# The names' prefixes, any of which a registry's name may carry (jaxserve/metrics.py).
_PREFIXES = tuple(f"{prefix}:" for prefix in METRICS_PREFIXES)


def _base_name(name: str) -> str:
    """A sample's name without its metrics prefix."""
    prefix = next((p for p in _PREFIXES if name.startswith(p)), "")
    return name.removeprefix(prefix)


def _histogram(values: dict[str, float], buckets: dict[float, float], name: str) -> dict:
    """A histogram's buckets, not cumulative: ``counts[i]`` observations in (le[i-1], le[i]]
    and ``counts[-1]`` above the last bound (JSON has no infinity, so ``le`` omits +Inf)."""
    bounds = sorted(b for b in buckets if not math.isinf(b))
    cumulative = [buckets[b] for b in bounds] + [values.get(f"{name}_count", 0.0)]
    counts = [int(c - prev) for c, prev in zip(cumulative, [0.0] + cumulative[:-1])]
    return {"le": bounds, "counts": counts, "count": int(cumulative[-1]),
            "sum": values.get(f"{name}_sum", 0.0)}


def summarize(registry: CollectorRegistry, now: float) -> dict:
    """The dashboard's view of ``registry`` (a ``jaxserve.metrics.Metrics.registry``).

    Returns a dict: ``time`` (``now``, Unix seconds: the page divides counter deltas by its
    deltas), ``engine_alive`` (bool), ``requests_running`` and ``requests_waiting`` (requests),
    ``kv_cache_usage`` (fraction 0..1 of the usable KV pages), ``prefix_cache_queries`` and
    ``prefix_cache_hits`` (prompt tokens, since start), ``prefix_cache_hit_rate`` (their ratio,
    None before any query), ``requests_finished`` (all finish reasons), ``prompt_tokens`` and
    ``generation_tokens`` (tokens, since start), ``preemptions``, and the histograms
    ``time_to_first_token_seconds`` and ``inter_token_latency_seconds`` (``_histogram``'s
    form; bounds and sums in seconds).
    """
    values: dict[str, float] = defaultdict(float)  # sample name -> sum over its label sets
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for family in registry.collect():
        for s in family.samples:
            name = _base_name(s.name)
            if name.endswith("_bucket"):
                buckets[name.removesuffix("_bucket")][float(s.labels["le"])] += s.value
            elif not name.endswith("_created"):  # creation times do not add up
                values[name] += s.value
    queries, hits = values["prefix_cache_queries_total"], values["prefix_cache_hits_total"]
    hist = {name: _histogram(values, buckets[name], name)
            for name in ("time_to_first_token_seconds", "inter_token_latency_seconds")}
    return {
        "time": now,
        "engine_alive": values["engine_alive"] == 1,
        "requests_running": int(values["num_requests_running"]),
        "requests_waiting": int(values["num_requests_waiting"]),
        "kv_cache_usage": values["kv_cache_usage_perc"],
        "prefix_cache_queries": int(queries),
        "prefix_cache_hits": int(hits),
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "requests_finished": int(values["request_success_total"]),
        "prompt_tokens": int(values["prompt_tokens_total"]),
        "generation_tokens": int(values["generation_tokens_total"]),
        "preemptions": int(values["num_preemptions_total"]),
        **hist,
    }


async def metrics_summary(request: web.Request) -> web.Response:
    """GET /metrics/summary: ``summarize`` of the server's metrics; 503 before they exist."""
    metrics = request.app[LLM_KEY].metrics
    if metrics is None:
        raise APIError(503, "the engine is still starting; retry when GET /health answers 200",
                       code="engine_unavailable")
    return web.json_response(summarize(metrics.registry, time.time()))
