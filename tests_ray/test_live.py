"""Two replicas of the embedded model on Ray Serve, one engine thread each, on this CPU:
every request completes through Serve's HTTP proxy, the router spreads a burst, a replica
that dies loses only its own requests, each with an error frame, and on shutdown the replicas
drain as `tokenflow serve` does (the last test: the engines stop)."""

import json
import threading
import time

import httpx
import pytest
import ray

from tests_ray.fleet import running_fleet
from tokenflow.replicas.ingress import REPLICA_HEADER
from tokenflow.replicas.launch import drain

KEY = "live-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
SERVE_ARGV = ["--num-threads", "1", "--device-kv-tokens", "1024", "--host-kv-tokens", "4096"]
SERVE_ARGV += ["--api-key", KEY, "--drain-timeout-s", "60"]


@pytest.fixture(scope="module")
def fleet():
    """The application's URL and the actors its replicas listen to."""
    with running_fleet(SERVE_ARGV) as running:
        yield running


@pytest.fixture
def url(fleet):
    return fleet[0]


def _stream(url: str, max_tokens: int, rate: float, out: dict, first: threading.Event | None):
    """One streamed completion: its replica, its texts and whether an error frame came."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "min_tokens": max_tokens}
    body |= {"stream": True, "stream_rate": rate, "ignore_eos": True}
    out.update(texts=[], error=None, done=False)
    url = f"{url}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=AUTH, timeout=300) as response:
        out["status"], out["replica"] = response.status_code, response.headers.get(REPLICA_HEADER)
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            frame = json.loads(line[6:])
            if "error" in frame:
                out["error"] = frame["error"]["message"]
            else:
                out["texts"].append(frame["choices"][0]["text"])
                if first is not None:
                    first.set()


def _burst(url: str, n: int, max_tokens: int, rate: float = 8.0):
    results = [{} for _ in range(n)]
    firsts = [threading.Event() for _ in range(n)]
    threads = [
        threading.Thread(target=_stream, args=(url, max_tokens, rate, r, f))
        for r, f in zip(results, firsts, strict=True)
    ]
    for thread in threads:
        thread.start()
    return results, firsts, threads


def test_every_request_of_a_burst_completes_on_both_replicas(url):
    results, _, threads = _burst(url, 8, 24)
    for thread in threads:
        thread.join(timeout=300)
    assert all(r["status"] == 200 and r["done"] and r["error"] is None for r in results)
    assert all(len(r["texts"]) == 24 for r in results)
    replicas = {r["replica"] for r in results}
    assert len(replicas) == 2  # the rule spread the burst
    counts = httpx.get(f"{url}/replicas", headers=AUTH, timeout=30).json()
    assert sum(counts.values()) >= 8 and set(counts) >= replicas


def test_a_replica_that_dies_loses_only_its_own_requests(url):
    # Streams start one by one until both replicas hold some: the rule may send a short burst
    # all to one replica when the other's last report shows it fuller (each start adds load).
    results, threads = [], []
    while len({r["replica"] for r in results}) < 2 and len(results) < 12:
        started, firsts, more = _burst(url, 1, 120, rate=4.0)
        assert firsts[0].wait(timeout=240), "a stream got no first token"
        results += started
        threads += more
    by_replica: dict[str, list[dict]] = {}
    for r in results:
        by_replica.setdefault(r["replica"], []).append(r)
    assert len(by_replica) == 2
    victim = sorted(by_replica)[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=False)
    for thread in threads:
        thread.join(timeout=300)
    lost, kept = by_replica[victim], [r for k, v in by_replica.items() if k != victim for r in v]
    assert all(r["error"] and r["done"] and len(r["texts"]) < 120 for r in lost)
    assert all(r["error"] is None and len(r["texts"]) == 120 for r in kept)
    # a request after the death is served (by the survivor or the replica Serve restarts)
    after: dict = {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        _stream(url, 4, 8.0, after, None)
        if after["status"] == 200 and after["done"] and after["error"] is None:
            break
    assert after["error"] is None and len(after["texts"]) == 4


def test_on_shutdown_the_replicas_refuse_new_requests_and_finish_their_streams(fleet):
    url, actors = fleet
    result: dict = {}
    first = threading.Event()
    stream = threading.Thread(target=_stream, args=(url, 160, 4.0, result, first))
    stream.start()
    assert first.wait(timeout=240), "the stream got no first token"
    drained: list[bool] = []
    drainer = threading.Thread(target=lambda: drained.append(drain(actors.drain_signal, 2, 60.0)))
    drainer.start()
    refused = _refused(url)
    was_in_flight = stream.is_alive()  # (160 tokens take seconds here; the 503 came in ms)
    stream.join(timeout=300)
    drainer.join(timeout=120)
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert was_in_flight
    assert result["error"] is None and result["done"] and len(result["texts"]) == 160
    assert drained == [True]  # every replica sent its answers in time, then stopped its engine


def _refused(url: str) -> httpx.Response:
    """The first 503 a new request gets once the drain began (every replica refuses it)."""
    body = {"prompt": "Once upon a time", "max_tokens": 4}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        answer = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
        if answer.status_code == 503:
            return answer
        time.sleep(0.05)
    raise AssertionError("no request was refused while the replicas drained")
