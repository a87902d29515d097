"""Prometheus metrics of one server: engine gauges read at scrape time, latencies observed by the
serving layer.

Every app owns its own `CollectorRegistry` (no process-wide default registry), so two apps in one
process — tests, or one server per policy — never share or clash on series.  Our names start
with `tokenflow_`; vLLM's series under vLLM's names (`vllm:*`, vllm_metrics.py) are fed from the
same calls and the same engine snapshot.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from tokenflow.engine.client import EngineClient, EngineStats
from tokenflow.serving.vllm_metrics import VllmMetrics, engine_metrics

# Time to first token spans queueing in a burst (tens of seconds in the paper's baselines).
TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 1.3, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
# Inter-token gaps: a decode step (ms) up to a preemption plateau (seconds).
INTER_TOKEN_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.0667, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Buffer slack thresholds (seconds of reading left) for the per-scrape stream counts.
SLACK_THRESHOLDS_S = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class EngineStatsCollector(Collector):
    """Turns one `EngineClient.stats()` snapshot per scrape into gauges and counters, ours and
    vLLM's."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        """Called by the registry on every scrape."""
        stats = self._engine.stats()
        yield _gauge(
            "tokenflow_num_requests_waiting", "Requests queued, never started.", stats.num_waiting
        )
        yield _gauge(
            "tokenflow_num_requests_running", "Requests with KV on the device.", stats.num_running
        )
        yield _gauge(
            "tokenflow_num_requests_preempted",
            "Requests paused off the device.",
            stats.num_preempted,
        )
        yield _gauge(
            "tokenflow_device_kv_usage_ratio",
            "Fraction of device KV blocks in use.",
            stats.device_kv_usage,
        )
        yield _gauge(
            "tokenflow_host_kv_usage_ratio",
            "Fraction of host KV blocks in use.",
            stats.host_kv_usage,
        )
        yield from _prefix_cache_metrics(stats)
        yield _counter(
            "tokenflow_preemptions", "Preemptions since start.", stats.num_preemptions_total
        )
        yield _counter(
            "tokenflow_kv_loads", "Host-to-device KV loads since start.", stats.num_loads_total
        )
        yield _counter(
            "tokenflow_recomputes",
            "Resumptions by recompute since start.",
            stats.num_recomputes_total,
        )
        yield from _slack_metrics(stats.buffer_slack_s)
        yield from engine_metrics(stats, self._engine.model_name)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _prefix_cache_metrics(stats: EngineStats) -> Iterator[Metric]:
    """vLLM's prefix-cache series (prompt tokens queried, and hit), the hits and the cached
    blocks labelled by KV tier: the hit rate is sum(hits) / queries."""
    yield _counter(
        "tokenflow_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries).",
        stats.prefix_cache_queries_total,
    )
    hits = CounterMetricFamily(
        "tokenflow_prefix_cache_hits",
        "Prompt tokens found in the prefix cache, their KV reused, by the tier that held it.",
        labels=["tier"],
    )
    hits.add_metric(["device"], stats.prefix_cache_hits_total)
    hits.add_metric(["host"], stats.prefix_cache_host_hits_total)
    yield hits
    blocks = GaugeMetricFamily(
        "tokenflow_prefix_cache_blocks",
        "KV blocks the prefix cache keys (held by requests or cached-free), by tier.",
        labels=["tier"],
    )
    blocks.add_metric(["device"], stats.num_cached_device_blocks)
    blocks.add_metric(["host"], stats.num_cached_host_blocks)
    yield blocks


def _slack_metrics(slack_s: Sequence[float]) -> Iterator[Metric]:
    """Snapshot of the running streams' buffer slack: min/mean/max and counts under thresholds.

    A histogram would be wrong here (its buckets must only grow); these are gauges of the present.
    """
    summary = GaugeMetricFamily(
        "tokenflow_buffer_slack_seconds",
        "Seconds of reading left in running streams' buffers (0 when no stream runs).",
        labels=["stat"],
    )
    values = sorted(slack_s)
    summary.add_metric(["min"], values[0] if values else 0.0)
    summary.add_metric(["mean"], math.fsum(values) / len(values) if values else 0.0)
    summary.add_metric(["max"], values[-1] if values else 0.0)
    yield summary
    below = GaugeMetricFamily(
        "tokenflow_buffer_slack_streams",
        "Running streams whose buffer slack is at most `le` seconds.",
        labels=["le"],
    )
    for threshold_s in SLACK_THRESHOLDS_S:
        below.add_metric([_format_le(threshold_s)], sum(1 for v in values if v <= threshold_s))
    below.add_metric(["+Inf"], len(values))
    yield below


def _format_le(value: float) -> str:
    return repr(float(value))


def _nan_gauge(name: str, documentation: str, registry: CollectorRegistry) -> Gauge:
    """A gauge set from the scheduler snapshots (serving/streams.py), which /metrics refreshes;
    NaN until the first one."""
    gauge = Gauge(name, documentation, registry=registry)
    gauge.set(math.nan)
    return gauge


class ServingMetrics:
    """The metrics of one app; the serving layer reports into it, /metrics renders it.  Each
    method feeds our series and vLLM's (`self.vllm`) from the one event."""

    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.vllm = VllmMetrics(self.registry, engine.model_name)
        by_class = ["stream_class"]  # reader, eager, batch (serving/classes.py)
        self._ttft = Histogram(
            "tokenflow_time_to_first_token_seconds",
            "From request receipt to the first token's delta.",
            labelnames=by_class,
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self._inter_token = Histogram(
            "tokenflow_inter_token_seconds",
            "Gap before each later token (a delta of k tokens: its gap, then k-1 zeros).",
            labelnames=by_class,
            buckets=INTER_TOKEN_BUCKETS_S,
            registry=self.registry,
        )
        self._e2e = Histogram(
            "tokenflow_e2e_latency_seconds",
            "From request receipt to its last token (what a batch request is judged by).",
            labelnames=by_class,
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self._finished = Counter(
            "tokenflow_requests_finished",
            "Requests ended, by finish reason (stop, length, abort, error).",
            labelnames=["finish_reason"],
            registry=self.registry,
        )
        self._http_errors = Counter(
            "tokenflow_http_errors",
            "Error responses, by HTTP status.",
            labelnames=["status"],
            registry=self.registry,
        )
        self._capacity = _nan_gauge(
            "tokenflow_capacity_tokens_per_second",
            "Gamma: tokens/s the engine generates at the feasible batch (NaN before a snapshot).",
            self.registry,
        )
        self._demand = _nan_gauge(
            "tokenflow_reading_demand_tokens_per_second",
            "Tokens/s the started streams ask (a reader its rate, an eager stream one share).",
            self.registry,
        )
        self._asked = _nan_gauge(
            "tokenflow_reading_asked_tokens_per_second",
            "Tokens/s every unfinished request asks, a reader's rate whole (above the capacity "
            "the engine is overloaded).",
            self.registry,
        )
        self.registry.register(EngineStatsCollector(engine))

    def observe_ttft(
        self,
        seconds: float,
        stream_class: str,
        *,
        num_prompt_tokens: int,
        num_cached_tokens: int,
    ) -> None:
        """Record one request's first token: its time from receipt, and its prompt of
        `num_prompt_tokens` (`num_cached_tokens` of them from the prefix cache).

        Every output token is recorded once, here (the first) or by `observe_inter_token`
        (each later one), which is what counts vLLM's generated tokens."""
        seconds = max(seconds, 0.0)
        self._ttft.labels(stream_class=stream_class).observe(seconds)
        self.vllm.observe_first_token(seconds, num_prompt_tokens, num_cached_tokens)

    def observe_e2e(self, seconds: float, stream_class: str) -> None:
        """Record one request's time from receipt to its last token."""
        seconds = max(seconds, 0.0)
        self._e2e.labels(stream_class=stream_class).observe(seconds)
        self.vllm.observe_e2e(seconds)

    def observe_inter_token(self, gap_s: float, num_tokens: int, stream_class: str) -> None:
        """Record a delta of `num_tokens` tokens that arrived `gap_s` after the previous one
        (the first of them after `gap_s`, the others after none)."""
        if num_tokens <= 0:
            return
        gaps_s = [max(gap_s, 0.0)] + [0.0] * (num_tokens - 1)
        histogram = self._inter_token.labels(stream_class=stream_class)
        for gap in gaps_s:
            histogram.observe(gap)
        self.vllm.observe_later_tokens(gaps_s)

    def observe_capacity(self, capacity_tps: float, demand_tps: float, asked_tps: float) -> None:
        """Record the engine's capacity Gamma, the readers' demand and what every request
        asks, all tokens/s."""
        self._capacity.set(capacity_tps)
        self._demand.set(demand_tps)
        self._asked.set(asked_tps)

    def count_finished(self, finish_reason: str) -> None:
        """Count a request that ended: an engine finish reason, "abort" or "error"."""
        self._finished.labels(finish_reason=finish_reason).inc()
        self.vllm.count_finished(finish_reason)

    def count_http_error(self, status_code: int) -> None:
        """Count an error response."""
        self._http_errors.labels(status=str(status_code)).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
