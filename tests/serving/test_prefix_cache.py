"""The prefix cache through the server: OpenAI's `prompt_cache_key` becomes the engine request's
session hint (the fake engine, then the core `Request` of a real one), a key over its bound is a
400 naming it, and /metrics and /v1/tokenflow/streams carry the cache's hits and blocks per tier
as the engine reports them."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from tests.serving.live_server import serve_in_thread
from tokenflow.core.request import Request
from tokenflow.engine.async_engine import AsyncEngine
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.serving.app import build_app
from tokenflow.serving.protocol import MAX_PROMPT_CACHE_KEY_CHARS
from tokenflow.serving.streams import prefix_hit_rate

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BODIES = {
    CHAT: {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3},
    COMPLETIONS: {"prompt": "hi there", "max_tokens": 3},
}
KEY = "conversation-7"


def body_of(path: str, stream: bool, **extra: object) -> dict:
    return {**BODIES[path], "stream": stream, **extra}


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
async def test_prompt_cache_key_is_the_engine_requests_session_key(
    engine: FakeEngine, client: httpx.AsyncClient, path: str, stream: bool
):
    response = await client.post(path, json=body_of(path, stream, prompt_cache_key=KEY))
    assert response.status_code == 200, response.text
    response = await client.post(path, json=body_of(path, stream))
    assert response.status_code == 200, response.text
    assert engine.session_keys == [KEY, None]


@pytest.mark.anyio
async def test_every_choice_of_a_request_carries_its_key(
    engine: FakeEngine, client: httpx.AsyncClient
):
    body = {"prompt": ["a b", "c d"], "n": 2, "max_tokens": 2, "prompt_cache_key": KEY}
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    assert engine.session_keys == [KEY] * 4


@pytest.mark.anyio
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
async def test_a_key_over_its_bound_is_a_400_naming_it(
    engine: FakeEngine, client: httpx.AsyncClient, path: str
):
    longest = "k" * MAX_PROMPT_CACHE_KEY_CHARS
    response = await client.post(path, json=body_of(path, False, prompt_cache_key=longest))
    assert response.status_code == 200, response.text
    too_long = longest + "k"
    response = await client.post(path, json=body_of(path, True, prompt_cache_key=too_long))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt_cache_key" and "1024" in error["message"]
    response = await client.post(path, json=body_of(path, False, prompt_cache_key=7))
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_cache_key"
    assert engine.session_keys == [longest]  # the refused ones never reached the engine


@pytest.mark.anyio
async def test_metrics_carry_queries_and_hits_and_cached_blocks_per_tier(
    client: httpx.AsyncClient,
):
    # FakeEngine.stats(): 40 tokens queried, 24 found on the device and 8 in the host tier;
    # 3 device and 2 host blocks keyed.
    text = (await client.get("/metrics")).text
    lines = set(text.splitlines())
    assert {
        "tokenflow_prefix_cache_queries_total 40.0",
        'tokenflow_prefix_cache_hits_total{tier="device"} 24.0',
        'tokenflow_prefix_cache_hits_total{tier="host"} 8.0',
        'tokenflow_prefix_cache_blocks{tier="device"} 3.0',
        'tokenflow_prefix_cache_blocks{tier="host"} 2.0',
    } <= lines
    assert "tokenflow_prefix_cache_hits_total 24.0" not in lines  # no unlabelled series left
    assert "# TYPE tokenflow_prefix_cache_blocks gauge" in lines


@pytest.mark.anyio
async def test_the_streams_endpoint_carries_cached_blocks_and_the_hit_rate(
    client: httpx.AsyncClient,
):
    data = (await client.get("/v1/tokenflow/streams")).json()
    # FakeEngine.streams(): the same counts as its stats
    assert data["kv"]["device_cached_blocks"] == 3 and data["kv"]["host_cached_blocks"] == 2
    assert data["prefix_cache"] == {
        "queried_tokens_total": 40,
        "device_hit_tokens_total": 24,
        "host_hit_tokens_total": 8,
        "hit_rate": 0.8,  # (24 + 8) / 40
    }


def test_the_hit_rate_is_hits_over_queries_and_none_before_a_lookup():
    assert prefix_hit_rate(40, 32) == 0.8
    assert prefix_hit_rate(16, 0) == 0.0
    assert prefix_hit_rate(0, 0) is None


# -- the real engine (tiny model): the key reaches the core's Request ----------------------------
@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """A live server on the tiny model whose engine records each core Request's session key
    as it is added (on the engine thread)."""
    engine = AsyncEngine(EngineArgs(model=tiny_model_dir, device="cpu", max_model_len=256))
    session_keys: dict[str, str | None] = {}
    add = engine.engine.core.add_request

    def recording(request: Request) -> None:
        session_keys[request.request_id] = request.session_key
        add(request)

    engine.engine.core.add_request = recording  # type: ignore[method-assign]
    with serve_in_thread(build_app(engine)) as url:
        yield url, session_keys
    engine.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_the_core_request_holds_the_key(served, path: str, stream: bool):
    url, session_keys = served
    key = f"session-{path}-{stream}"
    response = httpx.post(f"{url}{path}", json=body_of(path, stream, prompt_cache_key=key))
    assert response.status_code == 200, response.text
    if stream:
        first = response.text.split("\n\n")[0].removeprefix("data: ")
        request_id = json.loads(first)["id"]
    else:
        request_id = response.json()["id"]
    assert session_keys[request_id] == key
    response = httpx.post(f"{url}{path}", json=body_of(path, stream))
    assert response.status_code == 200, response.text
    assert list(session_keys.values())[-1] is None
