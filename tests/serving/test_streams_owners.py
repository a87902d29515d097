"""/v1/tokenflow/streams shows a tenant's key its own streams only: an admin key, or anyone on
an open server, sees every one.  The serving layer claims each engine request for the key that
sent it and forgets it once the request is released."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from tests.serving.live_server import serve_in_thread
from tokenflow.serving.app import build_app
from tokenflow.serving.config import ServerConfig
from tokenflow.serving.owners import StreamOwners

STREAMS = "/v1/tokenflow/streams"
KEYED = ServerConfig(api_keys=("a", "b"), admin_api_keys=("ops",))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def shown(app, key: str | None, limit: int = 64) -> tuple[list[str], int]:
    """The stream ids `key` is shown, and the total of unfinished streams it is told."""
    headers = bearer(key) if key else {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        response = await http.get(STREAMS, params={"limit": limit}, headers=headers)
    assert response.status_code == 200, response.text
    data = response.json()
    return [s["id"] for s in data["streams"]], data["totals"]["num_unfinished"]


def app_with_streams(config: ServerConfig):
    """An app whose engine has four streams in flight: two of key a, one of b, one of no key."""
    engine = FakeEngine()
    engine.active_ids[:] = ["a-1", "b-1", "a-2", "keyless"]
    app = build_app(engine, config)
    owners: StreamOwners = app.state.serving.stream_owners
    for request_id, key in (("a-1", "a"), ("b-1", "b"), ("a-2", "a"), ("keyless", None)):
        owners.claim(request_id, key)
    return app


@pytest.mark.anyio
async def test_a_tenant_sees_its_own_streams_and_an_admin_every_one():
    app = app_with_streams(KEYED)
    assert await shown(app, "a") == (["a-1", "a-2"], 4)  # the totals are the server's
    assert await shown(app, "b") == (["b-1"], 4)
    assert await shown(app, "a", limit=1) == (["a-1"], 4)  # the most urgent of its own
    assert await shown(app, "ops") == (["a-1", "b-1", "a-2", "keyless"], 4)


@pytest.mark.anyio
async def test_on_an_open_server_everyone_sees_every_stream():
    app = app_with_streams(ServerConfig())
    for key in (None, "a", "b"):
        assert await shown(app, key) == (["a-1", "b-1", "a-2", "keyless"], 4)


def test_owners_forget_and_never_match_no_key():
    owners = StreamOwners()
    owners.claim("r", "a")
    owners.claim("anonymous", None)
    assert owners.is_owned_by("r", "a") and not owners.is_owned_by("r", "b")
    assert not owners.is_owned_by("anonymous", None) and not owners.is_owned_by("other", None)
    owners.forget("r")
    owners.forget("r")
    assert not owners.is_owned_by("r", "a") and owners.num_claimed == 0


def streams_of(http: httpx.Client, url: str, key: str) -> set[str]:
    response = http.get(url + STREAMS, headers=bearer(key))
    assert response.status_code == 200, response.text
    return {s["id"] for s in response.json()["streams"]}


def test_requests_in_flight_are_their_keys_streams_until_released():
    gate = threading.Event()
    engine = FakeEngine(gate=gate, gate_at_token=1)  # every stream waits at its 2nd token
    app = build_app(engine, KEYED)
    body = {"prompt": "x", "max_tokens": 3, "stream": True}
    completions = "/v1/completions"
    with serve_in_thread(app) as url, httpx.Client(timeout=60) as http:
        two = {**body, "n": 2}  # two engine requests, `{id}-0` and `{id}-1`
        with http.stream("POST", url + completions, json=two, headers=bearer("a")) as first:
            assert first.status_code == 200  # headers at once: both choices in flight
            with http.stream("POST", url + completions, json=body, headers=bearer("b")) as other:
                assert other.status_code == 200
                seen = {key: streams_of(http, url, key) for key in ("a", "b", "ops")}
                gate.set()
                other.read()
            first.read()
    submitted = [request_id for request_id, _, _ in engine.submitted]
    assert seen["a"] == set(submitted[:2]) and seen["b"] == {submitted[2]}
    assert seen["ops"] == set(submitted)
    # (each stream was released before its `[DONE]` was sent)
    assert app.state.serving.stream_owners.num_claimed == 0 and not engine.active_ids
