"""Two replicas of the embedded model on Ray Serve, one engine thread each, on this CPU:
every request completes through Serve's HTTP proxy, the router spreads a burst, and a replica
that dies loses only its own requests, each with an error frame."""

import argparse
import json
import socket
import threading
import time

import httpx
import pytest
import ray
from ray import serve

from tokenflow.replicas.deployments import REPLICA_HEADER
from tokenflow.replicas.launch import start

SERVE_ARGV = ["--num-threads", "1", "--device-kv-tokens", "1024", "--host-kv-tokens", "4096"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def url():
    port = _free_port()
    args = argparse.Namespace(
        replicas=2,
        router="tokenflow",
        host="127.0.0.1",
        port=port,
        report_period_s=0.5,
        default_rate=4.0,
        num_cpus=2,
        object_store_mib=128,
    )
    start(args, SERVE_ARGV)
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _stream(url: str, max_tokens: int, rate: float, out: dict, first: threading.Event | None):
    """One streamed completion: its replica, its texts and whether an error frame came."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "min_tokens": max_tokens}
    body |= {"stream": True, "stream_rate": rate, "ignore_eos": True}
    out.update(texts=[], error=None, done=False)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
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
    counts = httpx.get(f"{url}/replicas", timeout=30).json()
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
