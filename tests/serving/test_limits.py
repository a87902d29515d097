"""Hostile values are 400s at the API, bodies are size-limited (413), and /health tells a dead
or stalled engine loop (503)."""

from __future__ import annotations

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from tests.serving.test_errors import assert_error
from tokenflow.serving.app import build_app
from tokenflow.serving.config import ServerConfig

pytestmark = pytest.mark.anyio

COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -1e-40}, "temperature"),
        ({"stream_rate": 1e308}, "stream_rate"),
        ({"stream_rate": 0.0}, "stream_rate"),
        ({"seed": 1 << 70}, "seed"),
        ({"seed": -(1 << 64)}, "seed"),
        ({"stop": ["s"] * 17}, "stop"),
        ({"stop": "x" * 257}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [1 << 20]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1 << 40}, "max_tokens"),
        ({"prompt": [1, 1 << 20]}, "prompt"),
        ({"prompt": [-5]}, "prompt"),
    ],
)
async def test_out_of_range_values_are_400(
    client: httpx.AsyncClient, extra: dict, param: str
) -> None:
    body = {"prompt": "x", "max_tokens": 3, **extra}
    assert_error(await client.post(COMPLETIONS, json=body), 400, param)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"stop": ["s"] * 17}, "at most 16 items"),
        ({"stop": "x" * 257}, "at most 256 characters"),
        ({"stop": ["ok", ""]}, "stop.1: String should have at least 1 character"),
        ({"prompt": [3, -5]}, "prompt.1: Input should be greater than or equal to 0"),
    ],
)
async def test_a_union_field_names_the_bound_it_broke(
    client: httpx.AsyncClient, extra: dict, words: str
) -> None:
    # `stop` is a string or a list of them: the error is the broken bound, not "not a string".
    body = {"prompt": "x", "max_tokens": 3, **extra}
    assert words in assert_error(await client.post(COMPLETIONS, json=body), 400)["message"]


async def test_a_tiny_temperature_means_greedy(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    body = {"prompt": "x", "max_tokens": 3, "temperature": 1e-40, "seed": -(1 << 63)}
    assert (await client.post(COMPLETIONS, json=body)).status_code == 200
    assert engine.submitted[0][1].temperature == 0.0


async def test_a_body_over_the_limit_is_413_before_parsing() -> None:
    app = build_app(FakeEngine(), ServerConfig(max_body_bytes=4096))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        big = b'{"prompt": "' + b"x" * 5000 + b'"}'
        headers = {"content-type": "application/json"}
        assert_error(await http.post(COMPLETIONS, content=big, headers=headers), 413)

        async def chunks():
            for _ in range(10):
                yield b"x" * 1000  # no Content-Length: counted as it arrives

        assert_error(await http.post(COMPLETIONS, content=chunks(), headers=headers), 413)
        ok = await http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200


@pytest.mark.parametrize(
    ("death", "since_tick", "status"),
    [(None, 0.0, 200), ("the engine loop died: boom", 0.0, 503), (None, 31.0, 503)],
)
async def test_health_reports_the_engine_loop(
    death: str | None, since_tick: float, status: int
) -> None:
    engine = FakeEngine(death=death, seconds_since_tick=since_tick)
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        response = await http.get("/health")
    assert response.status_code == status
    assert response.json()["status"] == {200: "ok", 503: "dead" if death else "stalled"}[status]
