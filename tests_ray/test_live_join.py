"""A replica that joins mid-burst takes requests queued on the other (the embedded model on Ray
Serve, one engine thread each, on this CPU): a burst queues on a fleet of one replica (two
streams at a time), a second replica joins (`launch.scale`, which leaves the first running),
and the fleet's board (`--migrate queued`) moves queued requests to it within a report period
of its first report. Every answer reaches its client whole: one id, one usage over every token,
one [DONE], the very text of an undisturbed run."""

import httpx
import pytest
import ray

from tests_ray.answers import (
    AUTH,
    REPLICA_ARGV,
    check_whole,
    chunks_of,
    greedy_answers,
    read_all,
    text_of,
)
from tests_ray.fleet import REPORT_PERIOD_S, TIMEOUT_S, running_fleet, until
from tokenflow.replicas.launch import scale

SERVE_ARGV = [*REPLICA_ARGV, "--device-kv-tokens", "1024", "--host-kv-tokens", "4096"]
SERVE_ARGV += ["--max-num-seqs", "2", "--drain-timeout-s", "60"]
MAX_TOKENS = 96
ANSWERS = greedy_answers(MAX_TOKENS)
NUM_COPIES = 4  # of each answer in the burst: 16 answers, 14 of them queued at first
# What the first moved request's first token may take after the new replica's first report,
# beyond the report period the source may take to post next: the source's post and the board's
# answer (one Ray call), the export between two of its steps, the handoff to the ingress and
# the continuation's call on the new replica (Ray calls), and the new replica's prefill of the
# prompt and its first token, all on this busy 2-core CPU.
MOVE_LATENCY_S = 1.0


@pytest.fixture(scope="module")
def fleet():
    """A fleet of one replica: the application's URL and the actors its replicas listen to."""
    with running_fleet(SERVE_ARGV, num_replicas=1, migrate="queued") as running:
        yield running


def test_a_replica_that_joins_mid_burst_serves_requests_queued_on_the_other(fleet):
    url, actors = fleet
    undisturbed, _, threads = read_all(url, ANSWERS, rate=1000.0)
    for thread in threads:
        thread.join(timeout=TIMEOUT_S)
    for result in undisturbed:
        check_whole(result, MAX_TOKENS)
    (first_id,) = ray.get(actors.board.first_posted_s.remote())  # (the one replica so far)

    burst = ANSWERS * NUM_COPIES
    results, _, threads = read_all(url, burst, rate=1000.0)
    until(lambda: all(r.get("status") for r in results), "every answer of the burst to open")
    scale(2)

    def joined() -> dict[str, float]:
        first_posts = ray.get(actors.board.first_posted_s.remote())
        return {replica: s for replica, s in first_posts.items() if replica != first_id}

    ((joined_id, joined_s),) = until(joined, "the new replica's first report").items()
    for thread in threads:
        thread.join(timeout=TIMEOUT_S)
    every_move = ray.get(actors.board.planned.remote())
    planned = [p for p in every_move if p.move.target_id == joined_id]
    # (once the first replica's own queue is done, requests still queued on the new one may
    # move back to it: the rule gives a request that waited a period to a replica with room)
    planned_back = [p for p in every_move if p.move.target_id == first_id]
    moved_ids = {p.move.request_id for p in planned}
    moved = [r for r in results if any(c["id"] in moved_ids for c in chunks_of(r)[:1])]
    continued = httpx.get(f"{url}/replicas/moves", headers=AUTH, timeout=30).json()
    first_name = results[0]["replica"]
    first_moved_s = min((r["times_s"][0] for r in moved), default=float("inf"))
    if planned:
        print(
            f"\n{len(results)} answers on one replica; the second one's first report came "
            f"{joined_s - min(r['times_s'][0] for r in results):.1f} s after the burst's first "
            f"token; the board moved {len(planned)} queued answers to it and {len(planned_back)} "
            f"back later (the ingress continued "
            f"{sorted(continued.values())} by replica); the first move was planned "
            f"{planned[0].planned_s - joined_s:.2f} s after that report (period "
            f"{REPORT_PERIOD_S} s) and its first token came {first_moved_s - joined_s:.2f} s "
            f"after it ({first_moved_s - planned[0].planned_s:.2f} s after the plan)"
        )
    for index, result in enumerate(results):
        check_whole(result, MAX_TOKENS)
        assert text_of(result) == text_of(undisturbed[index % len(ANSWERS)])
        assert result["replica"] == first_name  # every answer began on the first replica
    assert planned and moved
    # every continuation went where the board planned it: the moves back only to the first
    assert continued.get(first_name, 0) <= len(planned_back)
    assert sum(continued.values()) - continued.get(first_name, 0) >= 1  # ... some to the new
    assert first_moved_s - joined_s <= REPORT_PERIOD_S + MOVE_LATENCY_S
