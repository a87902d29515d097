"""GET /v1/tokenflow/streams and the Grafana dashboard against a real server on the tiny model:
the API-key guard, every field and its type, the bounds, states changing under a burst that
does not fit the device tier, and that every series the dashboard plots exists in /metrics."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest

from tests.serving.bursts import burst_in_thread, burst_spec
from tests.serving.live_server import serve_in_thread, wait_until
from tokenflow.engine.async_engine import AsyncEngine
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.serving.app import build_app
from tokenflow.serving.config import ServerConfig

API_KEY = "secret-key"  # the burst's: a tenant's key, which sees its own streams only
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN_AUTH = {"Authorization": "Bearer admin-key"}  # sees every stream: the engine's view
GRAFANA_JSON = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tokenflow.json"
# 8 readers of 24 + 128 tokens (10 blocks each) where the device tier holds 32 blocks: about
# three fit at full length, so streams with buffered reading are paused for the others.
BURST = burst_spec(num_requests=8, output_tokens=128, rate_tps=16)
STREAM_FIELDS = {
    "id": str,
    "stream_class": str,
    "state": str,
    "kv_on_host": bool,
    "wait_reason": (str, type(None)),
    "num_output_tokens": int,
    "num_consumed_tokens": int,
    "slack_s": float,
    "age_s": float,
    "num_preemptions": int,
}


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    args = EngineArgs(
        model=tiny_model_dir,
        device="cpu",
        policy="tokenflow",
        device_kv_tokens=32 * 16,
        max_model_len=512,
    )
    engine = AsyncEngine(args)
    config = ServerConfig(api_keys=(API_KEY,), admin_api_keys=("admin-key",))
    with serve_in_thread(build_app(engine, config)) as url:
        warm_up(url)
        yield engine, url
    engine.close()


def warm_up(url: str) -> None:
    """One short request first: the first decode compiles a kernel (seconds with a cold
    compiler cache), during which the loop answers no snapshot."""
    body = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=600)
    assert response.status_code == 200, response.text


def get_streams(url: str, limit: int | None = None) -> dict:
    params = {} if limit is None else {"limit": limit}
    response = httpx.get(
        f"{url}/v1/tokenflow/streams", params=params, headers=ADMIN_AUTH, timeout=60
    )
    assert response.status_code == 200, response.text
    return response.json()


def is_idle(url: str) -> bool:
    return get_streams(url)["totals"]["num_unfinished"] == 0


def test_the_endpoint_is_behind_the_api_key(served):
    _, url = served
    assert httpx.get(f"{url}/v1/tokenflow/streams", timeout=60).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    response = httpx.get(f"{url}/v1/tokenflow/streams", headers=wrong, timeout=60)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_an_idle_server_answers_every_engine_field(served):
    engine, url = served
    assert wait_until(lambda: is_idle(url))
    data = get_streams(url)
    assert data["object"] == "tokenflow.streams" and data["policy"] == "tokenflow"
    assert isinstance(data["capacity_tps"], float) and data["capacity_tps"] > 0
    assert data["demand_tps"] == 0 and data["streams"] == []
    assert data["asked_tps"] == 0 and data["is_overloaded"] is False
    assert data["num_readers"] == data["num_served_readers"] == 0
    kv, stats = engine.engine.scheduler.kv.config, engine.stats()  # (idle: no step changes it)
    assert data["kv"] == {
        "device_used_blocks": 0,
        "device_total_blocks": kv.num_device_blocks,
        "device_cached_blocks": stats.num_cached_device_blocks,
        "host_used_blocks": 0,
        "host_total_blocks": kv.num_host_blocks,
        "host_cached_blocks": stats.num_cached_host_blocks,
    }
    prefix = data["prefix_cache"]
    assert prefix["queried_tokens_total"] == stats.prefix_cache_queries_total
    assert prefix["device_hit_tokens_total"] == stats.prefix_cache_hits_total
    assert prefix["host_hit_tokens_total"] == stats.prefix_cache_host_hits_total
    assert set(data["totals"].values()) == {0}
    for name in ("num_preemptions_total", "num_loads_total", "num_recomputes_total"):
        assert isinstance(data[name], int)


@pytest.mark.parametrize("limit", [-1, 513, "many"])
def test_a_limit_out_of_bounds_is_a_400(served, limit):
    _, url = served
    response = httpx.get(
        f"{url}/v1/tokenflow/streams", params={"limit": limit}, headers=AUTH, timeout=60
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "limit"


def check_stream(stream: dict) -> None:
    """Every field present, typed, and consistent with the others."""
    for name, kind in STREAM_FIELDS.items():
        assert isinstance(stream[name], kind), (name, stream)
    assert stream["stream_class"] == "reader" and stream["rate_tps"] == 16
    assert stream["state"] in ("waiting", "running", "loading", "paused")
    assert 0 <= stream["num_consumed_tokens"] <= stream["num_output_tokens"]
    if stream["num_output_tokens"]:
        assert stream["ttft_s"] >= 0 and stream["stall_s"] >= 0 and stream["buffer_s"] >= 0
    else:
        assert stream["ttft_s"] is None and stream["stall_s"] is None
        assert stream["buffer_s"] == 0


def poll_during(url: str, future) -> list[tuple[dict, dict]]:
    """(all streams, the 3 most urgent) answers, every 50 ms until the burst has ended."""
    answers = []
    while not future.done():
        answers.append((get_streams(url, 64), get_streams(url, 3)))
        time.sleep(0.05)  # (a poll's pace, not a synchronization: the loop ends on the future)
    return answers


def test_a_burst_moves_streams_between_states_within_the_bounds(served):
    _, url = served
    assert wait_until(lambda: is_idle(url))
    with burst_in_thread(url, BURST, API_KEY) as future:
        answers = poll_during(url, future)
    assert future.result().num_failed == 0
    assert answers
    seen_states: dict[str, list[str]] = {}
    for everyone, urgent in answers:
        for data in (everyone, urgent):
            unfinished = data["totals"]["num_unfinished"]
            assert len(data["streams"]) == min(unfinished, 64 if data is everyone else 3)
            slacks = [s["slack_s"] for s in data["streams"]]
            assert slacks == sorted(slacks)  # the most urgent first
        for stream in everyone["streams"]:
            check_stream(stream)
            states = seen_states.setdefault(stream["id"], [])
            if not states or states[-1] != stream["state"]:
                states.append(stream["state"])
    assert max(e["totals"]["num_unfinished"] for e, _ in answers) > 3  # totals count them all
    # (whether some wait depends on how the arrivals fall between decisions; that the device
    # tier cannot hold them all as they grow does not)
    assert any(e["totals"]["num_paused"] for e, _ in answers)
    assert any("paused" in states[1:] for states in seen_states.values())
    last = answers[-1][0]
    assert last["num_preemptions_total"] > 0 and last["last_moves"] is not None
    assert any(e["demand_tps"] > 0 for e, _ in answers)


def grafana_metric_names() -> set[str]:
    """Every tokenflow_* name in the dashboard's queries and variables."""
    dashboard = json.loads(GRAFANA_JSON.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"]]
    return {name for expr in exprs for name in re.findall(r"\btokenflow_[a-z_]+", expr)}


def test_every_series_of_the_grafana_dashboard_is_exported(served):
    _, url = served
    body = {"prompt": "Hello", "max_tokens": 4, "stream": True, "stream_rate": 8}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200  # (so the latency histograms have series)
    exposition = httpx.get(f"{url}/metrics", headers=AUTH, timeout=60).text  # (keys: guarded)
    exported = set(re.findall(r"^(tokenflow_[a-z_]+)", exposition, flags=re.MULTILINE))
    used = grafana_metric_names()
    assert {
        "tokenflow_time_to_first_token_seconds_bucket",
        "tokenflow_capacity_tokens_per_second",
        "tokenflow_reading_demand_tokens_per_second",
        "tokenflow_preemptions_total",
        "tokenflow_device_kv_usage_ratio",
    } <= used
    assert used - exported == set()
    capacity = re.search(r"^tokenflow_capacity_tokens_per_second (\S+)$", exposition, re.M)
    assert capacity is not None and float(capacity.group(1)) > 0
