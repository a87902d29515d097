"""With `--migrate paused`, a replica that joins mid-burst takes streams paused on the other,
not only queued requests (the embedded model on Ray Serve, one engine thread each, on this
CPU): readers arrive at a fleet of one replica (two streams at a time), one as soon as the last
one's answer opens, until their demand passes what it makes by a queue, whatever this machine's
speed; its policy pauses the streams with the largest buffers to serve the others.  A second
replica joins (`launch.scale`) and the board moves it the queued requests and then paused
streams whose buffers cover the move.  Each moved answer goes on in the response its client
holds, from the token after the last one it was sent: one id, one usage over every token, one
[DONE].  (The engine runs its default kernels, not float32, as a deployment would; bfloat16's
kernels are not batch-invariant, so the text is not compared with an undisturbed run's;
tests_ray/test_live_join.py and test_live_moves.py compare it, in float32.)"""

import httpx
import pytest
import ray

from tests_ray.answers import AUTH, KEY, check_whole, chunks_of, greedy_answers, read_all
from tests_ray.fleet import TIMEOUT_S, running_fleet, until
from tokenflow.core.rebalance import StreamKind
from tokenflow.replicas.launch import scale

SERVE_ARGV = ["--num-threads", "1", "--api-key", KEY]
SERVE_ARGV += ["--device-kv-tokens", "2048", "--host-kv-tokens", "16384"]
SERVE_ARGV += ["--max-num-seqs", "2", "--drain-timeout-s", "60"]
# Readers of 512 tokens at 8 tok/s read for 64 s: the replica stays overloaded while the joiner
# starts (5-30 s), since its queue is admitted only as its served streams finish.
MAX_TOKENS = 512
ANSWERS = greedy_answers(MAX_TOKENS)
READ_RATE = 8.0
MAX_READERS = 96  # (a replica making 700 tok/s: far beyond this CPU's one thread)


@pytest.fixture(scope="module")
def fleet():
    with running_fleet(SERVE_ARGV, num_replicas=1, migrate="paused") as running:
        yield running


def test_a_replica_that_joins_mid_burst_takes_streams_paused_on_the_other(fleet):
    url, actors = fleet
    warm, _, threads = read_all(url, greedy_answers(16), rate=1000.0)  # (its first answers)
    for thread in threads:
        thread.join(timeout=TIMEOUT_S)
    for result in warm:
        check_whole(result, 16)
    (first_id,) = ray.get(actors.board.first_posted_s.remote())

    results, threads = _readers_until_overloaded(url)
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
        f"\n{len(results)} readers; the board planned {len(planned)} moves, {len(paused)} of "
        f"paused streams ({len(paused_to_new)} to the new replica, {len(paused_ids)} landed "
        f"there); hand-off to landing {[round(p.landed_s - p.handed_off_s, 3) for p in landed]} s"
    )
    for result in results:
        check_whole(result, MAX_TOKENS)
    assert paused_to_new and moved  # paused streams moved, and their answers went on there
    for result in moved:  # each had tokens before its move: it was paused, not queued
        assert len([c for c in chunks_of(result) if c["choices"]]) > 1


def _readers_until_overloaded(url: str) -> tuple[list[dict], list]:
    """Readers sent one at a time, each once the last one's answer has opened, until the
    replica is overloaded, holds paused streams, and its queued readers ask between a quarter
    and a half of its Gamma: (their results, their threads).

    A queue that long keeps the replica overloaded while the joiner starts, since it is
    admitted only as served streams finish (a reader's 64 s); one longer would leave the joiner
    no room for paused streams, since the board moves queued requests first.  Sized by the
    replica's own reports, not by a rate fixed in advance: a fixed burst that overloaded one
    machine left a faster one with room for every reader, and a slower one with a queue that
    filled the joiner."""
    results: list[dict] = []
    threads: list = []

    def is_ready() -> bool:
        report = httpx.get(f"{url}/v1/tokenflow/streams", headers=AUTH, timeout=30).json()
        totals, gamma_tps = report["totals"], report["capacity_tps"] or 0.0
        queued_tps = totals["num_waiting"] * READ_RATE
        if queued_tps < gamma_tps / 4:
            assert len(results) < MAX_READERS, f"{MAX_READERS} readers did not overload it"
            answer = ANSWERS[len(results) % len(ANSWERS)]
            new_results, _, new_threads = read_all(url, [answer], rate=READ_RATE)
            results.extend(new_results)
            threads.extend(new_threads)
            until(lambda: new_results[0].get("status"), "the new reader's answer to open")
            return False
        is_overloaded = report["is_overloaded"] and totals["num_paused"] > 0
        return is_overloaded and queued_tps <= gamma_tps / 2

    until(is_ready, "an overloaded replica with paused streams and a queue of readers")
    return results, threads
