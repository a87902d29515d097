"""A key's limit holds across the fleet and never cuts its answer short when it moves (two
replicas of the embedded model on Ray Serve, one engine thread each, on this CPU): with
--max-requests-per-key 1, the key's second request while its first streams is refused by the
ingress, whichever replica would have taken it; when the first answer's replica leaves, the
answer goes on from the other replica, its key still at its limit there, to its end, whole."""

import threading

import httpx
import pytest

from tests_ray.answers import AUTH, REPLICA_ARGV, check_whole, greedy_answers, read_answer, text_of
from tests_ray.fleet import TIMEOUT_S, running_fleet, until
from tokenflow.replicas.ingress import REPLICA_HEADER
from tokenflow.replicas.launch import leave

DRAIN_TIMEOUT_S = 60
SERVE_ARGV = [*REPLICA_ARGV, "--device-kv-tokens", "1024", "--host-kv-tokens", "4096"]
SERVE_ARGV += ["--drain-timeout-s", str(DRAIN_TIMEOUT_S), "--max-requests-per-key", "1"]
MAX_TOKENS = 96
PATH, BODY = greedy_answers(MAX_TOKENS)[0]
SHORT = {"prompt": "Hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def fleet():
    """The application's URL and the actors its replicas listen to."""
    with running_fleet(SERVE_ARGV) as running:
        yield running


def _short(url: str) -> httpx.Response:
    """Another request of the same key."""
    return httpx.post(f"{url}/v1/completions", json=SHORT, headers=AUTH, timeout=TIMEOUT_S)


def _answer(url: str, rate: float) -> tuple[dict, threading.Event, threading.Thread]:
    """The key's answer, read by a thread at `rate`: its result, first event and thread."""
    result: dict = {}
    first = threading.Event()
    thread = threading.Thread(target=read_answer, args=(url, PATH, BODY, rate, result, first))
    thread.start()
    return result, first, thread


def test_a_key_at_its_limit_is_refused_fleet_wide_and_its_moved_answer_goes_on(fleet):
    url, actors = fleet
    undisturbed, _, thread = _answer(url, 1000.0)
    thread.join(timeout=TIMEOUT_S)
    check_whole(undisturbed, MAX_TOKENS)

    result, first, thread = _answer(url, 4.0)  # a slow reader: mid-answer at the leave
    assert first.wait(timeout=TIMEOUT_S), "the answer got no first event"
    for _ in range(4):  # (each would have gone to a replica with room for the key)
        refused = _short(url)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert REPLICA_HEADER not in refused.headers  # the ingress's own answer
    departure = leave(actors.drain_signal, result["replica"], DRAIN_TIMEOUT_S)
    assert departure.is_drained and departure.num_handed_off == 1
    thread.join(timeout=TIMEOUT_S)

    check_whole(result, MAX_TOKENS)  # continued on the other replica, never refused there
    assert text_of(result) == text_of(undisturbed)
    moved_to = httpx.get(f"{url}/replicas/moves", headers=AUTH, timeout=TIMEOUT_S).json()
    assert sum(moved_to.values()) == 1 and result["replica"] not in moved_to
    until(lambda: _short(url).status_code == 200, "room for the key once its answer ended")
