"""vLLM's series in /metrics (serving/vllm_metrics.py): names, types, labels and buckets, and
the amounts they move by for a request whose tokens are known."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.serving.fake_engine import FakeEngine
from tokenflow.engine.client import EngineStats
from tokenflow.serving.app import build_app
from tokenflow.serving.classes import Stated
from tokenflow.serving.metrics import ServingMetrics
from tokenflow.serving.openai_serving import OpenAIServing
from tokenflow.serving.protocol import CompletionRequest
from tokenflow.serving.vllm_metrics import (
    INTER_TOKEN_LATENCY_BUCKETS_S,
    REQUEST_LATENCY_BUCKETS_S,
    TIME_TO_FIRST_TOKEN_BUCKETS_S,
    engine_metrics,
)

pytestmark = pytest.mark.anyio

LABELS = {"model_name": "fake-model", "engine": "0"}
# Exposed family name (counters without `_total`, as the parser names them) -> type.
EXPORTED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:prompt_tokens_cached": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}
BUCKETS = {
    "vllm:time_to_first_token_seconds": TIME_TO_FIRST_TOKEN_BUCKETS_S,
    "vllm:inter_token_latency_seconds": INTER_TOKEN_LATENCY_BUCKETS_S,
    "vllm:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS_S,
}


async def scrape_after(engine: FakeEngine, body: dict[str, object]) -> dict[str, list[Sample]]:
    """Serve `body` on a fresh app over `engine`, then its /metrics: vllm families' samples."""
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        text = (await http.get("/metrics")).text
    # (prometheus_client writes each counter's and histogram's `_created` as a gauge of its own,
    # in vLLM's /metrics too)
    families = text_string_to_metric_families(text)
    return {
        f.name: f
        for f in families
        if f.name.startswith("vllm:") and not f.name.endswith("_created")
    }  # type: ignore[misc]


async def never_disconnects() -> None:
    await asyncio.Event().wait()


def value(samples: list[Sample], name: str, **labels: str) -> float:
    """The one sample named `name` with these labels besides model_name and engine."""
    wanted = {**LABELS, **labels}
    (found,) = [s.value for s in samples if s.name == name and s.labels == wanted]
    return found


async def test_names_types_and_labels_after_a_request() -> None:
    families = await scrape_after(FakeEngine(), {"prompt": "one two three", "max_tokens": 4})
    assert {name: f.type for name, f in families.items()} == EXPORTED  # type: ignore[attr-defined]
    for name, family in families.items():
        for sample in family.samples:  # type: ignore[attr-defined]
            extra = set(sample.labels) - set(LABELS)
            assert {k: sample.labels[k] for k in LABELS} == LABELS, sample
            assert extra <= {"le", "finished_reason"}, sample
            assert ("finished_reason" in extra) == (name == "vllm:request_success"), sample


async def test_histogram_buckets_are_vllms() -> None:
    families = await scrape_after(FakeEngine(), {"prompt": "a", "max_tokens": 1})
    for name, buckets in BUCKETS.items():
        samples = families[name].samples  # type: ignore[attr-defined]
        bounds = [s.labels["le"] for s in samples if s.name == f"{name}_bucket"]
        assert bounds == [*(repr(float(b)) for b in buckets), "+Inf"], name


async def test_counters_move_by_the_requests_tokens() -> None:
    # 3 prompt words are 3 tokens; 5 output tokens in deltas of 2, 2 and 1.
    engine = FakeEngine(tokens_per_delta=2)
    families = await scrape_after(engine, {"prompt": "one two three", "max_tokens": 5})
    samples = [s for f in families.values() for s in f.samples]  # type: ignore[attr-defined]
    assert value(samples, "vllm:prompt_tokens_total") == 3
    assert value(samples, "vllm:prompt_tokens_cached_total") == 0
    assert value(samples, "vllm:generation_tokens_total") == 5
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 1
    for reason in ("stop", "abort", "error"):
        assert value(samples, "vllm:request_success_total", finished_reason=reason) == 0
    assert value(samples, "vllm:time_to_first_token_seconds_count") == 1
    assert value(samples, "vllm:inter_token_latency_seconds_count") == 4  # one per later token
    assert value(samples, "vllm:e2e_request_latency_seconds_count") == 1
    # The engine gauges come from FakeEngine.stats(): nothing in flight after the request.
    assert value(samples, "vllm:num_requests_running") == 0
    assert value(samples, "vllm:kv_cache_usage_perc") == 0.25
    assert value(samples, "vllm:num_preemptions_total") == 3


async def test_latencies_are_the_same_observations_as_ours() -> None:
    engine = FakeEngine()
    times = iter([10.0, 12.5, 13.0, 13.25])  # receipt, then each of 3 tokens
    metrics = ServingMetrics(engine)
    serving = OpenAIServing(engine, metrics, clock=lambda: next(times), wall_clock=lambda: 99.0)
    body = CompletionRequest(prompt="a", max_tokens=3)
    await serving.create_completion(body, Stated(), never_disconnects)
    text = metrics.render()[0].decode()
    labels = 'engine="0",model_name="fake-model"'
    assert f"vllm:time_to_first_token_seconds_sum{{{labels}}} 2.5" in text
    assert f"vllm:inter_token_latency_seconds_sum{{{labels}}} 0.75" in text
    assert f"vllm:e2e_request_latency_seconds_sum{{{labels}}} 3.25" in text


def test_cached_prompt_tokens_are_counted_apart() -> None:
    metrics = ServingMetrics(FakeEngine())
    metrics.observe_ttft(0.1, "eager", num_prompt_tokens=40, num_cached_tokens=32)
    metrics.observe_inter_token(0.02, 3, "eager")
    served = metrics.vllm.tokens_served()
    assert served.num_prompt_tokens == 40
    assert served.num_cached_prompt_tokens == 32
    assert served.num_computed_prompt_tokens == 8
    assert served.num_generation_tokens == 4  # the first token and 3 later ones


def test_waiting_counts_paused_streams() -> None:
    stats = EngineStats(
        num_waiting=2,
        num_running=4,
        num_preempted=3,
        device_kv_usage=0.75,
        host_kv_usage=0.0,
        num_preemptions_total=9,
        num_loads_total=0,
        num_recomputes_total=0,
        buffer_slack_s=(),
    )
    got = {m.name: m.samples[0].value for m in engine_metrics(stats, "m")}
    assert got == {
        "vllm:num_requests_running": 4,
        "vllm:num_requests_waiting": 5,  # 2 queued + 3 paused
        "vllm:kv_cache_usage_perc": 0.75,
        "vllm:num_preemptions": 9,
    }
