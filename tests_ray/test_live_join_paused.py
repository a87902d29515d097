"""With `--migrate paused`, a replica that joins mid-burst takes streams paused on the other,
not only queued requests (the embedded model on Ray Serve, one engine thread each, on this
CPU).  Readers arrive at a fleet of one replica (two streams at a time): slow ones, one each
time its report is read, until they ask 0.9x what it makes, then one fast reader sized on that
Gamma, which its policy admits within `--capacity-headroom 1.5`; so the streams it started ask
well past what it makes, whatever this machine's speed, and it pauses those with the largest
buffers to serve the others.  A second replica joins (`launch.scale`) and the board moves it
paused streams whose buffers cover the move, while the first replica's streams ask more than it
makes.  Each moved answer goes on in the response its client holds, from the token after the
last one it was sent: one id, one usage over every token, one [DONE].  (The engine runs its
default kernels, not float32, as a deployment would; bfloat16's kernels are not
batch-invariant, so the text is not compared with an undisturbed run's;
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
SERVE_ARGV += ["--max-num-seqs", "2", "--drain-timeout-s", "60", "--capacity-headroom", "1.5"]
# Slow readers (192 tokens at 2 tok/s: 96 s of reading, buffers that cover a move) fill 0.9x of
# what the replica makes, a step of a fifth of it or less; then one fast reader (768 tokens at
# 0.4x of it) takes the replica past its capacity, admitted within 1.5x (`--capacity-headroom`).
SLOW_TOKENS, FAST_TOKENS = 192, 768
SLOW_RATE = 2.0
SLOW_ANSWERS = greedy_answers(SLOW_TOKENS)
MAX_READERS = 96  # (a replica making 200 tok/s: far beyond this CPU's one thread)


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

    burst = _Burst(url)
    gamma_tps = until(burst.top_up, "slow readers asking 0.9x the replica's Gamma")
    fast, _, fast_threads = read_all(url, greedy_answers(FAST_TOKENS)[:1], rate=0.4 * gamma_tps)
    until(lambda: _is_past_capacity(url), "streams started past capacity, some paused")
    scale(2)
    until(
        lambda: len(ray.get(actors.board.first_posted_s.remote())) == 2,
        "the new replica's first report",
    )
    for thread in [*burst.threads, *fast_threads]:
        thread.join(timeout=TIMEOUT_S)
    first_posts = ray.get(actors.board.first_posted_s.remote())
    (joined_id,) = [replica for replica in first_posts if replica != first_id]
    planned = ray.get(actors.board.planned.remote())
    paused = [p for p in planned if p.move.kind is StreamKind.PAUSED]
    paused_to_new = [p for p in paused if p.move.target_id == joined_id]
    paused_ids = {p.move.request_id for p in paused_to_new if p.landed_s is not None}
    # (a planned move lands only if its stream is still paused when its replica reads it)
    landed = [p for p in paused_to_new if p.landed_s is not None and p.handed_off_s is not None]
    results = [*burst.results, *fast]
    moved = [r for r in results if chunks_of(r) and chunks_of(r)[0]["id"] in paused_ids]
    print(
        f"\n{len(results)} readers; the board planned {len(planned)} moves, {len(paused)} of "
        f"paused streams ({len(paused_to_new)} to the new replica, {len(paused_ids)} landed "
        f"there); hand-off to landing {[round(p.landed_s - p.handed_off_s, 3) for p in landed]} s"
    )
    for result in burst.results:
        check_whole(result, SLOW_TOKENS)
    check_whole(fast[0], FAST_TOKENS)
    assert paused_to_new and moved  # paused streams moved, and their answers went on there
    for result in moved:  # each had tokens before its move: it was paused, not queued
        assert len([c for c in chunks_of(result) if c["choices"]]) > 1


class _Burst:
    """Slow readers of the answers in turn, one more each time the replica's report is read
    while those still reading ask less than 0.9x its Gamma (`top_up`): sized by the replica's
    own reports, not fixed in advance, since a fixed burst that overloaded one machine left a
    faster one with room for every reader, and a slower one with a queue that filled the joiner.
    (The readers are counted by their threads, not by the report, which counts a request only
    once it has reached the engine.)"""

    def __init__(self, url: str) -> None:
        self.url = url
        self.results: list[dict] = []
        self.threads: list = []

    def top_up(self) -> float:
        """The replica's Gamma once those still reading ask at least 0.9x of it; else 0.0,
        after sending one more reader."""
        gamma_tps = _streams(self.url)["capacity_tps"] or 0.0
        num_reading = sum(thread.is_alive() for thread in self.threads)
        if num_reading * SLOW_RATE >= 0.9 * gamma_tps > 0:
            return gamma_tps
        assert len(self.results) < MAX_READERS, f"{MAX_READERS} readers did not fill it"
        answer = SLOW_ANSWERS[len(self.results) % len(SLOW_ANSWERS)]
        results, _, threads = read_all(self.url, [answer], SLOW_RATE)
        self.results += results
        self.threads += threads
        return 0.0


def _streams(url: str) -> dict:
    return httpx.get(f"{url}/v1/tokenflow/streams", headers=AUTH, timeout=30).json()


def _is_past_capacity(url: str) -> bool:
    """Whether the streams the replica started ask at least 1.15x its Gamma, some of them
    paused, with at most half its Gamma queued.  The board moves queued requests first, and
    paused streams only while the replica's load without them stays above 1."""
    report = _streams(url)
    gamma_tps, totals = report["capacity_tps"] or 0.0, report["totals"]
    is_past = report["demand_tps"] >= 1.15 * gamma_tps and totals["num_paused"] > 0
    return is_past and totals["num_waiting"] * SLOW_RATE <= gamma_tps / 2
