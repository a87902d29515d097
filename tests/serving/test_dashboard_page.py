"""/dashboard serves one self-contained page, and the streams watch shares its snapshots: many
pollers cost the engine one snapshot per interval (the fake engine counts them)."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from tokenflow.serving.app import build_app
from tokenflow.serving.config import ServerConfig
from tokenflow.serving.metrics import ServingMetrics
from tokenflow.serving.streams import StreamsWatch

pytestmark = pytest.mark.anyio


async def test_the_page_is_served_and_fetches_nothing_from_elsewhere(client: httpx.AsyncClient):
    response = await client.get("/dashboard")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert "/v1/tokenflow/streams" in page and "<canvas" in page
    assert re.findall(r"""(?:src|href)=["']?(?:https?:)?//""", page) == []
    assert "Bearer" in page  # (the key of `?key=` goes in the Authorization header)


async def test_the_page_is_not_behind_the_api_key(engine: FakeEngine):
    app = build_app(engine, ServerConfig(api_keys=("k",)))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        assert (await http.get("/dashboard")).status_code == 200
        assert (await http.get("/v1/tokenflow/streams")).status_code == 401
        headers = {"Authorization": "Bearer k"}
        assert (await http.get("/v1/tokenflow/streams", headers=headers)).status_code == 200


async def test_pollers_share_one_snapshot_per_interval(engine: FakeEngine):
    now = [0.0]
    watch = StreamsWatch(engine, ServingMetrics(engine), interval_s=0.25, clock=lambda: now[0])
    await asyncio.gather(*(watch.latest(64) for _ in range(10)))
    assert engine.num_snapshots == 1
    await watch.latest(8)  # fewer streams: the same snapshot serves
    assert engine.num_snapshots == 1
    await watch.latest(128)  # more than it listed: a new one
    assert engine.num_snapshots == 2
    now[0] = 0.3
    await watch.latest(8)
    assert engine.num_snapshots == 3


async def test_metrics_carry_the_capacity_and_demand_of_a_snapshot(client: httpx.AsyncClient):
    text = (await client.get("/metrics")).text
    assert "tokenflow_capacity_tokens_per_second 100.0" in text
    assert "tokenflow_reading_demand_tokens_per_second 0.0" in text
    assert "tokenflow_reading_asked_tokens_per_second 0.0" in text
