"""Each API key's share of the engine (tokenflow/serving/tenants.py): work counted as the engine
counts it, bounded per key, and the engine's slots shared by service received under contention."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from tests.serving.live_server import serve_in_thread
from tokenflow.serving.app import build_app
from tokenflow.serving.config import ServerConfig
from tokenflow.serving.tenants import ANONYMOUS, KeyGate, KeyLedger, KeyLimits, Work
from tokenflow.serving.validation import ApiError

COMPLETIONS = "/v1/completions"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- the rule, on hand-built states ---------------------------------------------------------------
def test_a_key_is_bounded_by_choices_and_by_tokens_in_flight():
    ledger = KeyLedger(KeyLimits(max_choices=4, max_tokens=100))
    ledger.enter("a")
    ledger.take("a", Work(num_choices=3, num_tokens=60))
    assert ledger.over_limit("a", Work(1, 40)) is None
    assert "4 completions" in ledger.over_limit("a", Work(2, 10))
    assert "100 tokens" in ledger.over_limit("a", Work(1, 41))
    assert ledger.over_limit("b", Work(4, 100)) is None  # another key has its own bounds
    assert ledger.over_limit("b", Work(5, 1), at_all=True) is not None  # can never fit
    assert ledger.over_limit(ANONYMOUS, Work(50, 10_000)) is None  # no key: no per-key bound


def test_an_idle_key_is_lifted_to_the_least_active_counter():
    ledger = KeyLedger(KeyLimits())
    ledger.enter("a")
    ledger.take("a", Work(1, 500))
    ledger.enter("b")
    ledger.take("b", Work(1, 200))
    ledger.give_back("b", Work(1, 200), num_tokens_used=200)  # b is idle again
    ledger.enter("c")  # a newcomer banks no credit for having been away
    assert ledger.served_tokens("c") == 500


def test_unused_tokens_are_refunded_at_release():
    ledger = KeyLedger(KeyLimits())
    ledger.enter("a")
    ledger.take("a", Work(1, 300))
    ledger.enter("a")
    ledger.take("a", Work(1, 300))
    ledger.give_back("a", Work(1, 300), num_tokens_used=100)
    assert ledger.served_tokens("a") == 400
    assert ledger.in_flight("a") == (1, 300)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_a_freed_slot_goes_to_the_key_served_least():
    gate = KeyGate(KeyLimits(capacity_choices=2, queue_timeout_s=60))
    heavy_1 = await gate.admit("heavy", Work(1, 1000))
    heavy_2 = await gate.admit("heavy", Work(1, 1000))
    waiting_heavy = asyncio.ensure_future(gate.admit("heavy", Work(1, 10)))
    await asyncio.sleep(0)  # (it is queued: the engine is full)
    waiting_light = asyncio.ensure_future(gate.admit("light", Work(1, 10)))
    await asyncio.sleep(0)
    assert gate.num_waiting == 2
    heavy_1.release(1000)
    light = await waiting_light  # arrived later, but its key has been served least
    assert light.key == "light" and not waiting_heavy.done()
    heavy_2.release(1000)
    assert (await waiting_heavy).key == "heavy"


@pytest.mark.anyio
async def test_a_request_waits_no_longer_than_the_queue_timeout():
    gate = KeyGate(KeyLimits(capacity_choices=1, queue_timeout_s=0.01))
    held = await gate.admit("a", Work(1, 1))
    with pytest.raises(ApiError) as refused:
        await gate.admit("b", Work(1, 1))
    assert refused.value.status_code == 429 and "waited" in refused.value.info.message
    assert gate.num_waiting == 0 and gate.ledger.in_flight("b") == (0, 0)
    held.release(1)
    assert gate.ledger.num_choices_in_flight == 0


@pytest.mark.anyio
async def test_a_cancelled_waiter_leaves_no_trace():
    gate = KeyGate(KeyLimits(capacity_choices=1, queue_timeout_s=60))
    held = await gate.admit("a", Work(1, 1))
    waiter = asyncio.ensure_future(gate.admit("b", Work(1, 1)))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.num_waiting == 0
    held.release(1)
    again = await gate.admit("c", Work(1, 1))
    assert gate.ledger.num_choices_in_flight == 1
    again.release(1)


# -- the server counts engine work, not HTTP requests -------------------------------------------
def test_n_counts_against_a_keys_limit_before_anything_starts():
    engine = FakeEngine()
    config = ServerConfig(api_keys=("a",), max_requests_per_key=2)
    body = {"prompt": "x", "max_tokens": 2, "n": 4}
    with serve_in_thread(build_app(engine, config)) as url, httpx.Client(timeout=60) as http:
        refused = http.post(url + COMPLETIONS, json=body, headers=bearer("a"))
        lists = {"prompt": ["x", "y", "z"], "max_tokens": 2}
        refused_list = http.post(url + COMPLETIONS, json=lists, headers=bearer("a"))
        fits = http.post(url + COMPLETIONS, json={**body, "n": 2}, headers=bearer("a"))
    assert refused.status_code == 429 and "2 completions" in refused.json()["error"]["message"]
    assert refused_list.status_code == 429
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 2
    assert len(engine.submitted) == 2  # the refused ones started nothing


def test_tokens_in_flight_count_prompt_and_max_tokens():
    engine = FakeEngine()
    config = ServerConfig(api_keys=("a",), max_tokens_per_key=20)
    with serve_in_thread(build_app(engine, config)) as url, httpx.Client(timeout=60) as http:
        big = {"prompt": "one two three", "max_tokens": 18}  # 3 + 18 = 21 tokens
        refused = http.post(url + COMPLETIONS, json=big, headers=bearer("a"))
        fits = http.post(url + COMPLETIONS, json={**big, "max_tokens": 17}, headers=bearer("a"))
    assert refused.status_code == 429 and "20 tokens" in refused.json()["error"]["message"]
    assert fits.status_code == 200


def test_a_key_at_its_bound_leaves_the_engine_to_the_others():
    """The reported case: a key allowed 2 in flight asked for 128 completions and held every
    engine slot; the other key's one-token request was refused."""
    release = threading.Event()
    engine = FakeEngine(gate=release, gate_at_token=1, max_num_requests=8)
    config = ServerConfig(api_keys=("hog", "other"), max_requests_per_key=2)
    body = {"prompt": "x", "max_tokens": 3, "stream": True}
    hog_headers, other_body = bearer("hog"), {"prompt": "y", "max_tokens": 1}
    with (
        serve_in_thread(build_app(engine, config)) as url,
        httpx.Client(timeout=60) as http,
        http.stream("POST", url + COMPLETIONS, json=body, headers=hog_headers) as held,
    ):
        assert held.status_code == 200
        hog = http.post(url + COMPLETIONS, json={**body, "n": 8}, headers=hog_headers)
        release.set()
        other = http.post(url + COMPLETIONS, json=other_body, headers=bearer("other"))
        held.read()
    assert hog.status_code == 429
    assert other.status_code == 200
    assert engine.num_refused == 0  # the engine itself never had to refuse anyone
