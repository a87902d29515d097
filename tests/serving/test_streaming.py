"""Streaming and non-streaming answers: SSE framing, chunk shapes, usage, finish reasons."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from tokenflow.serving.app import build_app

pytestmark = pytest.mark.anyio


def parse_sse(raw: str) -> list[str]:
    """Split an SSE body into `data:` payloads, checking the exact framing on the way."""
    assert raw.endswith("data: [DONE]\n\n")
    frames = raw.split("\n\n")
    assert frames[-1] == ""
    payloads = []
    for frame in frames[:-1]:
        assert frame.startswith("data: "), frame
        assert "\n" not in frame
        payloads.append(frame[len("data: ") :])
    assert payloads[-1] == "[DONE]"
    assert "[DONE]" not in payloads[:-1]
    return payloads[:-1]


def chunks_of(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return [json.loads(p) for p in parse_sse(response.text)]


async def test_chat_stream_frames_role_content_and_finish(client: httpx.AsyncClient) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    chunks = chunks_of(await client.post("/v1/chat/completions", json=body))
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 4
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["model"] == "fake-model" and isinstance(c["created"], int) for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:]] == [" t0", " t1", " t2"]
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons == [None, None, None, "length"]
    assert all("usage" not in c for c in chunks)


async def test_completion_stream_with_usage_chunk(client: httpx.AsyncClient) -> None:
    body = {
        "model": "fake-model",
        "prompt": "a b c d",
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = chunks_of(await client.post("/v1/completions", json=body))
    assert [c["object"] for c in chunks] == ["text_completion"] * 3
    assert [c["choices"][0]["text"] for c in chunks[:2]] == [" t0", " t1"]
    assert chunks[1]["choices"][0]["finish_reason"] == "length"
    assert chunks[2]["choices"] == []
    assert chunks[2]["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_stop_finish_reasons_come_from_the_engine() -> None:
    engine = FakeEngine(eos_after=2)
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        body = {"prompt": "x", "max_tokens": 10, "stream": True}
        chunks = chunks_of(await http.post("/v1/completions", json=body))
        assert "".join(c["choices"][0]["text"] for c in chunks) == " t0 t1"
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        # ignore_eos + min_tokens run to max_tokens, ending by length.
        body = {"prompt": "x", "max_tokens": 5, "ignore_eos": True}
        answer = (await http.post("/v1/completions", json=body)).json()
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 5
        body = {"prompt": "x", "max_tokens": 5, "min_tokens": 4}
        answer = (await http.post("/v1/completions", json=body)).json()
        assert answer["choices"][0]["text"] == " t0 t1 t2 t3"
        assert answer["choices"][0]["finish_reason"] == "stop"
    assert engine.submitted[1][1].ignore_eos is True
    assert engine.submitted[2][1].min_tokens == 4


async def test_stop_string_cuts_text(client: httpx.AsyncClient) -> None:
    body = {"prompt": "x", "max_tokens": 10, "stop": ["t3"], "stream": True}
    chunks = chunks_of(await client.post("/v1/completions", json=body))
    assert "".join(c["choices"][0]["text"] for c in chunks) == " t0 t1 t2 "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_non_streaming_bodies(client: httpx.AsyncClient) -> None:
    answer = await client.post("/v1/completions", json={"prompt": "one two", "max_tokens": 2})
    assert answer.status_code == 200
    data = answer.json()
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    assert data["choices"] == [
        {"index": 0, "text": " t0 t1", "logprobs": None, "finish_reason": "length"}
    ]
    assert data["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "total_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        "max_completion_tokens": 1,
    }
    data = (await client.post("/v1/chat/completions", json=body)).json()
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": " t0"}
    assert data["choices"][0]["finish_reason"] == "length"


async def test_max_tokens_defaults_to_rest_of_context(engine: FakeEngine) -> None:
    engine.max_model_len = 12
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        data = (await http.post("/v1/completions", json={"prompt": "a b c"})).json()
    assert data["usage"]["completion_tokens"] == 9
    assert engine.submitted[0][1].max_tokens == 9


async def test_rate_resolution_body_then_header_then_default_class(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    body = {"prompt": "x", "max_tokens": 1, "stream": True}
    await client.post("/v1/completions", json={**body, "stream_rate": 7.5})
    await client.post(
        "/v1/completions", json={**body, "stream_rate": 7}, headers={"X-Stream-Rate": "9"}
    )
    await client.post("/v1/completions", json=body, headers={"X-Stream-Rate": "12.5"})
    await client.post("/v1/completions", json=body)  # states nothing: eager, reads at once
    await client.post("/v1/completions", json={**body, "stream_class": "reader"})
    rates = [rate for _, _, rate in engine.submitted]
    assert rates == [7.5, 7.0, 12.5, math.inf, 20.0]


async def test_multi_token_deltas_with_continuous_usage() -> None:
    engine = FakeEngine(tokens_per_delta=3)
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        body = {
            "prompt": "x",
            "max_tokens": 7,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        chunks = chunks_of(await http.post("/v1/completions", json=body))
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == [3, 6, 7, 7]
    assert chunks[-1]["choices"] == []


async def test_engine_failure_mid_stream_ends_with_error_frame(caplog) -> None:
    engine = FakeEngine(fail_after_tokens=2)
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        body = {"prompt": "x", "max_tokens": 10, "stream": True}
        chunks = chunks_of(await http.post("/v1/completions", json=body))
        metrics = (await http.get("/metrics")).text
    assert [c["choices"][0]["text"] for c in chunks[:2]] == [" t0", " t1"]
    error = chunks[-1]["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and "server log" in error["message"]
    # the exception's own text goes to the log, never to the client
    assert "fake engine failure" not in error["message"]
    assert "fake engine failure" in caplog.text
    assert 'tokenflow_requests_finished_total{finish_reason="error"} 1.0' in metrics


async def test_models_health_and_metrics(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "fake-model"
    assert models["data"][0]["object"] == "model"
    assert "kernels" not in models["data"][0]  # an engine without a kernel plan shows none
    assert (await client.get("/health")).status_code == 200
    await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    await client.post("/v1/completions", json={"prompt": "x", "n": 200})  # a 400: n <= 128
    response = await client.get("/metrics")
    assert response.status_code == 200
    text = response.text
    for name in (
        "tokenflow_num_requests_waiting",
        "tokenflow_num_requests_running",
        "tokenflow_num_requests_preempted",
        "tokenflow_device_kv_usage_ratio 0.25",
        "tokenflow_host_kv_usage_ratio 0.5",
        "tokenflow_preemptions_total 3.0",
        "tokenflow_kv_loads_total 2.0",
        "tokenflow_recomputes_total 1.0",
        'tokenflow_buffer_slack_seconds{stat="min"}',
        'tokenflow_buffer_slack_streams{le="+Inf"}',
        'tokenflow_time_to_first_token_seconds_count{stream_class="batch"} 1.0',
        'tokenflow_inter_token_seconds_count{stream_class="batch"} 1.0',
        'tokenflow_e2e_latency_seconds_count{stream_class="batch"} 1.0',
        'tokenflow_requests_finished_total{finish_reason="length"} 1.0',
        'tokenflow_http_errors_total{status="400"} 1.0',
    ):
        assert name in text, name


async def test_two_apps_have_separate_registries() -> None:
    apps = [build_app(FakeEngine()), build_app(FakeEngine())]
    transport = httpx.ASGITransport(app=apps[0])
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert apps[0].state.metrics.registry is not apps[1].state.metrics.registry
    assert b'_count{stream_class="batch"} 1.0' in apps[0].state.metrics.render()[0]
    assert b"tokenflow_time_to_first_token_seconds_count" not in apps[1].state.metrics.render()[0]
