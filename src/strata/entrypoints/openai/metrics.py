"""Prometheus metrics of the server, named like vLLM's (`strata:` instead of `vllm:`).

Each app gets its own registry, so several servers in one process (tests) never collide. Engine gauges
and counters are read from the engine's stats snapshot at scrape time, one series per data-parallel
replica (`replica="0"` for a single engine); latencies are observed by the serving layer as outputs reach
the event loop, which is what a client sees.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from strata.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# The engine's own counters, exported as Prometheus counters under vLLM's names: stats key -> name, help.
_ENGINE_COUNTERS = {
    "num_preemptions": (
        "strata:num_preemptions",
        "Sequences preempted (their KV blocks freed, to recompute).",
    ),
    "prefix_cache_queries": ("strata:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("strata:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
}


def replica_stats(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """Each replica's stats: a data-parallel engine lists them under "replicas", one engine is replica 0."""
    return stats.get("replicas", [stats])


class _EngineCounters(Collector):
    """Reads the engine's monotonic counters from its latest stats snapshot at each scrape."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        for key, (name, documentation) in _ENGINE_COUNTERS.items():
            family = CounterMetricFamily(name, documentation, labels=["model_name", "replica"])
            for index, stats in enumerate(replica_stats(self.stats)):
                family.add_metric([self.model_name, str(index)], stats.get(key, 0))
            yield family


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels

        def engine_gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, [*labels, "replica"], registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.http_requests = Counter(
            "strata:http_requests",
            "HTTP requests by endpoint and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.request_success = Counter(
            "strata:request_success",
            "Generation requests by finish reason (stop, length, abort).",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "strata:prompt_tokens", "Prompt tokens processed.", list(labels), registry=self.registry
        )
        self.generation_tokens = Counter(
            "strata:generation_tokens", "Tokens generated.", list(labels), registry=self.registry
        )
        self.num_running = engine_gauge("strata:num_requests_running", "Sequences in the running batch.")
        self.num_waiting = engine_gauge("strata:num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_cache_usage = engine_gauge(
            "strata:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)."
        )
        self.forward_passes = engine_gauge("strata:num_forward_passes", "Forward passes run by the engine.")
        self.ttft = histogram("strata:time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("strata:inter_token_latency_seconds", "Time between a request's outputs.")
        self.e2e = histogram("strata:e2e_request_latency_seconds", "Arrival to finish of a request.")
        self._engine_counters = _EngineCounters(model_name)
        self.registry.register(self._engine_counters)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(**self._labels).observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.labels(**self._labels).observe(seconds)

    def observe_finished(self, seconds: float, num_prompt_tokens: int, last: RequestOutput | None) -> None:
        """Count a request that ended (finished, failed or aborted) with its last output."""
        reason = "abort"
        if last is not None and last.finished and last.outputs[0].finish_reason is not None:
            reason = last.outputs[0].finish_reason
        generated = sum(len(c.token_ids) for c in last.outputs) if last is not None else 0
        self.request_success.labels(**self._labels, finished_reason=reason).inc()
        self.prompt_tokens.labels(**self._labels).inc(num_prompt_tokens)
        self.generation_tokens.labels(**self._labels).inc(generated)
        self.e2e.labels(**self._labels).observe(seconds)

    def render(self, stats: dict[str, Any]) -> bytes:
        """The Prometheus text exposition, with engine gauges taken from `stats` now."""
        for index, replica in enumerate(replica_stats(stats)):
            labels = {**self._labels, "replica": str(index)}
            self.num_running.labels(**labels).set(replica["num_running"])
            self.num_waiting.labels(**labels).set(replica["num_waiting"])
            self.kv_cache_usage.labels(**labels).set(replica["kv_cache_usage"])
            self.forward_passes.labels(**labels).set(replica["num_forward_passes"])
        self._engine_counters.stats = stats
        return generate_latest(self.registry)
