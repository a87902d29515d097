"""A conversation's next turn lands on the replica that served its last one (two replicas of the
embedded model on Ray Serve behind the TokenFlow router, one engine thread each, on this CPU):
two conversations' first turns come at once and are spread over both replicas; each one's
second turn, resending its history and naming its session (`prompt_cache_key`), goes back to
its own first turn's replica, where its prefix is cached (the answer reports cached tokens)."""

import threading

import httpx
import pytest

from tests_ray.fleet import TIMEOUT_S, running_fleet
from tokenflow.replicas.ingress import REPLICA_HEADER

KEY = "live-sessions-key"
AUTH = {"authorization": f"Bearer {KEY}"}
SERVE_ARGV = ["--num-threads", "1", "--device-kv-tokens", "1024", "--host-kv-tokens", "4096"]
SERVE_ARGV += ["--api-key", KEY]
SYSTEM = "You are a patient librarian who answers in short sentences. " * 40  # (~500 tokens)


@pytest.fixture(scope="module")
def url():
    with running_fleet(SERVE_ARGV) as (url, _):
        yield url


def _turn(url: str, session: str, prompt: str, out: dict) -> None:
    """One turn of `session`: its replica, its answer and the prompt tokens found cached."""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "prompt_cache_key": session}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    out.update(
        replica=response.headers[REPLICA_HEADER],
        text=response.json()["choices"][0]["text"],
        cached=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    )


def test_a_second_turn_lands_on_the_replica_that_served_the_first(url):
    sessions = {"s0": f"{SYSTEM}User: where are the maps?\n", "s1": f"{SYSTEM}User: hours?\n"}
    firsts = {s: {} for s in sessions}
    threads = [
        threading.Thread(target=_turn, args=(url, s, prompt, firsts[s]))
        for s, prompt in sessions.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=TIMEOUT_S)
    assert len({firsts[s]["replica"] for s in sessions}) == 2  # the first turns were spread
    for session, prompt in sessions.items():
        history = f"{prompt}Librarian:{firsts[session]['text']}\nUser: thank you.\n"
        second: dict = {}
        _turn(url, session, history, second)
        assert second["replica"] == firsts[session]["replica"], session
        assert second["cached"] > 0, session  # its prefix was there
