"""A replica that leaves hands its streams to the other (two replicas of the embedded model on
Ray Serve, one engine thread each, on this CPU): greedy answers in flight on it go on from the
other replica in the response their clients hold, each the very text of an undisturbed run,
one id, one usage over every token, one [DONE]; the drain takes the time of the exports, not
of the answers."""

import itertools
import threading
import time

import pytest

from tests_ray.answers import (
    REPLICA_ARGV,
    check_whole,
    greedy_answers,
    read_all,
    read_answer,
    text_of,
)
from tests_ray.fleet import running_fleet
from tokenflow.replicas.launch import leave

DRAIN_TIMEOUT_S = 60
SERVE_ARGV = [*REPLICA_ARGV, "--device-kv-tokens", "1024", "--host-kv-tokens", "4096"]
SERVE_ARGV += ["--drain-timeout-s", str(DRAIN_TIMEOUT_S)]
MAX_TOKENS = 96
ANSWERS = greedy_answers(MAX_TOKENS)


@pytest.fixture(scope="module")
def fleet():
    """The application's URL and the actors its replicas listen to."""
    with running_fleet(SERVE_ARGV) as running:
        yield running


def test_a_replica_that_leaves_hands_its_streams_over_and_every_answer_is_whole(fleet):
    url, actors = fleet
    undisturbed, _, threads = read_all(url, ANSWERS, rate=1000.0)
    for thread in threads:
        thread.join(timeout=600)
    for result in undisturbed:
        check_whole(result, MAX_TOKENS)

    # slow readers: mid-answer at the drain
    results, firsts, threads = read_all(url, ANSWERS, rate=4.0)
    for first in firsts:
        assert first.wait(timeout=300), "an answer got no first event"
    replicas = [r["replica"] for r in results]
    victim = max(sorted(set(replicas)), key=replicas.count)  # the replica with the most
    departure = leave(actors.drain_signal, victim, DRAIN_TIMEOUT_S)
    left_s = time.monotonic()
    for thread in threads:
        thread.join(timeout=600)
    answered_s = time.monotonic() - left_s
    moved = [r for r in results if r["replica"] == victim]
    gaps = [max(b - a for a, b in itertools.pairwise(r["times_s"])) for r in moved]
    print(
        f"\n{len(moved)} of {len(results)} answers on the leaving replica: {departure}; "
        f"the answers ended {answered_s:.1f} s after the drain; the longest gap between two "
        f"events of each moved answer: {', '.join(f'{g:.2f} s' for g in gaps)}"
    )

    assert departure.is_drained and departure.num_handed_off >= 1
    assert departure.elapsed_s < DRAIN_TIMEOUT_S / 4  # the exports, not the answers' length
    for result, before in zip(results, undisturbed, strict=True):
        check_whole(result, MAX_TOKENS)
        assert text_of(result) == text_of(before)  # not a token lost, repeated or changed
    after: dict = {}
    read_answer(url, *ANSWERS[0], 1000.0, after, threading.Event())  # the other replica serves on
    assert after["replica"] != victim
    check_whole(after, MAX_TOKENS)
