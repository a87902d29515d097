"""The ingress's checks of a body, its retry decision and a replica's health, without a cluster:
what a hostile client can make the ingress read, parse and build."""

import asyncio
import json
import threading
import tracemalloc
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from tests_ray.fakes import engine_full_429, key_limit_429
from tokenflow.engine.client import EngineHealth
from tokenflow.replicas.deployments import EngineReplica
from tokenflow.replicas.guards import (
    MAX_TRIES,
    can_go_elsewhere,
    health_problem,
    parse_body,
    read_body,
    should_retry,
)
from tokenflow.replicas.reports import MAX_ROUTED_TOKENS, route_facts
from tokenflow.serving.classes import ClassRules
from tokenflow.serving.config import ServerConfig
from tokenflow.serving.drain import Drain
from tokenflow.serving.validation import ApiError


def _request(chunks: list[bytes], headers: dict[str, str] | None = None):
    """A request whose body arrives in `chunks`, and the list of chunks read so far."""
    read: list[int] = []

    async def receive():
        index = len(read)
        read.append(index)
        if index >= len(chunks):
            return {"type": "http.disconnect"}
        more = index < len(chunks) - 1
        return {"type": "http.request", "body": chunks[index], "more_body": more}

    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": raw}
    return Request(scope, receive), read


def _status(read) -> int:
    """The status of the ApiError that the coroutine `read` raises."""
    with pytest.raises(ApiError) as info:
        asyncio.run(read)
    return info.value.status_code


def test_a_body_declared_too_large_is_refused_before_any_of_it_is_read():
    request, read = _request([b"x" * 1024] * 8, {"content-length": str(10**9)})
    assert _status(read_body(request, 4096)) == 413
    assert read == []


def test_a_chunked_body_is_refused_at_the_chunk_past_the_limit():
    request, read = _request([b"x" * 1000] * 50)  # no Content-Length: chunked
    assert _status(read_body(request, 4096)) == 413
    assert len(read) == 5  # 5000 bytes: the rest is never read


def test_a_body_within_the_limit_is_read_whole():
    request, _ = _request([b'{"prompt": ', b'"hi"}'])
    assert asyncio.run(read_body(request, 4096)) == b'{"prompt": "hi"}'


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,  # a nesting bomb: RecursionError in the parser
        b'{"a":' * 50_000,
        b'{"prompt": "\xff\xfe"}',  # invalid UTF-8: UnicodeDecodeError
        b"not json",
        b'{"max_tokens": ' + b"9" * 5000 + b"}",  # past Python's int digits limit
        b"[1, 2]",  # JSON, but not an object
        b'"a string"',
        b"null",
    ],
)
def test_a_body_that_is_not_a_json_object_is_a_400(body):
    with pytest.raises(ApiError) as info:
        parse_body(body)
    assert info.value.status_code == 400
    assert info.value.body().model_dump()["error"]["type"] == "invalid_request_error"


def test_an_empty_body_is_an_empty_object():
    assert parse_body(b"") == {}


def test_route_facts_hold_a_few_numbers_whatever_the_prompt():
    parsed = parse_body(json.dumps({"prompt": "x" * (1 << 20), "max_tokens": 16}).encode())
    tracemalloc.start()
    facts = route_facts(parsed, {}, ClassRules(), 4.0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 << 10  # (was a tuple of 2**18 tokens: 2 MiB)
    assert facts["end_tokens"] == (1 << 20) // 4 + 1 + 16


def test_route_facts_size_chat_messages_by_their_text_alone():
    messages = [
        {"role": "system", "content": "x" * 4000},
        {"role": "user", "content": [{"type": "text", "text": "y" * 400}, {"type": "image"}]},
        {"role": "user", "content": {"nested": ["not", "text"]}},
        "not a message",
    ]
    facts = route_facts({"messages": messages, "max_tokens": 10}, {}, ClassRules(), 4.0)
    assert facts["end_tokens"] == 4400 // 4 + 1 + 10


def test_route_facts_survive_any_number_a_body_states():
    for value in (10**400, 1e308, -5, "NaN", [1], {"a": 1}, True):
        body = {"prompt": "x", "max_tokens": value, "stream_rate": value, "stream": True}
        facts = route_facts(body, {}, ClassRules(), 4.0)
        assert 0 < facts["end_tokens"] <= MAX_ROUTED_TOKENS + 1
    # A rate the server would refuse (over 1000 tok/s) is not the router's: the default is.
    readers = ClassRules.parse("reader", ())
    stream = {"prompt": "x", "stream": True}
    assert route_facts({**stream, "stream_rate": 5000}, {}, readers, 4.0)["rate_tps"] == 4.0
    assert route_facts(stream, {"x-stream-rate": "1e-9"}, readers, 4.0)["rate_tps"] == 4.0


def test_a_refusal_is_offered_again_a_bounded_number_of_times():
    full = engine_full_429()
    assert should_retry(429, full, 1) and should_retry(503, b"{}", 1) and should_retry(None, b"", 1)
    assert not should_retry(429, full, MAX_TRIES)  # then the 429 reaches the client
    for status in (200, 400, 500):
        assert not should_retry(status, b"{}", 1)


def test_a_per_key_429_never_goes_to_another_replica():
    assert can_go_elsewhere(429, engine_full_429())
    assert not can_go_elsewhere(429, asyncio.run(key_limit_429()))
    for body in (b"", b"{}", b'{"error": {}}', b"[" * 5000, b'{"error": "full"}', b"\xff"):
        assert not can_go_elsewhere(429, body)  # (what is not known to be a full engine)


def test_health_fails_on_a_dead_or_stalled_engine_loop():
    assert health_problem(EngineHealth(True, 1.0, None), 30.0) is None
    assert "died" in health_problem(EngineHealth(False, 1.0, "the engine loop died: X"), 30.0)
    assert "not turned" in health_problem(EngineHealth(True, 31.0, None), 30.0)


def _replica(health: EngineHealth, **config) -> EngineReplica:
    """An EngineReplica over a stub engine (no model, no Serve)."""
    replica = EngineReplica.__new__(EngineReplica)
    replica.engine = SimpleNamespace(health=lambda: health, stop=threading.Event().set)
    replica.config = ServerConfig(**config)
    replica.drain_state = Drain()
    replica.rebalancer = None  # (no board)
    return replica


def test_serves_health_check_fails_when_the_engine_loop_stalls():
    _replica(EngineHealth(True, 1.0, None), health_stall_s=5.0).check_health()
    with pytest.raises(RuntimeError, match="not turned"):
        _replica(EngineHealth(True, 6.0, None), health_stall_s=5.0).check_health()
    dead = EngineHealth(False, 0.0, "the engine loop died: boom")
    with pytest.raises(RuntimeError, match="died"):
        _replica(dead, health_stall_s=5.0).check_health()


def test_a_draining_replica_waits_for_its_answers_then_stops_its_engine():
    replica = _replica(EngineHealth(False, 0.0, "stopped"), drain_timeout_s=30.0)
    stopped = threading.Event()
    replica.engine.stop = stopped.set
    replica.drain_state.entered()  # one answer in flight
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(replica.drain()))
    thread.start()
    thread.join(timeout=0.3)
    assert replica.drain_state.is_draining and not stopped.is_set()  # still waiting
    replica.check_health()  # a draining replica stays healthy while its loop stops
    replica.drain_state.left()
    thread.join(timeout=10)
    assert result == [True] and stopped.is_set()


def test_a_drain_past_its_timeout_stops_the_engine_anyway():
    replica = _replica(EngineHealth(True, 0.0, None), drain_timeout_s=0.2)
    stopped = threading.Event()
    replica.engine.stop = stopped.set
    replica.drain_state.entered()
    assert replica.drain() is False and stopped.is_set()
