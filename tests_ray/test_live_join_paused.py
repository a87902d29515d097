"""With `--migrate paused`, a replica that joins mid-burst takes streams paused on the other,
not only queued requests (the embedded model on Ray Serve, one engine thread each, on this
CPU): a burst of slow readers on a fleet of one replica (two streams at a time), whose policy
pauses the streams with the largest buffers to start the others; a second replica joins
(`launch.scale`) and the board moves paused streams to it whose buffers cover the move.  Each
moved answer goes on in the response its client holds, from the token after the last one it
was sent: one id, one usage over every token, one [DONE].  (The engine runs its default
kernels, as profiled, not float32: the scenario is sized on the profiled simulator of this fleet,
and bfloat16's kernels are not batch-invariant, so the text is not compared with an undisturbed
run's; tests_ray/test_live_join.py and test_live_moves.py compare it, in float32.)"""

import httpx
import pytest
import ray

from tests_ray.answers import AUTH, KEY, check_whole, chunks_of, greedy_answers, read_all
from tests_ray.fleet import TIMEOUT_S, running_fleet, until
from tokenflow.core.rebalance import StreamKind
from tokenflow.replicas.launch import scale

SERVE_ARGV = ["--num-threads", "1", "--api-key", KEY]
SERVE_ARGV += ["--device-kv-tokens", "1024", "--host-kv-tokens", "4096"]
SERVE_ARGV += ["--max-num-seqs", "2", "--drain-timeout-s", "60"]
# 16 readers of 192 tokens at 4 tok/s ask a little more than one replica makes (two streams at
# a time): its policy pauses streams with large buffers to start the others, and at the join
# some are still queued and some paused (the profiled simulator of this fleet moves 1 queued
# request and 1-2 paused streams, joining anywhere from 12 to 25 s into the burst).
MAX_TOKENS = 192
ANSWERS = greedy_answers(MAX_TOKENS)
NUM_COPIES = 4  # of each answer in the burst
READ_RATE = 4.0


@pytest.fixture(scope="module")
def fleet():
    with running_fleet(SERVE_ARGV, num_replicas=1, migrate="paused") as running:
        yield running


def test_a_replica_that_joins_mid_burst_takes_streams_paused_on_the_other(fleet):
    url, actors = fleet
    warm, _, threads = read_all(url, ANSWERS, rate=1000.0)  # (the replica's first answers)
    for thread in threads:
        thread.join(timeout=TIMEOUT_S)
    for result in warm:
        check_whole(result, MAX_TOKENS)
    (first_id,) = ray.get(actors.board.first_posted_s.remote())

    results, _, threads = read_all(url, ANSWERS * NUM_COPIES, rate=READ_RATE)
    until(lambda: all(r.get("status") for r in results), "every answer of the burst to open")
    until(lambda: _room_for_paused(url), "paused streams, and a queue the joiner leaves room by")
    scale(2)
    for thread in threads:
        thread.join(timeout=TIMEOUT_S)
    first_posts = ray.get(actors.board.first_posted_s.remote())
    (joined_id,) = [replica for replica in first_posts if replica != first_id]
    planned = ray.get(actors.board.planned.remote())
    paused = [p for p in planned if p.move.kind is StreamKind.PAUSED]
    paused_to_new = [p for p in paused if p.move.target_id == joined_id]
    paused_ids = {p.move.request_id for p in paused_to_new if p.landed_s is not None}
    # (a planned move lands only if its stream is still paused when its replica reads it)
    landed = [p for p in paused_to_new if p.landed_s is not None and p.handed_off_s is not None]
    moved = [r for r in results if chunks_of(r) and chunks_of(r)[0]["id"] in paused_ids]
    print(
        f"\nthe board planned {len(planned)} moves, {len(paused)} of paused streams "
        f"({len(paused_to_new)} to the new replica, {len(paused_ids)} landed there); "
        f"hand-off to landing {[round(p.landed_s - p.handed_off_s, 3) for p in landed]} s"
    )
    for result in results:
        check_whole(result, MAX_TOKENS)
    assert paused_to_new and moved  # paused streams moved, and their answers went on there
    for result in moved:  # each had tokens before its move: it was paused, not queued
        assert len([c for c in chunks_of(result) if c["choices"]]) > 1


def _room_for_paused(url: str) -> bool:
    """Whether the one replica is overloaded with paused streams, and its queued readers ask at
    most half what it makes: the board moves queued requests to a joining replica first, so a
    longer queue leaves it no room for paused streams.  (Joined at the first pause, a replica
    warm from the suite's earlier tests started fast and took 11 queued requests and no paused
    stream; so did one joining on a machine busier than the burst was sized on.)  The queue
    only shrinks from here, and it lasts while the served streams generate (~48 s a round):
    the replica is still overloaded when the joiner posts, 5-20 s later."""
    report = httpx.get(f"{url}/v1/tokenflow/streams", headers=AUTH, timeout=30).json()
    totals, gamma_tps = report["totals"], report["capacity_tps"] or 0.0
    is_short = totals["num_waiting"] * READ_RATE <= gamma_tps / 2
    return report["is_overloaded"] and totals["num_paused"] > 0 and is_short
