"""The rebalancing rule, by the moves it makes on hand-built reports (no clock, no engine).

Gammas and rates are powers of two so every load below is exact: 1024 tok/s of Gamma, readers
at 8 tok/s (each 1/128 of it), one stream's share of Gamma 16 tok/s (64 streams)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.core.helpers import FLAT_GAMMA_TPS, flat_report, make_core, make_request
from tokenflow.core.load_report import RouteRequest, load_report
from tokenflow.core.rebalance import (
    MigrateMode,
    Movable,
    ReplicaLoad,
    StreamKind,
    movable_of,
    plan_moves,
    replica_load,
    stream_kind,
)
from tokenflow.core.request import RequestState

GAMMA = FLAT_GAMMA_TPS
RATE = 8.0


def _movable(
    index: int,
    kind: StreamKind = StreamKind.QUEUED,
    slack_s: float = 0.0,
    context: int = 100,
    left: int = 100,
    queued_s: float = 0.0,
) -> Movable:
    route = RouteRequest(f"r{index}", RATE, lifetime_tokens=context, end_tokens=context + left)
    return Movable(route, kind, context, left, slack_s, float(index), queued_s)


def _overloaded(movable: list[Movable], excess_tps: float = 32.0) -> ReplicaLoad:
    """A replica whose readers ask Gamma + `excess_tps` (its movable requests included)."""
    return ReplicaLoad("src", flat_report(GAMMA + excess_tps), tuple(movable))


def _ids(moves) -> list[tuple[str, str]]:
    return [(m.request_id, m.target_id) for m in moves]


def test_nothing_moves_when_off_or_when_no_replica_is_over_its_capacity():
    queued = [_movable(i) for i in range(4)]
    idle = ReplicaLoad("idle", flat_report())
    assert plan_moves([_overloaded(queued), idle], MigrateMode.OFF) == []
    at_capacity = ReplicaLoad("src", flat_report(GAMMA), tuple(queued))
    assert plan_moves([at_capacity, idle]) == []


def test_the_oldest_queued_requests_move_until_the_source_is_back_at_capacity():
    queued = [_movable(i) for i in (5, 2, 7, 1, 3, 6)]
    moves = plan_moves([_overloaded(queued), ReplicaLoad("idle", flat_report())])
    # 32 tok/s over Gamma: four readers at 8 tok/s, the four that came first
    assert _ids(moves) == [("r1", "idle"), ("r2", "idle"), ("r3", "idle"), ("r5", "idle")]
    assert all(m.source_id == "src" and m.kind is StreamKind.QUEUED for m in moves)


def test_a_queued_request_its_replica_has_not_started_in_a_period_moves_whatever_the_load():
    fresh = _movable(1, queued_s=0.4)
    stuck = _movable(2, queued_s=1.0)
    paused = _movable(3, StreamKind.PAUSED, slack_s=100.0)
    within = ReplicaLoad("src", flat_report(GAMMA / 2), (fresh, stuck, paused))
    moves = plan_moves([within, ReplicaLoad("idle", flat_report())], period_s=1.0)
    assert _ids(moves) == [("r2", "idle")]


def test_a_target_takes_only_what_keeps_it_within_its_capacity():
    queued = [_movable(i) for i in range(4)]
    nearly_full = ReplicaLoad("t", flat_report(GAMMA - 2 * RATE))
    assert _ids(plan_moves([_overloaded(queued), nearly_full])) == [("r0", "t"), ("r1", "t")]
    routed = (RouteRequest("new", RATE, 100, 200),)  # what the router sent it since its report
    busier = ReplicaLoad("t", flat_report(GAMMA - 2 * RATE), routed_since=routed)
    assert _ids(plan_moves([_overloaded(queued), busier])) == [("r0", "t")]


def test_a_target_with_a_queue_of_its_own_takes_nothing():
    queued = [_movable(i) for i in range(2)]
    queueing = ReplicaLoad("t", flat_report(num_waiting=1))
    assert plan_moves([_overloaded(queued), queueing]) == []


def test_a_paused_stream_moves_only_if_its_slack_covers_the_move_and_the_wait():
    # the target recomputes 1,000 tokens in 1 s; the move itself costs 0.05 s
    target = ReplicaLoad("t", flat_report(prefill_token_s=1e-3))
    short = _movable(1, StreamKind.PAUSED, slack_s=1.0, context=1000)
    assert plan_moves([_overloaded([short]), target], move_latency_s=0.05) == []
    long = _movable(2, StreamKind.PAUSED, slack_s=2.5, context=1000)
    moves = plan_moves([_overloaded([short, long]), target], move_latency_s=0.05)
    assert _ids(moves) == [("r2", "t")] and moves[0].cost_s == 1.05
    # the second waits behind the first's recompute: 2.05 s, more than its 2.0 s of slack
    pair = [_movable(i, StreamKind.PAUSED, slack_s=2.0, context=1000) for i in (3, 4)]
    moves = plan_moves([_overloaded(pair), target], move_latency_s=0.05)
    assert _ids(moves) == [("r3", "t")]
    # least slack first: r3 then r4 (2.05 s behind r3's recompute, within its 2.1 s)
    pair[1] = _movable(4, StreamKind.PAUSED, slack_s=2.1, context=1000)
    moves = plan_moves([_overloaded([long, *pair]), target], move_latency_s=0.05)
    assert _ids(moves) == [("r3", "t"), ("r4", "t")]  # r2 would wait 3.05 s: more than 2.5 s


def test_queued_mode_leaves_paused_streams_and_running_streams_never_leave_a_serving_replica():
    paused = _movable(1, StreamKind.PAUSED, slack_s=100.0)
    running = _movable(2, StreamKind.RUNNING, slack_s=100.0)
    idle = ReplicaLoad("idle", flat_report())
    assert plan_moves([_overloaded([paused, running]), idle], MigrateMode.QUEUED) == []
    assert _ids(plan_moves([_overloaded([paused, running]), idle])) == [("r1", "idle")]


def test_moves_spread_over_equal_targets_in_turn_ties_to_the_first_listed():
    queued = [_movable(i, context=1000) for i in range(4)]
    targets = [ReplicaLoad(name, flat_report(prefill_token_s=1e-3)) for name in ("b", "a")]
    moves = plan_moves([_overloaded(queued), *targets])
    assert _ids(moves) == [("r0", "b"), ("r1", "a"), ("r2", "b"), ("r3", "a")]
    assert plan_moves([_overloaded(queued), *targets]) == moves  # deterministic


def _started(slack_s: float = 10.0) -> list[Movable]:
    """Ten started streams, 0, 100, ..., 900 tokens left (r13 paused, the others running)."""
    kinds = [StreamKind.PAUSED if i == 3 else StreamKind.RUNNING for i in range(10)]
    return [_movable(10 + i, kinds[i], slack_s, left=100 * i) for i in range(10)]


def test_a_leaving_replica_moves_its_queue_at_once_and_its_late_streams_paced_over_the_drain():
    queued = [_movable(i) for i in range(3)]
    leaving = ReplicaLoad("old", flat_report(), tuple(queued + _started()), drain_left_s=5.0)
    moves = plan_moves([leaving, ReplicaLoad("new", flat_report())], period_s=1.0)
    # 5 s at one stream's share of Gamma (16 tok/s) is 80 tokens: nine streams must leave, a
    # fifth of them (rounded up) each period, the most tokens left first; then the queue
    assert [m.request_id for m in moves] == ["r0", "r1", "r2", "r19", "r18"]
    assert {m.target_id for m in moves} == {"new"}
    last = ReplicaLoad("old", flat_report(), tuple(_started()), drain_left_s=0.5)
    moves = plan_moves([last, ReplicaLoad("new", flat_report())], period_s=1.0)
    assert sorted(m.request_id for m in moves) == [f"r{10 + i}" for i in range(1, 10)]


def test_a_leaving_replica_keeps_the_streams_that_finish_before_its_deadline():
    # 30 s at 16 tok/s: 480 tokens; the five streams with more left must go, one a period
    leaving = ReplicaLoad("old", flat_report(), tuple(_started()), drain_left_s=30.0)
    assert _ids(plan_moves([leaving, ReplicaLoad("new", flat_report())])) == [("r19", "new")]
    nearly_done = ReplicaLoad("old", flat_report(), tuple(_started()[:5]), drain_left_s=30.0)
    assert plan_moves([nearly_done, ReplicaLoad("new", flat_report())]) == []


def test_a_leaving_replica_s_stream_with_a_short_buffer_waits_for_it_until_the_last_period():
    started = _started()
    started[9] = _movable(19, StreamKind.RUNNING, slack_s=0.01, left=900)  # the move: 0.05 s
    leaving = ReplicaLoad("old", flat_report(), tuple(started), drain_left_s=5.0)
    moves = plan_moves([leaving, ReplicaLoad("new", flat_report())], move_latency_s=0.05)
    assert [m.request_id for m in moves] == ["r18", "r17"]  # r19's buffer grows meanwhile
    last = ReplicaLoad("old", flat_report(), tuple(started), drain_left_s=1.0)
    moves = plan_moves([last, ReplicaLoad("new", flat_report())], move_latency_s=0.05)
    assert "r19" in [m.request_id for m in moves]  # late beats cut


def test_a_leaving_replica_s_streams_go_even_where_no_target_has_room():
    started = [_movable(i, StreamKind.RUNNING, slack_s=0.0) for i in range(2)]
    leaving = ReplicaLoad("old", flat_report(), tuple(started), drain_left_s=0.0)
    full = ReplicaLoad("full", flat_report(2 * GAMMA))
    fuller = ReplicaLoad("fuller", flat_report(3 * GAMMA))
    assert _ids(plan_moves([leaving, fuller, full])) == [("r0", "full"), ("r1", "full")]
    assert plan_moves([leaving, fuller, full], MigrateMode.QUEUED) == []  # they drain, or are cut


def test_a_request_is_queued_paused_or_running_by_its_state_and_an_ended_one_cannot_move():
    request = make_request("r", rate=RATE)
    expected = {
        RequestState.WAITING: StreamKind.QUEUED,
        RequestState.PREEMPTED: StreamKind.PAUSED,
        RequestState.RUNNING: StreamKind.RUNNING,
        RequestState.LOADING: StreamKind.RUNNING,
        RequestState.FINISHED: None,
        RequestState.ABORTED: None,
    }
    for state, kind in expected.items():
        request.state = state
        assert stream_kind(request) is kind
    request.state = RequestState.WAITING
    assert movable_of(request, 5.0, 2.0).kind is StreamKind.QUEUED
    assert movable_of(request, 5.0, 2.0).queued_s == 3.0
    request.state = RequestState.FINISHED
    with pytest.raises(ValueError, match="ended"):
        movable_of(request, 5.0, 2.0)


def test_a_replica_offers_its_queue_and_paused_streams_and_everything_once_it_leaves():
    queued = make_request("q", rate=RATE, arrival=1.0)
    paused = make_request("p", rate=RATE, arrival=0.5)
    running = make_request("r", rate=RATE)
    paused.state, running.state = RequestState.PREEMPTED, RequestState.RUNNING
    view = SimpleNamespace(now_s=5.0, waiting=(queued,), preempted=(paused,), running=(running,))
    report = flat_report()
    serving = replica_load("a", view, {"q": 4.0}, report=report)  # (q moved here at 4 s)
    assert [m.request_id for m in serving.movable] == ["q", "p"]
    assert [m.queued_s for m in serving.movable] == [1.0, 4.5]  # since its landing, or arrival
    assert serving.report is report and not serving.is_leaving
    leaving = replica_load("a", view, {}, report=report, drain_left_s=3.0)
    assert [m.request_id for m in leaving.movable] == ["q", "p", "r"]
    assert leaving.drain_left_s == 3.0
    only = replica_load("a", view, {}, report=report, movable_ids={"p"}, drain_left_s=3.0)
    assert [m.request_id for m in only.movable] == ["p"]


def test_a_replica_without_a_report_is_measured_from_its_view():
    core, clock, _ = make_core("tokenflow")
    core.add_request(make_request("q", rate=RATE))
    view = core.scheduler.view(clock.now())
    load = replica_load("a", view, {})
    assert load.report == load_report(view) and load.report.num_waiting == 1
    assert [m.request_id for m in load.movable] == ["q"]
