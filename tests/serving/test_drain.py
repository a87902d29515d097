"""A drain refuses new work (503 with Retry-After, /health 503) and waits for the answers in
flight; the wait ends when the last one was sent, at its timeout, or at a second signal."""

from __future__ import annotations

import argparse
import json
import threading

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from tests.serving.live_server import serve_in_thread
from tokenflow.cli.server_options import add_server_options, server_config_from
from tokenflow.serving.app import build_app
from tokenflow.serving.config import ServerConfig
from tokenflow.serving.drain import Drain

HANG_GUARD_S = 60  # only turns a hang into a failure: every wait below ends on an event


def waiter(drain: Drain, timeout_s: float) -> tuple[threading.Thread, list[bool]]:
    """A thread blocked in `drain.wait_drained(timeout_s)`; its answer lands in the list."""
    answer: list[bool] = []
    thread = threading.Thread(target=lambda: answer.append(drain.wait_drained(timeout_s)))
    thread.start()
    return thread, answer


def test_a_drain_refuses_new_requests_and_lets_a_stream_in_flight_finish() -> None:
    gate = threading.Event()
    engine = FakeEngine(gate=gate, gate_at_token=1)  # the stream holds token 1 until we open
    drain = Drain()
    with (
        serve_in_thread(build_app(engine, drain=drain)) as url,
        httpx.Client(base_url=url, timeout=HANG_GUARD_S) as http,
    ):
        assert http.get("/health").json() == {"status": "ok", "num_in_flight": 0}
        body = {"prompt": "x", "max_tokens": 4, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert '"text":" t0"' in next(line for line in lines if line.startswith("data: "))
            drain.begin()
            health = http.get("/health")
            assert health.status_code == 503
            assert health.json() == {"status": "draining", "num_in_flight": 1}
            refused = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "server_shutting_down"
            assert not drain.wait_drained(0)  # the stream is still in flight
            gate.set()
            rest = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
        assert drain.wait_drained(HANG_GUARD_S)
        metrics = http.get("/metrics").text
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(data) for data in rest[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == [" t1", " t2", " t3"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert engine.aborted_ids == [] and len(engine.submitted) == 1
    assert 'tokenflow_http_errors_total{status="503"} 1.0' in metrics


def test_the_wait_ends_when_the_last_answer_was_sent() -> None:
    drain = Drain()
    drain.entered()
    drain.entered()
    drain.begin()
    thread, answer = waiter(drain, HANG_GUARD_S)
    drain.left()
    assert drain.wait_drained(0) is False  # one answer is still in flight
    drain.left()
    thread.join(HANG_GUARD_S)
    assert answer == [True] and drain.num_in_flight == 0


def test_a_second_begin_cuts_the_wait_short() -> None:
    drain = Drain()
    drain.entered()
    drain.begin()
    thread, answer = waiter(drain, 600)
    drain.begin()  # a second SIGINT
    thread.join(HANG_GUARD_S)
    assert answer == [False] and drain.num_in_flight == 1


def test_the_wait_times_out_with_answers_in_flight() -> None:
    drain = Drain()
    drain.entered()
    drain.begin()
    assert drain.wait_drained(0.01) is False
    assert drain.is_draining and drain.num_in_flight == 1


def test_the_drain_timeout_flag() -> None:
    parser = argparse.ArgumentParser()
    add_server_options(parser)
    # under Kubernetes' 30 s grace period, so the error frames are sent before the kill
    assert server_config_from(parser.parse_args([])).drain_timeout_s == 25.0
    args = parser.parse_args(["--drain-timeout-s", "2.5"])
    assert server_config_from(args).drain_timeout_s == 2.5
    assert ServerConfig(drain_timeout_s=0).drain_timeout_s == 0  # end the streams at once
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="drain_timeout_s"):
            ServerConfig(drain_timeout_s=bad)
