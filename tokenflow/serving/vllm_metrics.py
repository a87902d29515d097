"""vLLM's Prometheus series beside ours, so that dashboards, autoscaling rules and alerts written
for `vllm serve` work unchanged against `tokenflow serve`.

Names, types, documentation, label names and histogram buckets are those of vLLM 0.32.0's
`PrometheusStatLogger` (vllm/v1/metrics/loggers.py); tests_vllm/test_vllm_metric_names.py checks
them against the installed vLLM.  The labels are `model_name` (the served model's name) and
`engine` ("0": one engine, as a single vLLM engine labels itself).

Nothing here measures anything: `ServingMetrics` feeds these series from the same calls that
feed its `tokenflow_*` ones, and the engine series come from the same `EngineStats` snapshot
per scrape.  What each means here:

- `vllm:num_requests_running`: requests with their KV on the device (running or loading back).
- `vllm:num_requests_waiting`: requests queued, never started, plus those paused off the device.
  vLLM has no pause; it counts the requests it preempted as waiting, and ours are the same kind
  of request (started, then taken off the device until the scheduler brings them back).
- `vllm:kv_cache_usage_perc`: device KV blocks in use / all device blocks, 0..1 as vLLM's.
- `vllm:num_preemptions_total`: streams taken off the device (paused or preempted) since start.
- token counters and latency histograms: counted as each delta reaches the serving layer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenflow.engine.client import EngineStats

ENGINE_INDEX = "0"  # the `engine` label: vLLM numbers its data-parallel engines from 0
LABEL_NAMES = ("model_name", "engine")
# The finish reasons whose `vllm:request_success_total` series exist from the start, as vLLM
# makes one per FinishReason (its "repetition" is never ours).
FINISHED_REASONS = ("stop", "length", "abort", "error")

# vLLM 0.32.0's bucket families (vllm/v1/metrics/buckets.py), so that quantiles compare.
TIME_TO_FIRST_TOKEN_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# Exposed sample names of the counters the stats log line reads back (prometheus_client adds
# `_total` to a counter's name).
PROMPT_TOKENS_SAMPLE = "vllm:prompt_tokens_total"
PROMPT_TOKENS_CACHED_SAMPLE = "vllm:prompt_tokens_cached_total"
GENERATION_TOKENS_SAMPLE = "vllm:generation_tokens_total"


@dataclass(frozen=True)
class TokensServed:
    """Token counts since start, as the vLLM counters hold them."""

    num_prompt_tokens: int
    num_cached_prompt_tokens: int  # of them, KV taken from the prefix cache
    num_generation_tokens: int

    @property
    def num_computed_prompt_tokens(self) -> int:
        """Prompt tokens prefilled (vLLM's log line counts these: cached ones cost nothing)."""
        return self.num_prompt_tokens - self.num_cached_prompt_tokens

    def since(self, earlier: TokensServed) -> TokensServed:
        """The counts between `earlier` and these."""
        return TokensServed(
            num_prompt_tokens=self.num_prompt_tokens - earlier.num_prompt_tokens,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens
            - earlier.num_cached_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens - earlier.num_generation_tokens,
        )


class VllmMetrics:
    """vLLM's per-request series of one app, registered in its registry; `ServingMetrics`
    calls these methods from its own."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._registry = registry
        self.label_values = {"model_name": model_name, "engine": ENGINE_INDEX}
        self._prompt_tokens = self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self._cached_prompt_tokens = self._counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self._generation_tokens = self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self._request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labelnames=[*LABEL_NAMES, "finished_reason"],
            registry=registry,
        )
        for reason in FINISHED_REASONS:
            self._request_success.labels(model_name, ENGINE_INDEX, reason)
        self._ttft = self._histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS_S,
        )
        self._inter_token = self._histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS_S,
        )
        self._e2e = self._histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS_S,
        )

    def _counter(self, name: str, documentation: str) -> Counter:
        counter = Counter(name, documentation, labelnames=LABEL_NAMES, registry=self._registry)
        return counter.labels(**self.label_values)

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        histogram = Histogram(
            name, documentation, labelnames=LABEL_NAMES, buckets=buckets, registry=self._registry
        )
        return histogram.labels(**self.label_values)

    def observe_first_token(
        self, ttft_s: float, num_prompt_tokens: int, num_cached_tokens: int
    ) -> None:
        """A request's first token: its TTFT, its prompt counted (as vLLM counts a prompt in
        the step that produced its first token) and the first generated token."""
        self._ttft.observe(ttft_s)
        self._prompt_tokens.inc(num_prompt_tokens)
        self._cached_prompt_tokens.inc(num_cached_tokens)
        self._generation_tokens.inc()

    def observe_later_tokens(self, gaps_s: Sequence[float]) -> None:
        """Tokens after the first, each `gaps_s[i]` after the one before it."""
        for gap_s in gaps_s:
            self._inter_token.observe(gap_s)
        self._generation_tokens.inc(len(gaps_s))

    def observe_e2e(self, seconds: float) -> None:
        """A request's time from receipt to its last token."""
        self._e2e.observe(seconds)

    def count_finished(self, finish_reason: str) -> None:
        """A request that ended, whatever the reason (vLLM counts aborts and errors too)."""
        values = self.label_values
        self._request_success.labels(finished_reason=finish_reason, **values).inc()

    def tokens_served(self) -> TokensServed:
        """The token counters' values now."""
        return TokensServed(
            num_prompt_tokens=self._sample(PROMPT_TOKENS_SAMPLE),
            num_cached_prompt_tokens=self._sample(PROMPT_TOKENS_CACHED_SAMPLE),
            num_generation_tokens=self._sample(GENERATION_TOKENS_SAMPLE),
        )

    def _sample(self, name: str) -> int:
        return int(self._registry.get_sample_value(name, self.label_values) or 0)


def vllm_num_waiting(stats: EngineStats) -> int:
    """vLLM's waiting requests: ours queued, and paused (see the module doc)."""
    return stats.num_waiting + stats.num_preempted


def engine_metrics(stats: EngineStats, model_name: str) -> Iterator[Metric]:
    """vLLM's scheduler gauges and preemption counter from one `EngineStats` snapshot."""
    labels = [model_name, ENGINE_INDEX]
    running = GaugeMetricFamily(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        labels=LABEL_NAMES,
    )
    running.add_metric(labels, stats.num_running)
    yield running
    waiting = GaugeMetricFamily(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        labels=LABEL_NAMES,
    )
    waiting.add_metric(labels, vllm_num_waiting(stats))
    yield waiting
    usage = GaugeMetricFamily(
        "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=LABEL_NAMES
    )
    usage.add_metric(labels, stats.device_kv_usage)
    yield usage
    preemptions = CounterMetricFamily(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        labels=LABEL_NAMES,
    )
    preemptions.add_metric(labels, stats.num_preemptions_total)
    yield preemptions
